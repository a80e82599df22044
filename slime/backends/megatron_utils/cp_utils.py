"""slime.backends.megatron_utils.cp_utils, as slime's loss plug-ins use it (train_infer_mismatch_helper's
mis.py gathers and slices its per-token values with it). slurmrl hands the loss plug-ins every
sample's whole response on every context-parallel rank (trainer/context_parallel.py gathers them),
so gathering over CP and slicing back are the identity here."""

from __future__ import annotations

from torch import Tensor

from trainer.slime_loss import Reducer, sum_of_sample_mean

__all__ = ["all_gather_with_cp", "get_sum_of_sample_mean", "slice_log_prob_with_cp"]


def all_gather_with_cp(tensor: Tensor, total_length: int, response_length: int) -> Tensor:
    """The sample's whole response: what slurmrl's loss plug-ins already hold."""
    return tensor


def slice_log_prob_with_cp(values: Tensor, total_length: int, response_length: int) -> Tensor:
    """This CP rank's part of the sample's response, in slurmrl the whole of it (every CP rank
    computes the loss over whole responses)."""
    return values


def get_sum_of_sample_mean(total_lengths: list[int], response_lengths: list[int], loss_masks: list[Tensor],
                           sample_denoms: list[Tensor] | None = None,
                           calculate_per_token_loss: bool = False) -> Reducer:
    return sum_of_sample_mean(response_lengths, loss_masks, calculate_per_token_loss, sample_denoms)
