"""Checkpoint names of MoE experts onto transformers 5's fused expert parameters.

Checkpoints (and the trainer's publishing) name each expert's projections apart
(`...mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`); transformers >= 5 keeps all
experts of a layer in two parameters, `...mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then
up rows) and `...mlp.experts.down_proj` [E, H, I]. Each per-expert tensor is a view of those.
Mixtral's names (MiniMax-M2's checkpoints) put the MoE under `block_sparse_moe` (transformers' `mlp`)
and call an expert's gate, up and down projections w1, w3 and w2."""

from __future__ import annotations

import re

import torch

_PER_EXPERT = re.compile(r"(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)"
                         r"\.weight")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _model_name(name: str, targets: dict[str, torch.Tensor]) -> str:
    """transformers' name for a checkpoint's: block_sparse_moe is its mlp (the gate, the routing bias)."""
    renamed = name.replace(".block_sparse_moe.", ".mlp.", 1)
    return renamed if name not in targets and renamed in targets else name


def expert_views(tensors: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """(the tensors left, under transformers' names; [(name, the view of a fused parameter it fills, the tensor)]).
    A name stays in the tensors left when the model has it as such (no fused experts)."""
    rest, views = {}, []
    for name, tensor in tensors.items():
        match = _PER_EXPERT.fullmatch(name)
        proj = match and _MIXTRAL_PROJ.get(match["proj"], match["proj"])
        experts = match and match["experts"].replace(".block_sparse_moe.", ".mlp.", 1)
        fused = match and f"{experts}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if name in targets or not match or fused not in targets:
            rest[_model_name(name, targets)] = tensor
            continue
        target = targets[fused][int(match["e"])]
        if proj != "down_proj":
            half = target.shape[0] // 2
            target = target[:half] if proj == "gate_proj" else target[half:]
        views.append((name, target, tensor))
    return rest, views
