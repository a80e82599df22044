"""`python -m ckpt_tools verify --hf DIR` on a GPU machine: megatron-core builds the model on the
GPU, and its logits (brought back to the CPU) equal HF's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ckpt_tools.tiny_hf import make_tiny_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "glm4",
                                  "minimax_m2", "qwen3_next", "qwen3_5", "qwen3_5_moe_vl"])
def test_verify_passes_on_the_gpu(arch: str, tmp_path: Path) -> None:
    hf = make_tiny_hf(arch, tmp_path / "hf", tied=False)
    done = subprocess.run([sys.executable, "-m", "ckpt_tools", "verify", "--hf", str(hf)], capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bit-identical" in done.stdout and "Megatron logits equal HF's" in done.stdout
