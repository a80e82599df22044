"""The toy RL job through `slurmrl submit` on the devcluster: the supervisor, the real router, two CPU
engines and the real trainer as steps of one heterogeneous job, no mocks. One job serves both sets
of checks (independent: the failures come after the profiles are written, and each recovery is
waited for before the next failure):

- The plain run: one hetjob in sacct, every step in `slurmrl status`, rewards rising.
  `slurmrl profile --rollout` and `--train` leave Chrome traces of exactly the asked steps (each
  engine's forward steps, the trainer's optimizer steps) under JOB_DIR/profiles/, every metrics
  line has each phase's time, and `slurmrl report` plots the ended job.
- Then: report a healthy engine as failed (one probe keeps it in), SIGKILL an engine, SIGSTOP one
  (a hang), make one answer 503, kill the router, `slurmrl restart` an engine. Each time the engine
  (or router) comes back at the current weight version, events.jsonl shows detection and recovery
  with their times, and no engine ever served a rollout with stale weights (the engines' own logs:
  rollout R must be served at version R). Another uid cannot steer the job; `slurmrl stop` saves
  the last rollout trained and ends it.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import requests

from ckpt_tools.tracker import iteration_dirname
from contract.control_protocol import Call, ControlClient, ControlError
from contract.job_dir import PHASE_TIMES, JobDir
from rollout.cpu_engine.scheduler import FORWARD_STEP
from slurm.devcluster.daemons import wait_for
from supervisor.keys import load_key
from tests.slurm_helpers import listening_pid, sacct_rows, wait_job_gone, wait_sacct_states
from trainer.profiling import PHASE, TRAIN_STEP

ROOT = Path(__file__).resolve().parents[2]
SERVED = re.compile(r"cpu_engine served rid=r(\d+)-\S+ weight_version=(\S+)")


def slurmrl(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "jobs.cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, stdin=subprocess.DEVNULL)
    assert not check or done.returncode == 0, f"slurmrl {' '.join(argv)}: {done.stdout}{done.stderr}"
    return done


def submit(toy: tuple[Path, Path], job_dir: Path, *flags: str) -> str:
    model, data = toy
    done = slurmrl("submit", "examples/toy_job.yaml", "--json", "--job-dir", str(job_dir), "--hf-checkpoint",
                   str(model), "--prompt-data", str(data), *flags)
    return json.loads(done.stdout.strip().splitlines()[-1])["job_id"]


# Between two looks at `slurmrl status` in a wait: each is a process of about half a second of CPU, and a
# wait at wait_for's default 0.2 s would keep a core of the 2-core CI machine busy beside the job under test
STATUS_POLL_S = 1.0


@contextmanager
def background_job(toy: tuple[Path, Path], job_dir: Path, *flags: str) -> Iterator[str]:
    """A job submitted now, to run beside the test's own: the toy job's tasks take 1 or 2 of a node's 8
    CPUs and ask for no node of their own, so SLURM runs two toy jobs at once on the devcluster (their
    ports differ, each from its job id). Cancelled when the block ends (a no-op once it has ended)."""
    job_id = submit(toy, job_dir, *flags)
    try:
        yield job_id
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)


def status(job_dir: Path) -> dict:
    return json.loads(slurmrl("status", str(job_dir), "--json").stdout)


def events(job_dir: Path, kind: str, step: str | None = None) -> list[dict]:
    path = job_dir / "events.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in rows if e["kind"] == kind and (step is None or e["step"] == step)]


def heartbeat(job_dir: Path) -> dict:
    """The trainer's last heartbeat (phase, rollout_id, time, pid); {} before the first."""
    try:
        return json.loads((job_dir / "trainer_heartbeat.json").read_text())
    except (OSError, ValueError):
        return {}


def rollouts_done(job_dir: Path) -> int:
    """Rollouts in metrics.jsonl; fails at once if the job failed or is gone."""
    failed = events(job_dir, "job_failed")
    assert not failed, f"the job failed: {failed[0]['reason']}"
    job_id = (job_dir / "slurm_job_id").read_text().strip()
    assert subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip(), \
        f"job {job_id} is no longer queued or running (see {job_dir}/submitit)"
    path = job_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def assert_never_stale(job_dir: Path) -> None:
    """Invariant 1 from the engines' side: rollout R is generated after version R is published,
    so every request of rollout R must have been served at version R."""
    served = Counter()
    for log in (job_dir / "logs").glob("engine-*.log"):
        for rollout, version in SERVED.findall(log.read_text()):
            assert version == rollout, f"{log.name} served rollout {rollout} with weight version {version}"
            served[log.name] += 1
    assert len(served) == 2 and all(served.values()), f"both engines should have served: {served}"


