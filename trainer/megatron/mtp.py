"""What the MTP layers train on (--enable-mtp-training): at each position of a packed micro-batch,
MTP layer k (1-based) predicts the token k + 1 ahead, from the decoder's hidden state there and the
embeddings of the tokens in between (megatron's MTP block), as DeepSeek-V3 trains them. A
prediction counts where that token is a response token of the same sample, weighted by its loss
mask: prompts, padding and the next sample's tokens never do."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from torch import Tensor

from ckpt_tools.mtp_model import MTPGPTModel, MTPTargets
from trainer.context_parallel import RowLayout


def weighted(rows: RowLayout, loss_masks: list[Tensor]) -> RowLayout:
    """`rows` with each fed token's loss mask (float, 0 outside responses); loss_masks: the pack's
    samples', in its order (rows.rows: the positions that predict a response token, the next)."""
    weights = torch.zeros(len(rows.tokens), dtype=torch.float32)
    weights[rows.rows + 1] = torch.cat(loss_masks).float() if loss_masks else weights[:0]
    return dataclasses.replace(rows, token_weights=weights)


def targets(tokens: Tensor, weights: Tensor, cu_seqlens: Tensor, layers: int) -> MTPTargets:
    """(predicted token, its weight) at every position, [1, t] each, for each of `layers` MTP layers."""
    sample = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff().long().cpu())
    out = []
    for k in range(1, layers + 1):
        ahead = k + 1
        predicted, weight = torch.zeros_like(tokens), torch.zeros_like(weights)
        predicted[:-ahead] = tokens[ahead:]
        weight[:-ahead] = weights[ahead:] * (sample[:-ahead] == sample[ahead:])
        out.append((predicted[None], weight[None]))
    return out


def weigh_micro_batches(packs: int) -> int:
    """As megatron's schedule: each micro-batch's MTP loss counts 1 / the step's micro-batches (on
    every data-parallel rank: the gradients are summed over them). Returns that count."""
    packs = max(packs, 1)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / packs))
    return packs


def metrics(model: MTPGPTModel, packs: int) -> dict[str, Tensor]:
    """slime's train/mtp_loss and train/mtp_K_loss: over the step's micro-batches, the mean of each
    MTP layer's token-mean loss (this micro-batch's share: summed over the step's packs and ranks)."""
    losses = [total / count.clamp(min=1) / packs for total, count in model.mtp_losses]
    return {"mtp_loss": torch.stack(losses).sum(), **{f"mtp_{k}_loss": v for k, v in enumerate(losses, 1)}}
