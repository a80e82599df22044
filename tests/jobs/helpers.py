"""A valid small job (CPU trainer worker, two CPU engines on one rollout node) as flags, and a fake
model folder and prompts file: enough for validation; the stand-in callables never read them."""

from __future__ import annotations

import json
from pathlib import Path


def job_files(root: Path) -> tuple[Path, Path]:
    model, data = root / "model", root / "toy.jsonl"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    data.write_text(json.dumps({"input": "repeat 1", "label": "1"}) + "\n")
    return model, data


def job_flags(root: Path, name: str, job_dir: Path | None = None) -> list[str]:
    model, data = job_files(root)
    return ["--job-name", name, "--partition", "dev", "--time", "10", "--preempt-grace", "60",
            "--actor-num-gpus-per-node", "0", "--actor-cpus-per-task", "1",
            "--rollout-engine", "cpu", "--rollout-num-engines", "2", "--rollout-cpus-per-engine", "1",
            "--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-rollout", "2",
            "--rm-type", "toy", "--label-key", "label", "--n-samples-per-prompt", "2", "--job-dir", str(job_dir or root / "job")]
