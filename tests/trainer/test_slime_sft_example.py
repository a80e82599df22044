"""retool's SFT stage as slime runs it (examples/retool/retool_qwen3_4b_sft.sh's SFT, perf, optimizer
and misc flags, with this machine's paths and model): `python -m trainer` with slime's SFT rollout,
no engines (--debug-train-only), no advantages (--disable-compute-advantages-and-returns),
--num-epoch 3 over two conversations, two a rollout: three rollouts, each the same two
conversations' SFT loss, which falls. Main refused --num-epoch and
--disable-compute-advantages-and-returns, and --debug-train-only needed a rollout dump."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow
import pyarrow.parquet

from rollout.tiny_model import write_tiny_model
from tests.rank_devices import hidden_gpus

RUN_S = 600  # the trainer's whole run: three SFT steps of a tiny model on CPU

SFT_ARGS = ["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout", "--input-key", "messages",
            "--rollout-shuffle", "--num-epoch", "3", "--rollout-batch-size", "2", "--global-batch-size", "2",
            "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
            "--debug-train-only"]
PERF_ARGS = ["--tensor-model-parallel-size", "1", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
             "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
             "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216"]
OPTIMIZER_ARGS = ["--optimizer", "adam", "--lr", "1e-5", "--lr-decay-style", "cosine", "--min-lr", "1e-6",
                  "--lr-warmup-fraction", "0.1", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95"]
# (slime's --attention-backend flash needs a GPU; this trainer runs on CPU)
MISC_ARGS = ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
             "--attention-softmax-in-fp32"]


def _conversations(path: Path) -> Path:
    """ReTool-SFT's shape (sft_data_processing.py: a "messages" column), two conversations."""
    messages = [[{"role": "user", "content": f"What is {a} times 7?"},
                 {"role": "assistant", "content": f"<code>print({a} * 7)</code>\n<interpreter>{a * 7}</interpreter>\n"
                                                  f"Answer: \\boxed{{{a * 7}}}"}] for a in (6, 8)]
    pyarrow.parquet.write_table(pyarrow.table({"messages": messages}), path)
    return path


def test_retools_sft_stage_trains_without_engines(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "model", seed=0)
    job = tmp_path / "job"
    argv = [sys.executable, "-m", "trainer", "--hf-checkpoint", str(model), "--save", str(tmp_path / "save"),
            "--save-interval", "1000", "--prompt-data", str(_conversations(tmp_path / "ReTool-SFT.parquet")),
            "--job-dir", str(job), *SFT_ARGS, *PERF_ARGS, *OPTIMIZER_ARGS, *MISC_ARGS]
    done = subprocess.run(argv, env={**os.environ, **hidden_gpus(1)}, capture_output=True, text=True, timeout=RUN_S,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in rows] == [2, 2, 2]  # 3 epochs x 2 conversations // 2 a rollout
    losses = [r["sft_loss"] for r in rows]
    assert losses[0] > losses[1] > losses[2], losses
    assert (tmp_path / "save" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
