"""slime.rollout.sft_rollout: slime's SFT rollout (rollout.sft_rollout), at the path slime's SFT
scripts name in --rollout-function-path."""

from rollout.sft_rollout import generate_rollout

__all__ = ["generate_rollout"]
