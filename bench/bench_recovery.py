"""Engine failure detection and recovery on the devcluster: the toy job runs; an engine is killed
(SIGKILL, the process dies) or hung (SIGSTOP, only probes can tell) several times. Detection is
kill -> the supervisor's engine_failed event; recovery is kill -> engine_recovered (back in the
router at the current weight version). Medians over --repeats, each kind; the hang's detection is
compared with the crash's, which needs no probe, in the same run. Restart backoff is off (the
failures come back to back, which the supervisor would otherwise treat as a crash loop).

    python -m bench.bench_recovery [--repeats 5]      # devcluster up; run as root
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from rollout.tiny_model import write_tiny_model
from rollout.toy_task import write_toy_data
from slurm.devcluster.daemons import wait_for
from tests.slurm_helpers import listening_pid

ROOT = Path(__file__).resolve().parents[1]


def slurmrl(*argv: str) -> str:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *argv], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout


def events(job_dir: Path, kind: str) -> list[dict]:
    path = job_dir / "events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind] if path.exists() else []


def one_failure(job_dir: Path, url: str, sig: signal.Signals) -> tuple[float, float]:
    failed, recovered = len(events(job_dir, "engine_failed")), len(events(job_dir, "engine_recovered"))
    pid = listening_pid(url)  # in its node's network namespace on an isolated devcluster
    killed = time.time()
    os.kill(pid, sig)
    wait_for(lambda: len(events(job_dir, "engine_recovered")) > recovered, 300, "the recovery")
    if sig == signal.SIGSTOP and psutil.pid_exists(pid):
        os.kill(pid, signal.SIGKILL)
    detected = events(job_dir, "engine_failed")[failed]["time"]
    back = events(job_dir, "engine_recovered")[recovered]["time"]
    return detected - killed, back - killed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", help="keep the job here (default: a temporary folder)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(opts.workdir or tmp)
        model, data = write_tiny_model(root / "model"), write_toy_data(root / "toy.jsonl")
        job_dir = root / "job"
        out = slurmrl("submit", "examples/toy_job.yaml", "--json", "--job-dir", str(job_dir), "--hf-checkpoint",
                      str(model), "--prompt-data", str(data), "--num-rollout", "100000",
                      # back-to-back failures are a crash loop: measure the recovery path itself
                      "--restart-backoff", "0", "--max-engine-restarts", "100")
        job_id = json.loads(out.strip().splitlines()[-1])["job_id"]
        try:
            wait_for(lambda: (job_dir / "metrics.jsonl").exists(), 300, "the first rollout")
            steps = json.loads(slurmrl("status", str(job_dir), "--json"))["steps"]
            url = steps["engine-0"]["url"]
            results = {sig.name: [one_failure(job_dir, url, sig) for _ in range(opts.repeats)]
                       for sig in (signal.SIGKILL, signal.SIGSTOP)}
        finally:
            subprocess.run(["scancel", job_id], capture_output=True)
        print(f"toy job, CPU engine, probe interval 2 s, timeout 2 s, threshold 3; {opts.repeats} failures each")
        crash_detect = statistics.median(d for d, _ in results["SIGKILL"])
        for name, rows in results.items():
            detect, recover = statistics.median(d for d, _ in rows), statistics.median(r for _, r in rows)
            print(f"  {name:8s} detect {detect:6.2f} s (median; {detect / crash_detect:5.1f}x the crash's)  "
                  f"recover {recover:6.2f} s (median)  all: {[(round(d, 2), round(r, 2)) for d, r in rows]}")


if __name__ == "__main__":
    main()
