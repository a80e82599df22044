"""The trainer's reports: one stdout line and one metrics.jsonl line per rollout, TensorBoard
scalars, and the heartbeat file the supervisor watches (phase and time, written atomically)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from supervisor.trainer_files import HEARTBEAT_FILE, METRICS_FILE


class Reporter:
    def __init__(self, job_dir: Path, tensorboard_dir: str | None) -> None:
        self.job_dir = job_dir
        job_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = job_dir / METRICS_FILE
        self.heartbeat_path = job_dir / HEARTBEAT_FILE
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(tensorboard_dir or str(job_dir / "tensorboard"))

    def heartbeat(self, phase: str, rollout_id: int) -> None:
        tmp = self.heartbeat_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"phase": phase, "rollout_id": rollout_id, "time": time.time(), "pid": os.getpid()}))
        os.replace(tmp, self.heartbeat_path)

    def rollout(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        for name, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(name, value, rollout_id)
        self.writer.flush()
        line = {"rollout_id": rollout_id, **metrics}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items())
        print(f"[trainer] {shown}", flush=True)

    def close(self) -> None:
        self.writer.close()