def another_uid_is_refused(job_dir: Path) -> bool:
    """A child that became uid 65534 (nobody) asks the supervisor to stop; True if refused."""
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the call was refused
        try:
            os.setuid(65534)
            ControlClient(JobDir(job_dir), timeout_s=10).call(Call.STOP)
        except (ControlError, OSError):
            os._exit(0)
        os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


def traced_steps(trace: Path, name: str) -> int:
    """How many `name` ranges a Chrome trace (.json.gz) holds."""
    with gzip.open(trace, "rt") as f:
        return sum(1 for e in json.load(f)["traceEvents"]
                   if str(e.get("name", "")).startswith(name) and e.get("ph") == "X")


def wait_profiles_written(job_dir: Path) -> None:
    """Until each engine and the trainer wrote its trace (each logs a line once the file is whole)."""
    def written() -> bool:
        logs = {name: job_dir / "logs" / f"{name}.log" for name in ("engine-0", "engine-1", "trainer")}
        texts = {name: path.read_text() if path.exists() else "" for name, path in logs.items()}
        return all("cpu_engine: profile trace written to" in texts[e] for e in ("engine-0", "engine-1")) \
            and "training profile written to" in texts["trainer"]
    wait_for(written, 120, "the profiles written")


ROLLOUTS = 12  # the rollouts whose rewards must rise (the job runs on until the failures are dealt with)


