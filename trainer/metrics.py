"""The trainer's reports: one stdout line and one metrics.jsonl line per rollout (its eval numbers
included), TensorBoard scalars at step rollout_id, W&B with --use-wandb (trainer/wandb_log.py), and
the heartbeat the supervisor watches (the files are contract/job_dir.py's)."""

from __future__ import annotations

import json
import time
from typing import Any

from contract.job_dir import JobDir, Metric, Phase, append_metrics, write_atomic, write_heartbeat
from trainer.wandb_log import WandbRun


class Reporter:
    def __init__(self, job_dir: JobDir, tensorboard_dir: str | None, wandb: WandbRun | None = None) -> None:
        self.job_dir = job_dir
        job_dir.root.mkdir(parents=True, exist_ok=True)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(tensorboard_dir or str(job_dir.tensorboard))
        self.wandb = wandb
        self._phase: tuple[Phase, int, float] | None = None  # the beating phase: (phase, rollout, since)

    def heartbeat(self, phase: Phase, rollout_id: int) -> None:
        """A beat; again in the same phase of the same rollout (an optimizer step, a save's progress), it
        keeps when that phase began: the supervisor judges a save in progress by it (supervisor/deadline.py)."""
        same = self._phase is not None and self._phase[:2] == (phase, rollout_id)
        since = self._phase[2] if same and self._phase is not None else time.time()
        self._phase = (phase, rollout_id, since)
        write_heartbeat(self.job_dir, phase, rollout_id, since=since)

    def rollout(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        self._scalars(rollout_id, metrics)
        if self.wandb:
            self.wandb.log(rollout_id, metrics)
        line = append_metrics(self.job_dir, rollout_id, metrics)
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in line.items())
        print(f"[trainer] {shown}", flush=True)

    def amend(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        """Add `metrics` to rollout_id's line (an eval that a save-now left to the resumed run)."""
        self._scalars(rollout_id, metrics)
        path = self.job_dir.metrics
        lines = [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
        for line in lines:
            if line[Metric.ROLLOUT_ID] == rollout_id:
                line.update(metrics)
        write_atomic(path, "".join(json.dumps(line) + "\n" for line in lines))

    def drop_from(self, rollout_id: int) -> None:
        """A resumed run redoes the rollouts after its checkpoint: forget their earlier lines."""
        path = self.job_dir.metrics
        if not path.is_file():
            return
        kept = [line for line in path.read_text().splitlines()
                if line and json.loads(line)[Metric.ROLLOUT_ID] < rollout_id]
        write_atomic(path, "".join(line + "\n" for line in kept))

    def _scalars(self, step: int, metrics: dict[str, Any]) -> None:
        for name, value in metrics.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        if self.wandb:
            self.wandb.close()
