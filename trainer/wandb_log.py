"""slime's W&B logging (--use-wandb and its flags): rank 0 logs each rollout's metrics to one run.

The run's id and group are kept in the job dir (JobDir.wandb_run), so a restarted or requeued
trainer goes on logging into the same run. A resumed run redoes the rollouts after its checkpoint;
W&B ignores steps it already has, and an exact resume logs the same values for them anyway.

Compute nodes often have no way out: when neither --wandb-mode nor WANDB_MODE chose a mode and
the W&B server cannot be reached, the run is kept offline in the job dir (slime would wait out
W&B's init timeout and fail); `wandb sync` uploads it later, as the log line says.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any, Literal, cast
from urllib.parse import urlsplit

from contract.job_dir import JobDir, write_atomic
from trainer.config import LoggingOptions

log = logging.getLogger(__name__)

# Never sent to W&B as the run's config: secrets.
_SECRETS = ("api_key", "wandb_key")
WANDB_SERVER = "https://api.wandb.ai"  # W&B's own default
SERVER_PROBE_TIMEOUT_S = 5.0  # a TCP connect to the W&B server, to choose online or offline


class WandbError(RuntimeError):
    pass


def reachable(url: str, timeout_s: float = SERVER_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the server of `url` opens within timeout_s."""
    parts = urlsplit(url if "://" in url else f"https://{url}")
    try:
        with socket.create_connection((parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443)),
                                      timeout=timeout_s):
            return True
    except OSError:  # no route, refused, no DNS, timeout
        return False


WandbMode = Literal["online", "offline", "disabled", "shared"]


def _mode(options: LoggingOptions, directory: str) -> WandbMode:
    chosen = options.wandb_mode or os.environ.get("WANDB_MODE")
    if chosen:
        return cast(WandbMode, chosen)  # passed on as given: wandb.init refuses a mode it does not know
    server = options.wandb_host or os.environ.get("WANDB_BASE_URL") or WANDB_SERVER
    if reachable(server):
        return "online"
    log.warning("W&B server %s cannot be reached from this node: the run is kept offline under %s; upload it "
                "later with `wandb sync %s/wandb/offline-run-*`", server, directory, directory)
    return "offline"


def _run_identity(options: LoggingOptions, job_dir: JobDir, new_id: Callable[[], str]) -> dict[str, str]:
    """The run's id and group: --wandb-run-id, else the job's saved ones, else new ones (saved)."""
    if options.wandb_run_id:
        return {"id": options.wandb_run_id, "group": options.wandb_group or job_dir.root.name}
    if job_dir.wandb_run.is_file():
        return json.loads(job_dir.wandb_run.read_text())
    group = options.wandb_group or job_dir.root.name
    if options.wandb_random_suffix:
        group = f"{group}_{new_id()}"
    identity = {"id": new_id(), "group": group}
    write_atomic(job_dir.wandb_run, json.dumps(identity))
    return identity


class WandbRun:
    def __init__(self, options: LoggingOptions, job_dir: JobDir, *, steps_per_rollout: int,
                 run_config: dict[str, Any]) -> None:
        """run_config: every flag by slime's name (TrainerConfig.flat()), W&B's record of the run."""
        try:
            import wandb
        except ImportError:
            raise WandbError("--use-wandb needs the wandb package on the trainer's nodes: pip install wandb") from None
        directory = options.wandb_dir or str(job_dir.root)
        mode = _mode(options, directory)
        if mode == "online" and options.wandb_key:
            wandb.login(key=options.wandb_key, host=options.wandb_host)
        identity = _run_identity(options, job_dir, lambda: secrets.token_hex(4))
        self.steps_per_rollout = steps_per_rollout
        self.use_train_step = options.wandb_always_use_train_step
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(id=identity["id"], resume="allow", entity=options.wandb_team,
                              project=options.wandb_project, group=identity["group"], name=identity["group"],
                              dir=directory, mode=mode,
                              config={k: v for k, v in run_config.items() if k not in _SECRETS})
        log.info("logging to W&B run %s (%s mode)", identity["id"], mode)

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        """One rollout's numbers, at step rollout_id (or the optimizer steps done by its end)."""
        step = (rollout_id + 1) * self.steps_per_rollout if self.use_train_step else rollout_id
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log({**numbers, "rollout/step": rollout_id}, step=step)

    def close(self) -> None:
        self.run.finish()
