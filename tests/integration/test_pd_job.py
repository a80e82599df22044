"""The toy RL job with prefill/decode disaggregation on the devcluster (`--prefill-num-servers 1`
over 3 CPU engines): the real router in its PD mode sends every request to the prefill engine and
to one of the two decode engines, which continues from the prefill engine's first token. Mid-run
the prefill engine's process is SIGKILLed: requests fail on both sides and are retried whole, the
supervisor brings it back at the current weight version and re-registers it as a prefill worker,
and the job completes with rewards rising, no sample lost and no request served with stale weights.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections import defaultdict
from pathlib import Path

import requests

from contract.job_dir import JobDir
from slurm.devcluster.daemons import wait_for
from supervisor.keys import load_key
from tests.integration.test_rl_job import (
    SERVED,
    events,
    listening_pid,
    rollouts_done,
    status,
    submit,
)
from tests.slurm_helpers import wait_job_gone, wait_sacct_states

ROLLOUTS = 12
RID = re.compile(r"cpu_engine served rid=(r\d+-\S+) weight_version=\S+ prompt_tokens=\d+ completion_tokens=(\d+)")


def assert_never_stale_pd(job_dir: Path, roles: dict[str, str]) -> None:
    """Invariant 1 on both sides: every request of rollout R was prefilled and decoded at version
    R; every engine served; every decoded request was prefilled (by the prefill engine)."""
    rids: dict[str, set[str]] = defaultdict(set)
    for name, role in roles.items():
        text = (job_dir / "logs" / f"{name}.log").read_text()
        served = SERVED.findall(text)
        assert served, f"{name} ({role}) served nothing"
        for rollout, version in served:
            assert version == rollout, f"{name} ({role}) served rollout {rollout} with weight version {version}"
        for rid, tokens in RID.findall(text):
            rids[role].add(rid)
            if role == "prefill":
                assert tokens in ("0", "1"), f"a prefill engine samples the first token only: {rid} {tokens}"
    assert rids["decode"] and rids["decode"] <= rids["prefill"], "a decoded request the prefill engine never ran"


def test_pd_job_survives_a_killed_prefill_engine(devcluster, toy, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, "--num-rollout", str(ROLLOUTS), "--rollout-max-response-len", "2",
                    "--rollout-num-engines", "3", "--rollout-engines-per-node", "2", "--prefill-num-servers", "1")
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 2, 240, "the first rollouts")
        urls = {name: s["url"] for name, s in status(job_dir)["steps"].items() if s["url"]}
        key = load_key(JobDir(job_dir))

        def workers() -> dict[str, str]:
            listed = requests.get(urls["router"] + "/workers", headers={"Authorization": f"Bearer {key}"},
                                  timeout=10).json()
            return {w["url"]: w["worker_type"] for w in listed["workers"]}

        roles = workers()
        assert sorted(roles.values()) == ["decode", "decode", "prefill"], roles
        prefill = next(name for name, url in urls.items() if roles.get(url) == "prefill")
        assert prefill == "engine-0"  # --prefill-num-servers N: the first N engines

        os.kill(listening_pid(urls[prefill]), signal.SIGKILL)
        wait_for(lambda: events(job_dir, "engine_recovered", prefill), 180, f"{prefill} recovered")
        recovered = events(job_dir, "engine_recovered", prefill)[0]
        assert recovered["in_router"] and recovered["weight_version"] is not None, recovered
        assert workers().get(urls[prefill]) == "prefill", "re-registered with its type"
        wait_job_gone(job_id, timeout_s=300)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    wait_sacct_states(job_id, {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"})
    state = status(job_dir)
    assert state["stop_reason"] == "completed" and state["weight_version"] == ROLLOUTS
    rewards = [json.loads(line)["reward_mean"] for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == ROLLOUTS and rewards[0] < 0.2 and max(rewards[-4:]) > 0.5, rewards
    assert_never_stale_pd(job_dir, {"engine-0": "prefill", "engine-1": "decode", "engine-2": "decode"})
