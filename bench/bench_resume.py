"""Work lost and time to resume, per failure kind, on the devcluster, against a plain restart from
the last periodic checkpoint (the baseline: what a job without slurmrl's handling does after any
failure: it dies, is submitted again and resumes from its --save-interval checkpoint).

The toy job runs with a slow reward model (each rollout about 1.4 s, so "rollouts lost" is read
at a known pace) and --save-interval 5. Each failure is injected once 8 rollouts are done (three
past the periodic checkpoint after rollout 4), each on its own job:

- preempt:    SLURM's warning signal (scancel --batch --signal=USR1): save at the boundary, requeue
- requeue:    scontrol requeue (SLURM ends the job at once; the trainer saves on SIGTERM)
- trainer:    SIGKILL trainer rank 0: in-job restart from the latest checkpoint
- engine:     SIGKILL engine-0: its requests go to the other engine; the engine comes back
- supervisor: SIGKILL the supervisor: restarted in the allocation, adopts every step
- node:       engine-0's node dies (its slurmd and the engine's step): the engine moves to the
              spare node (--rollout-spare-nodes 1); requests go to the other engine meanwhile
- node-requeue: the same without a spare node and with --min-engines 2: save, requeue excluding
              the node, resume on the others
- baseline:   SIGKILL the whole job (scancel --full --signal=KILL), then a new submission that
              loads the same checkpoints

Per kind: rollouts lost (completed before the failure, then done again); seconds from the failure
to the first rollout completed after it (for a restarted trainer: its first rollout), with the
ratio to the baseline's, measured in the same process; seconds from the (re)start (the new
supervisor, or the in-job trainer restart) to that rollout; for the requeue kinds the seconds
from the failure until SLURM has the job pending again; and where the job goes on without
engine-0 for a while, the seconds until engine-0 is back in the router.

    python -m bench.bench_resume [--workdir DIR]      # devcluster up; run as root
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


from rollout.tiny_model import write_tiny_model
from rollout.toy_task import write_toy_data
from slurm.devcluster import DevCluster
from slurm.devcluster.config import DEFAULT_ROOT
from slurm.devcluster.daemons import wait_for
from tests.integration.test_rl_job import listening_pid
from tests.slurm_helpers import kill_node, wait_job_gone

ROOT = Path(__file__).resolve().parents[1]
AT = 8  # inject once this many rollouts are done
FLAGS = ("--num-rollout", "14", "--rollout-batch-size", "8", "--save-interval", "5",
         "--custom-rm-path", "tests.trainer.plugins.slow_toy_reward")


def submit(job_dir: Path, model: Path, data: Path, *extra: str) -> str:
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "submit", "examples/toy_job.yaml", "--json",
                          "--job-dir", str(job_dir), "--hf-checkpoint", str(model), "--prompt-data", str(data),
                          *FLAGS, *extra], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])["job_id"]


def rollout_ids(job_dir: Path) -> list[int]:
    path = job_dir / "metrics.jsonl"
    return [json.loads(line)["rollout_id"] for line in path.read_text().splitlines()] if path.exists() else []


def seen(what: Callable[[], bool], name: str) -> float:
    """The time `what` first holds, polled every 50 ms."""
    wait_for(what, 600, name, interval_s=0.05)
    return time.time()


def resumed_at(job_dir: Path) -> list[int]:
    log = job_dir / "logs" / "trainer.log"
    return [int(n) for n in re.findall(r"next rollout (\d+)", log.read_text())] if log.exists() else []


def pending_again(job_id: str) -> None:
    def pending() -> bool:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
        return "PENDING" in out.split()
    wait_for(pending, 300, f"job {job_id} pending again", interval_s=0.05)


def event_times(job_dir: Path, kinds: tuple[str, ...], after: float) -> list[float]:
    rows = map(json.loads, (job_dir / "events.jsonl").read_text().splitlines())
    return [e["time"] for e in rows if e["kind"] in kinds and e["time"] > after]


def supervisor_pid(job_dir: Path) -> int:
    started = [json.loads(line) for line in (job_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in started if e["kind"] == "supervisor_started"][-1]["pid"]


def engine_0(job_dir: Path) -> dict:
    return json.loads((job_dir / "supervisor_state.json").read_text())["steps"]["engine-0"]


def kill_engine_0_node(job_dir: Path) -> None:
    engine = engine_0(job_dir)
    kill_node(DevCluster(DEFAULT_ROOT), engine["nodes"][0], listening_pid(engine["url"]))


def trainer_rank0(job_dir: Path) -> int:
    return json.loads((job_dir / "trainer_heartbeat.json").read_text())["pid"]


INJECT: dict[str, Callable[[str, Path], None]] = {
    "preempt": lambda job, d: subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True),
    "requeue": lambda job, d: subprocess.run(["scontrol", "requeue", job], check=True),
    "trainer": lambda job, d: os.kill(trainer_rank0(d), signal.SIGKILL),
    "engine": lambda job, d: os.kill(listening_pid(engine_0(d)["url"]), signal.SIGKILL),
    "supervisor": lambda job, d: os.kill(supervisor_pid(d), signal.SIGKILL),
    "node": lambda job, d: kill_engine_0_node(d),
    "node-requeue": lambda job, d: kill_engine_0_node(d),
}
# Where the job goes on while engine-0 is away, it runs long enough to see engine-0 come back (a
# lost node is noticed 10-30 s after its slurmd stops); the measurements end at rollout 13 anyway.
LONGER = ("--num-rollout", "60")
KIND_FLAGS = {"engine": LONGER, "node": ("--rollout-spare-nodes", "1", *LONGER), "node-requeue": ("--min-engines", "2", *LONGER)}
REQUEUED = ("preempt", "requeue", "node-requeue")


def one(kind: str, root: Path, model: Path, data: Path) -> dict[str, float]:
    """Inject `kind` after AT rollouts; measure until the job's first rollout after it."""
    job_dir = root / kind
    job_id = submit(job_dir, model, data, *KIND_FLAGS.get(kind, ()))
    restart_dir = root / f"{kind}-restart"
    lost_node = None
    try:
        wait_for(lambda: len(rollout_ids(job_dir)) >= AT, 600, f"{AT} rollouts", interval_s=0.05)
        lost_node = engine_0(job_dir)["nodes"][0] if kind.startswith("node") else None
        done, began = len(rollout_ids(job_dir)), time.time()
        row: dict[str, float] = {}
        resumed_dir = job_dir
        if kind == "baseline":  # no save on the way down: SIGKILL the trainer, then the whole job
            os.kill(trainer_rank0(job_dir), signal.SIGKILL)
            subprocess.run(["scancel", "--full", "--signal=KILL", job_id], check=True)
            wait_job_gone(job_id)
            submit(restart_dir, model, data, "--load", str(job_dir / "checkpoints"))
            resumed_dir = restart_dir
        else:
            INJECT[kind](job_id, job_dir)
            if kind in REQUEUED:
                pending_again(job_id)
                row["to_pending_s"] = time.time() - began
        if kind in ("engine", "supervisor", "node"):  # the trainer goes on: its next rollout
            row["to_rollout_s"] = seen(lambda: len(rollout_ids(job_dir)) > done, "the next rollout") - began
            row["lost"] = float(len(resumed_at(job_dir)))  # trainer restarts, each redoing work: none expected
            if kind != "supervisor":
                back = seen(lambda: bool(event_times(job_dir, ("engine_recovered",), began)), "engine-0 back")
                row["engine_back_s"] = back - began
        else:
            # The resumed trainer drops metrics lines from its resume point on before logging it, so a
            # line of that rollout seen after the log line is the resumed run's first rollout.
            seen(lambda: bool(resumed_at(resumed_dir)), "the resumed trainer")
            first = resumed_at(resumed_dir)[0]
            row["to_rollout_s"] = seen(lambda: first in rollout_ids(resumed_dir), "its first rollout") - began
            row["lost"] = float(max(0, done - first))
            restarted = event_times(resumed_dir, ("supervisor_started", "trainer_restarted"), began)
            row["start_to_rollout_s"] = began + row["to_rollout_s"] - restarted[0]
        wait_for(lambda: 13 in rollout_ids(resumed_dir), 600, "the job's last rollout")
        return row
    finally:
        if lost_node is not None:
            DevCluster(DEFAULT_ROOT).revive_slurmd(lost_node)
        for d in (job_dir, restart_dir):
            if (d / "slurm_job_id").exists():
                job = (d / "slurm_job_id").read_text().strip()
                subprocess.run(["scancel", job], capture_output=True)
                wait_job_gone(job)  # before its folder is removed: a job still ending writes there


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", help="keep the jobs here (default: a temporary folder)")
    parser.add_argument("--kinds", default="baseline,preempt,requeue,trainer,engine,supervisor,node,node-requeue",
                        help="baseline first: the others' ratios are to it")
    opts = parser.parse_args()
    print(f"toy job, slow reward (~1.4 s a rollout), --save-interval 5, failure after {AT} rollouts")
    print(f"{'kind':12s} {'lost':>5s} {'to first rollout after':>24s} {'(re)start to rollout':>21s} {'to pending':>11s}"
          f" {'engine back':>12s}", flush=True)
    base: dict[str, float] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(opts.workdir or tmp)
        model, data = write_tiny_model(root / "model"), write_toy_data(root / "toy.jsonl")
        for kind in opts.kinds.split(","):  # each row as it is measured: a full run takes a while
            row = one(kind, root, model, data)
            base = row if kind == "baseline" else base
            ratio = f" ({row['to_rollout_s'] / base['to_rollout_s']:.2f}x)" if base else ""
            start = f"{row['start_to_rollout_s']:.1f} s" if "start_to_rollout_s" in row else "-"
            pending = f"{row['to_pending_s']:.1f} s" if "to_pending_s" in row else "-"
            back = f"{row['engine_back_s']:.1f} s" if "engine_back_s" in row else "-"
            print(f"{kind:12s} {row['lost']:5.0f} {row['to_rollout_s']:14.1f} s{ratio:>8s} {start:>21s} {pending:>11s}"
                  f" {back:>12s}", flush=True)


if __name__ == "__main__":
    main()
