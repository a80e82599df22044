"""Checkpoint names of MoE experts onto transformers 5's fused expert parameters.

Checkpoints (and the trainer's publishing) name each expert's projections apart
(`...mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`); transformers >= 5 keeps all
experts of a layer in two parameters, `...mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then
up rows) and `...mlp.experts.down_proj` [E, H, I]. Each per-expert tensor is a view of those."""

from __future__ import annotations

import re

import torch

_PER_EXPERT = re.compile(r"(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


def expert_views(tensors: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """(the tensors left, [(name, the view of a fused parameter it fills, the tensor)]). A name
    stays in the tensors left when the model has it as such (no fused experts)."""
    rest, views = {}, []
    for name, tensor in tensors.items():
        match = _PER_EXPERT.fullmatch(name)
        fused = match and f"{match['experts']}.{'down_proj' if match['proj'] == 'down_proj' else 'gate_up_proj'}"
        if name in targets or not match or fused not in targets:
            rest[name] = tensor
            continue
        target = targets[fused][int(match["e"])]
        if match["proj"] != "down_proj":
            half = target.shape[0] // 2
            target = target[:half] if match["proj"] == "gate_proj" else target[half:]
        views.append((name, target, tensor))
    return rest, views
