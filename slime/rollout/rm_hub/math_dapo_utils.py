"""slime.rollout.rm_hub.math_dapo_utils: DAPO's grading (rollout.dapo_grading), as retool's reward
imports it: compute_score(solution_str, ground_truth, strict_box_verify=False)."""

from rollout.dapo_grading import compute_score, last_boxed_only_string, normalize_final_answer

__all__ = ["compute_score", "last_boxed_only_string", "normalize_final_answer"]
