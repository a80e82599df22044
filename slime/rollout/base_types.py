"""slime.rollout.base_types: what a --rollout-function-path (or --eval-function-path) may return,
instead of the bare list of groups (train) or dict of sets (eval) of slime's older plug-ins;
rollout.rollout_output reads either shape."""

from __future__ import annotations

from rollout.rollout_output import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn

__all__ = ["RolloutFnEvalOutput", "RolloutFnTrainOutput", "call_rollout_fn"]
