"""What torch_dist -> HF takes from the original checkpoint (the --hf-config folder, where it holds weights) besides
its config: how it keeps its experts (fused or apart), and the tensors slurmrl never converts (a multimodal
checkpoint's vision tower, Qwen3-Next's and Qwen3.5's mtp. module), written back unchanged, as slime's converter
does (its --origin-hf-dir)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ckpt_tools.hf_checkpoint import INDEX, SINGLE, VISION_PREFIX, CheckpointError, HFCheckpoint, unconverted_prefixes
from ckpt_tools.model_shape import ModelShape


@dataclass(frozen=True)
class Original:
    fused_experts: bool = False
    carried: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)  # name, shape, dtype
    checkpoint: HFCheckpoint | None = None

    def read(self, name: str) -> torch.Tensor:
        assert self.checkpoint is not None
        return self.checkpoint.read([name])[0]


def read_original(hf_config_dir: Path, shape: ModelShape) -> Original:
    """The layout of the checkpoint in `hf_config_dir`; a folder without weights: experts apart, nothing carried
    (CheckpointError for a multimodal model, whose vision tower is only there)."""
    folder = Path(hf_config_dir)
    if not (folder / SINGLE).is_file() and not (folder / INDEX).is_file():
        if shape.hf_prefix != "model.":  # multimodal
            raise CheckpointError(f"{folder} holds no weights: {shape.architecture} is multimodal, and its vision "
                                  f"tower ({VISION_PREFIX}, not trained) is copied from the original checkpoint: "
                                  "give its folder as --hf-config")
        return Original()
    original = HFCheckpoint(folder)
    carried = [(name, original.shapes[name], original.dtypes[name]) for name in sorted(original.shapes)
               if name.startswith(unconverted_prefixes(shape))]
    return Original(original.shape.fused_experts, carried, original)
