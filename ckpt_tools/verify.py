"""`slurmrl ckpt verify`: convert HF -> torch_dist -> HF and require bit-identical weights, then
(when both models fit in memory) require Megatron's logits on the converted checkpoint to equal
the HF model's on a few random prompts."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from ckpt_tools.architectures import GATED_DELTA_NET_ARCHITECTURES
from ckpt_tools.convert import hf_to_torch_dist, torch_dist_to_hf
from ckpt_tools.hf_checkpoint import HFCheckpoint
from ckpt_tools.hf_cpu_kernels import use_torch_kernels
from ckpt_tools.inspect import roundtrip_differences
from ckpt_tools.qwen3_5_config import language_model_config


@dataclass
class Verdict:
    roundtrip_problems: list[str]
    logits_max_diff: float | None  # None: the logits check did not run
    note: str = ""


def fp32_bytes_of_both_models(hf_dir: Path) -> int:
    """HF and Megatron copies of the model, both in fp32."""
    hf = HFCheckpoint(hf_dir)
    params = sum(torch.Size(s).numel() for s in hf.shapes.values())
    return 2 * 4 * params


def logits_max_diff(hf_dir: Path, ckpt_folder: Path, prompts: int = 4, seq_len: int = 32, seed: int = 0,
                    mtp_layers: int = 0) -> float:
    """max |Megatron - HF| over random prompts, fp32, TP=1 in this process (the checkpoint holding
    `mtp_layers` MTP layers, which the logits do not go through)."""
    import transformers

    from ckpt_tools.megatron_model import (
        build_gpt_model,
        destroy_parallel,
        init_parallel,
        load_torch_dist,
        megatron_logits,
    )

    config = language_model_config(json.loads((Path(hf_dir) / "config.json").read_text()))
    if config["architectures"][0] in GATED_DELTA_NET_ARCHITECTURES:  # the reference runs on the CPU, fla or not
        use_torch_kernels()
    ids = torch.randint(0, config["vocab_size"], (prompts, seq_len), generator=torch.Generator().manual_seed(seed))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf_model(ids).logits
    del hf_model
    init_parallel(tp=1, ep=1)
    try:
        model = build_gpt_model(config, mtp_layers=mtp_layers)
        load_torch_dist(model, ckpt_folder)
        return (megatron_logits(model, ids) - expected).abs().max().item()
    finally:
        destroy_parallel()


def verify(hf_dir: Path, make_vocab_size_divisible_by: int = 128, logits: bool = True) -> Verdict:
    """Both conversions (every MTP layer the checkpoint holds kept) and the logits against transformers'."""
    mtp_layers = HFCheckpoint(hf_dir).mtp_layers_held()
    with tempfile.TemporaryDirectory(prefix="slurmrl-verify-") as tmp:
        folder = hf_to_torch_dist(hf_dir, Path(tmp) / "td", make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                  mtp_layers=mtp_layers, progress=False)
        torch_dist_to_hf(Path(tmp) / "td", Path(tmp) / "hf", hf_dir, progress=False)
        problems = roundtrip_differences(hf_dir, Path(tmp) / "hf")
        if not logits:
            return Verdict(problems, None, "logits check skipped (--no-logits)")
        need, available = fp32_bytes_of_both_models(hf_dir), psutil.virtual_memory().available
        if need > 0.8 * available:
            return Verdict(problems, None, f"logits check skipped: needs {need / 1024**3:.1f} GiB, "
                                           f"{available / 1024**3:.1f} GiB available")
        return Verdict(problems, logits_max_diff(hf_dir, folder, mtp_layers=mtp_layers))