def test_toy_job_is_profiled_recovers_from_failures_and_stops(devcluster, toy, tmp_path: Path) -> None:
    """One job for two sets of checks (a job's start is much of each one's time):
    - the plain run: profiled (rollout and train) before any failure, a heterogeneous job in sacct,
      every step in `slurmrl status`, rewards rising, each phase's time in every metrics line,
      `slurmrl report` plots;
    - failures, each recovered in turn: a dismissed report, a crash, a hang, 503s, the router
      killed, `slurmrl restart`; another uid cannot steer the job; `slurmrl stop` saves and ends
      it (so it ends stopped by user, not completed as a job of a fixed length does: that end is
      test_resume's and test_isolated_job's)."""
    job_dir = tmp_path / "job"
    # Engines answer 503 within 1 s when they cannot generate (the probe waits 2 s).
    os.environ["SGLANG_HEALTH_CHECK_TIMEOUT"] = "1"
    try:
        job_id = submit(toy, job_dir, "--num-rollout", "100000", "--rollout-max-response-len", "3")
    finally:
        del os.environ["SGLANG_HEALTH_CHECK_TIMEOUT"]
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 1, 300, "the first rollout")
        # Profiling reaches the engines that are healthy now: wait until both are (one may be restarting).
        wait_for(lambda: all(status(job_dir)["steps"][f"engine-{k}"]["state"] == "healthy" for k in (0, 1)), 120,
                 "both engines healthy", interval_s=STATUS_POLL_S)
        rollout = slurmrl("profile", str(job_dir), "--rollout", "--steps", "3").stdout
        train = slurmrl("profile", job_id, "--train", "--steps", "1").stdout
        wait_profiles_written(job_dir)  # before any failure: a killed engine writes no trace

        urls = {name: s["url"] for name, s in status(job_dir)["steps"].items() if s["url"]}
        key = load_key(JobDir(job_dir))

        def recovered(step: str, times: int) -> None:
            wait_for(lambda: len(events(job_dir, "engine_recovered", step)) >= times, 180, f"{step} recovered")
            done = rollouts_done(job_dir)
            wait_for(lambda: rollouts_done(job_dir) >= done + 2, 180, "rollouts after the recovery")

        # A failed request that the engine did not cause (a keep-alive race in the router): the
        # trainer's report is checked with one probe, and a healthy engine stays in.
        ControlClient(JobDir(job_dir), timeout_s=10).call(Call.ENGINE_FAILED, url=urls["engine-0"],
                                                       reason="connection reset")
        wait_for(lambda: events(job_dir, "engine_report_dismissed", "engine-0"), 60, "the report dismissed")
        assert not events(job_dir, "engine_failed"), events(job_dir, "engine_failed")

        os.kill(listening_pid(urls["engine-0"]), signal.SIGKILL)  # a crash
        recovered("engine-0", 1)
        stopped = listening_pid(urls["engine-1"])
        os.kill(stopped, signal.SIGSTOP)  # a hang: only the health probe can tell
        recovered("engine-1", 1)
        requests.post(urls["engine-0"] + "/pause_generation", json={"mode": "abort"},
                      headers={"Authorization": f"Bearer {key}"}, timeout=10).raise_for_status()  # now 503s
        recovered("engine-0", 2)
        os.kill(listening_pid(urls["router"]), signal.SIGKILL)
        wait_for(lambda: events(job_dir, "router_relaunched"), 120, "the router relaunched")
        slurmrl("restart", str(job_dir), "engine-1")
        recovered("engine-1", 2)
        wait_for(lambda: rollouts_done(job_dir) >= ROLLOUTS, 300, f"{ROLLOUTS} rollouts")

        assert another_uid_is_refused(job_dir) and status(job_dir)["stop_reason"] is None
        slurmrl("stop", job_id)
        wait_job_gone(job_id, timeout_s=300)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        if "stopped" in locals() and psutil.pid_exists(stopped):
            os.kill(stopped, signal.SIGKILL)
    wait_sacct_states(job_id, {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"})
    assert len(sacct_rows(job_id, "JobID")) == 2, "one heterogeneous job of two components"

    # The profiles, taken before the failures.
    [rollout_dir] = (job_dir / "profiles").glob("rollout-*")
    [train_dir] = (job_dir / "profiles").glob("train-*")
    assert str(rollout_dir) in rollout and "engine-0, engine-1" in rollout and str(train_dir) in train
    for engine in ("engine-0", "engine-1"):  # SGLang's num_steps: the engine stopped by itself
        [trace] = (rollout_dir / engine).glob(f"{engine}-*-TP-0.trace.json.gz")
        assert traced_steps(trace, FORWARD_STEP) == 3
    assert traced_steps(train_dir / "rank0.trace.json.gz", TRAIN_STEP) == 1
    for phase in ("packs", "grad_reduce", "grad_norm", "optimizer"):  # the step's phases, each a range within it
        assert traced_steps(train_dir / "rank0.trace.json.gz", f"{PHASE} {phase}") == 1, phase
    assert events(job_dir, "profile_started")[0]["engines"] == ["engine-0", "engine-1"]

    # The job's end: stopped by user, which saved the last rollout trained; its steps, metrics, report.
    state = status(job_dir)
    lines = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in lines] == list(range(len(lines))), "a rollout id was skipped or repeated"
    assert state["stop_reason"] == "stopped by user", state
    assert state["weight_version"] == len(lines), state
    assert state["last_checkpoint"].endswith(iteration_dirname(len(lines) - 1)), state
    assert set(state["steps"]) == {"router", "trainer", "engine-0", "engine-1"}
    assert all(s["slurm_step"] for s in state["steps"].values()), state["steps"]
    rewards = [m["reward_mean"] for m in lines[:ROLLOUTS]]
    assert rewards[0] < 0.2 and max(rewards[-4:]) > 0.5, rewards
    assert_never_stale(job_dir)
    table = slurmrl("status", job_id).stdout  # by SLURM job id too, as a table
    assert "engine-0" in table and "trainer" in table and "stopped: stopped by user" in table
    assert all(m[key] >= 0 for m in lines for key in PHASE_TIMES.values())
    assert all(m["perf/rollout_time"] > 0 and m["perf/actor_train_time"] > 0 for m in lines)
    plots = slurmrl("report", job_id).stdout.split()
    assert [Path(p).name for p in plots] == ["reward.png", "phases.png", "events.png"]
    assert all(Path(p).parent == job_dir / "report" and Path(p).stat().st_size > 5000 for p in plots)

    # The failures: each detected with its reason, each engine back in the router at a weight version.
    for failure in events(job_dir, "engine_failed"):
        assert failure["reason"], failure
    recoveries = events(job_dir, "engine_recovered")
    assert len(recoveries) >= 4
    for event in recoveries:
        assert event["in_router"] and event["weight_version"] is not None and event["recover_s"] > 0, event
    reasons = " ".join(e["reason"] for e in events(job_dir, "engine_failed"))
    # A crash is seen by whichever comes first: the step's exit, or the trainer's failed request.
    assert "exited" in reasons or "reported by the trainer" in reasons
    assert "(timeout after" in reasons and "(HTTP 503)" in reasons and "slurmrl restart" in reasons
