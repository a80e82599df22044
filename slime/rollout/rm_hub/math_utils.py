"""slime.rollout.rm_hub.math_utils: the \\boxed{} answer and verl's math grading (rollout.math_grading)."""

from rollout.math_grading import extract_answer, grade_answer_verl

__all__ = ["extract_answer", "grade_answer_verl"]
