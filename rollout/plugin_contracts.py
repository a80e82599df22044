"""The plug-in contracts: what each slime flag that names a user's function calls, and the slime
signature it mirrors. A plug-in written for slime runs unchanged; `args` is slime's Namespace
(trainer.config.TrainerConfig.plugin_namespace), samples are slime's Sample (rollout.sample, at
slime.utils.types). Each contract is loaded by rollout.plugins.load_function (or, for the
trainer's, trainer.plugin_calls) and typed as its Protocol where it is called.

Where slime accepts several shapes (a reward function sync or async, a filter's verdict a bool
or a DynamicFilterOutput), the Protocol gives the widest one and the caller reads each.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from rollout.sample import Sample

if TYPE_CHECKING:
    from rollout.filters import DynamicFilterOutput
    from rollout.rollout_output import RolloutFnEvalOutput, RolloutFnTrainOutput

Groups = list[list[Sample]]


class DataSource(Protocol):
    """What a rollout function draws prompts from: slime's RolloutDataSourceWithBuffer
    (slime/rollout/data_source.py), slurmrl's rollout.buffer.DataBuffer."""

    def get_samples(self, num_samples: int) -> Groups:
        """`num_samples` groups of n_samples_per_prompt samples: given-back groups first."""

    def add_samples(self, samples: Groups) -> None:
        """Give groups back (partial rollout): the next get_samples returns them first."""


class RolloutFunction(Protocol):
    """--rollout-function-path, --eval-function-path: slime's
    slime.rollout.sglang_rollout.generate_rollout(args, rollout_id, data_source, evaluation=False).
    Train: groups of samples (or RolloutFnTrainOutput, with metrics); eval (evaluation=True):
    {set name: {"rewards", "truncated", "samples"}} (or RolloutFnEvalOutput)."""

    def __call__(self, args: Any, rollout_id: int, data_source: DataSource | None, *, evaluation: bool = False
                 ) -> Groups | RolloutFnTrainOutput | dict[str, dict[str, Any]] | RolloutFnEvalOutput: ...


class CustomGenerate(Protocol):
    """--custom-generate-function-path: slime's
    `async def generate(args, sample, sampling_params[, evaluation=False]) -> Sample | list[Sample]`
    (evaluation= is passed where the signature names it). What it returns takes the argument's
    place in its group; a list is several samples for one prompt (a multi-turn agent's)."""

    def __call__(self, args: Any, sample: Sample, sampling_params: dict[str, Any], /, **evaluation: bool
                 ) -> Awaitable[Sample | list[Sample] | None]: ...


class RewardFunction(Protocol):
    """--custom-rm-path: slime's `async def reward(args, sample, **kwargs)` -> a number or a dict
    (--reward-key picks one); with --group-rm, `(args, samples) -> list`, one per sample. slurmrl
    also takes a plain function."""

    def __call__(self, args: Any, sample: Sample | list[Sample], /, **kwargs: Any) -> Any: ...


class DynamicSamplingFilter(Protocol):
    """--dynamic-sampling-filter-path: slime's `filter(args, samples, **kwargs) -> DynamicFilterOutput`
    (slime/rollout/filter_hub/dynamic_sampling_filters.py); a bool works too."""

    def __call__(self, args: Any, samples: list[Sample], /, **kwargs: Any) -> DynamicFilterOutput | bool: ...


class SampleHook(Protocol):
    """--rollout-sample-hook-path: slime's `hook(args, sample, *, rollout_id, evaluation)` on each
    finished sample before its reward (slime/rollout/sample_hooks.py); sync or async; a returned
    sample replaces the argument, None keeps it."""

    def __call__(self, args: Any, sample: Sample, /, *, rollout_id: int, evaluation: bool) -> Any: ...


class EvalLogFunction(Protocol):
    """--custom-eval-rollout-log-function-path: slime's `log(rollout_id, args, data, extra_metrics)`;
    True means it did the logging itself."""

    def __call__(self, rollout_id: int, args: Any, data: dict[str, dict[str, Any]],
                 extra_metrics: dict[str, float], /) -> bool: ...


class BufferFilter(Protocol):
    """--buffer-filter-path: slime's `filter(args, rollout_id, buffer, num_samples)`, which takes (and
    removes) up to num_samples groups from the given-back groups (slime's default: pop_first;
    rollout_id is None, as slime passes it)."""

    def __call__(self, args: Any, rollout_id: int | None, buffer: Groups, num_samples: int, /) -> Groups: ...


# ---- the trainer's (trainer.plugin_calls): slime's RolloutBatch is a dict of per-sample lists --------
RolloutBatch = dict[str, Any]  # "tokens", "response_lengths", "loss_masks", "advantages", ... (trainer.rollout_batch)


class RewardPostProcess(Protocol):
    """--custom-reward-post-process-path: slime's `post_process(args, samples) -> (raw_rewards, rewards)`,
    in place of the group normalization (rewards are then trained on as given)."""

    def __call__(self, args: Any, samples: list[Sample], /) -> tuple[list[float], list[float]]: ...


class ConvertSamplesToTrainData(Protocol):
    """--custom-convert-samples-to-train-data-path: slime's `convert(args, samples) -> train_data`, a dict
    with "tokens", "response_lengths", "rewards", "loss_masks" (and optionally "raw_reward",
    "rollout_log_probs"), one entry per sample; rewards are trained on as given."""

    def __call__(self, args: Any, samples: list[Sample], /) -> RolloutBatch: ...


class CustomAdvantage(Protocol):
    """--custom-advantage-function-path: slime's `advantages(args, rollout_data)`, called after the KL
    ("kl") is computed; it sets rollout_data["advantages"] and ["returns"] (a [R] tensor per sample)."""

    def __call__(self, args: Any, rollout_data: RolloutBatch, /) -> None: ...


class RolloutDataPostprocess(Protocol):
    """--rollout-data-postprocess-path: slime's `postprocess(args, rollout_id, rollout_data)` after the
    advantages, before training; it may change advantages, returns and loss_masks in place."""

    def __call__(self, args: Any, rollout_id: int, rollout_data: RolloutBatch, /) -> None: ...


class CustomLoss(Protocol):
    """--custom-loss-function-path with --loss-type custom_loss: slime's
    `loss(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)` per micro-batch. `logits` is
    slurmrl's trainer.slime_loss.ResponseLogits (the response tokens' log-probs and entropies, with
    their gradient); slime.backends.megatron_utils.loss.get_log_probs_and_entropy reads it as slime's
    reads the logits. The loss is in slime's scale: sum_of_sample_mean's."""

    def __call__(self, args: Any, batch: RolloutBatch, logits: Any, sum_of_sample_mean: Any, /) -> Any: ...


class TisFunction(Protocol):
    """--custom-tis-function-path: slime's `tis(args=, pg_loss=, train_log_probs=, rollout_log_probs=,
    loss_masks=, total_lengths=, response_lengths=) -> (pg_loss, modified_loss_masks, metrics)`; pg_loss
    and each metric are the micro-batch's response tokens concatenated."""

    def __call__(self, **kwargs: Any) -> tuple[Any, list[Any], dict[str, Any]]: ...


class PgLossReducer(Protocol):
    """--custom-pg-loss-reducer-function-path: slime's
    `make_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss)`, returning the
    function that reduces the concatenated pg_loss to the micro-batch's (slime's scale)."""

    def __call__(self, total_lengths: list[int], response_lengths: list[int], loss_masks: list[Any],
                 calculate_per_token_loss: bool, /) -> Any: ...
