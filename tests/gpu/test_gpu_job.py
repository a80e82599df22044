"""The whole job on GPUs under a real SLURM (issue 30, item 4): `slurmrl submit` on a devcluster whose
gres are this machine's GPUs (tests/gpu/gpu_cluster.py), the megatron trainer in bf16 on its GPU(s),
stand-in engines on theirs (--rollout-engine standin), the real router. Each test skips, saying why,
without CUDA, SLURM or the GPUs it needs.

- 1 GPU (d): --colocate with offload, trainer and engine on one GPU for 20 rollouts, no OOM; each
  phase's peak GPU memory from the job's own metrics, and the engine's memory released around training.
- 2 GPUs (e): the trainer on one GPU, two engines sharing the other (weights from disk: NCCL refuses
  two ranks on one GPU).
- 2 GPUs (a): the job's only engine SIGKILLed mid-rollout and relaunched at its url, behind an update
  group's version: the supervisor has the trainer save now and restarts it (--engine-stranded-timeout), which
  forms a new NCCL group with the new process and publishes to it; the engine fails once only.
- 2 GPUs (c): a preemption (SLURM's warning signal) saves, requeues and resumes: the same rollouts,
  samples' rewards and versions as the uninterrupted run, losses within bf16's reproducibility.
- 4 GPUs (e, a, b, one job): the trainer at DP=2 on two GPUs, two engines of one GPU each, weights
  over NCCL. In it: an engine SIGKILLed mid-rollout is replaced on its GPU and comes back at the
  current version over NCCL, no sample from stale weights; then trainer rank 0 SIGKILLed mid-train
  is restarted from its checkpoint and its NCCL group with the engines is rebuilt.

With $OUT set (the device's run), each test writes the figures and events it saw to
$OUT/gpu_job/<test>.json, for bench/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from contract.job_dir import PHASE_PEAK_GPU_MEMORY, PHASE_TIMES, Metric
from rollout.tiny_model import write_tiny_model
from rollout.toy_task import write_toy_data
from slurm.devcluster.daemons import wait_for
from tests.gpu.gpu_cluster import (  # noqa: F401 (gpu_cluster: a fixture)
    SLURM_CALL_S,
    engine_pid,
    gpu_cluster,
    needs_gpus,
    visible_gpus,
)
from tests.integration.test_rl_job import SERVED, events, heartbeat, rollouts_done, slurmrl, status
from tests.integration.test_trainer_faults import trainer_rank
from tests.slurm_helpers import wait_job_gone
from trainer.publish import LANES

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_job]

# Every job: the toy job's task, the megatron trainer in bf16 on GPUs, stand-in engines on GPUs.
ON_GPUS = ("--train-backend", "megatron", "--bf16", "--rollout-engine", "standin", "--actor-num-gpus-per-node", "1",
           "--rollout-num-gpus-per-node", "1")
ONE_GPU_COLOCATED = ("--rollout-num-gpus", "1", "--rollout-num-engines", "1", "--colocate",
                     "--sglang-mem-fraction-static", "0.3", "--update-weight-transport", "disk")
TWO_ENGINES_ON_ONE_GPU = ("--rollout-num-gpus", "1", "--rollout-num-engines", "2", "--sglang-mem-fraction-static",
                          "0.3", "--update-weight-transport", "disk")
ONE_ENGINE_NCCL = ("--rollout-num-gpus", "1", "--rollout-num-engines", "1", "--update-weight-transport", "nccl")
DP2_TWO_ENGINES_NCCL = ("--actor-num-nodes", "2", "--rollout-num-gpus", "2", "--rollout-num-engines", "2",
                        "--update-weight-transport", "nccl")
# A reward model that takes 20 ms a sample: a rollout of 64 samples lasts 1.3 s or more on any GPU, so
# that a signal or a kill lands while the job runs, mid-rollout.
SLOW_REWARD = ("--custom-rm-path", "tests.trainer.plugins.slow_toy_reward")
# c: as tests/integration/test_resume.py (--adam-eps 1: see there), without eval
RESUME_ROLLOUTS = 12
RESUME_FLAGS = ("--num-rollout", str(RESUME_ROLLOUTS), "--save-interval", "100", "--rollout-batch-size", "8",
                "--adam-eps", "1", *SLOW_REWARD)
# bf16 keeps 8 bits of mantissa: two runs that differ in the order of a sum differ by ~1e-2 relative
# in a loss near 0 or a grad norm (fp32 runs: tests/integration/test_resume.py's 1e-4)
BF16_REL, BF16_ABS = 2e-2, 1e-3

JOB_START_S = 300  # submission to the first rollouts: engines loading on their GPUs, the trainer's start
JOB_END_S = 540  # a whole short job
RECOVERY_S = 240  # an engine or the trainer relaunched, brought to the current weights
SAVE_NOW_S = 20  # a trainer told to save now in a rollout leaves it (the supervisor cancels one in it at 30 s)
OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)
FREED_GB = 0.01  # what a released engine still holds on its GPU (buffers such as rotary tables)
JOINED = re.compile(r"cpu_engine joined weight update group (\S+) backend=(\S+)")
MEMORY = re.compile(r"cpu_engine memory (released|resumed) tags=(\S+) weight_version=\S+ allocated_gb=(\S+)")


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("toy")
    return write_tiny_model(root / "model"), write_toy_data(root / "toy.jsonl")


def submit(toy: tuple[Path, Path], job_dir: Path, *flags: str) -> str:
    model, data = toy
    done = slurmrl("submit", "examples/toy_job.yaml", "--json", "--job-dir", str(job_dir), "--hf-checkpoint",
                   str(model), "--prompt-data", str(data), *ON_GPUS, *flags)
    return json.loads(done.stdout.strip().splitlines()[-1])["job_id"]


def metrics(job_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def keep(test: str, figures: dict[str, Any]) -> None:
    """The figures and events a test saw, for the device run's notes ($OUT/gpu_job/TEST.json)."""
    if os.environ.get("OUT"):
        folder = Path(os.environ["OUT"]) / "gpu_job"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{test}.json").write_text(json.dumps(figures, indent=1, default=str))


def peaks(line: dict) -> dict[str, tuple[float, float]]:
    """Each measured phase's (trainer's own, GPU's use) peak GiB on a metrics line."""
    return {phase: (line[own], line[used]) for phase, (own, used) in PHASE_PEAK_GPU_MEMORY.items() if own in line}


def no_oom(job_dir: Path) -> None:
    for log in (job_dir / "logs").glob("*.log"):
        hit = OOM.search(log.read_text())
        assert hit is None, f"{log.name}: {hit.group(0)}"


def never_stale(job_dir: Path, engines: int) -> None:
    """Invariant 1 from the engines' logs (tests/integration/test_rl_job.py's, for any number of
    engines): every request of rollout R was served at weight version R."""
    served = {log.name: SERVED.findall(log.read_text()) for log in (job_dir / "logs").glob("engine-*.log")}
    assert len(served) == engines and all(served.values()), f"every engine should have served: {served.keys()}"
    stale = [(name, r, v) for name, pairs in served.items() for r, v in pairs if r != v]
    assert not stale, f"served with stale weights (log, rollout, version): {stale[:5]}"


def cancel(job_id: str) -> None:
    """scancel the job (by id): a test's job never outlives it, whatever failed."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=SLURM_CALL_S)


def run_to_the_end(job_id: str) -> None:
    try:
        wait_job_gone(job_id, timeout_s=JOB_END_S)
    finally:
        cancel(job_id)


def kill_in(job_dir: Path, phase: str, pid: Callable[[], int], what: str) -> None:
    """SIGKILL the process pid() names as soon as the trainer's heartbeat says `phase`."""
    wait_for(lambda: heartbeat(job_dir).get("phase") == phase and (os.kill(pid(), signal.SIGKILL) or True),
             RECOVERY_S, what, interval_s=0.002)


def stuck_trainer(job_dir: Path) -> dict[str, Any]:
    """Where a trainer that did not act on its save-now signal waits: each thread's signal masks and
    kernel wait ($OUT's json), its Python stacks (SIGQUIT: in trainer.log), and whether SIGUSR1 sent
    to it here, not through SLURM, ends its rollout."""
    pid = heartbeat(job_dir)["pid"]
    threads = {}
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
        threads[task.name] = {key: fields[key].strip() for key in ("Name", "State", "SigPnd", "SigBlk", "SigCgt")}
        threads[task.name]["wchan"] = (task / "wchan").read_text()
    shared = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())["ShdPnd"]
    os.kill(pid, signal.SIGQUIT)
    os.kill(pid, signal.SIGUSR1)
    try:  # before the supervisor cancels it (trainer_watch.SAVE_NOW_ANSWER_S)
        wait_for(lambda: heartbeat(job_dir).get("phase") != "rollout", 5, "the trainer, signalled here")
        direct = "left its rollout"
    except TimeoutError:
        direct = "still in its rollout"
    return {"pid": pid, "shared_pending": shared.strip(), "threads": threads, "sigusr1_from_the_test": direct}


def stop_after(job_dir: Path, job_id: str, more: int, what: str) -> None:
    """`slurmrl stop` once `more` rollouts were done from now, and wait until the job is gone."""
    done = rollouts_done(job_dir)
    wait_for(lambda: rollouts_done(job_dir) >= done + more, RECOVERY_S, what)
    slurmrl("stop", job_id)
    wait_job_gone(job_id, timeout_s=JOB_END_S)


@needs_gpus(1)
def test_one_gpu_colocated_twenty_rollouts_without_oom(gpu_cluster, toy, tmp_path: Path) -> None:  # noqa: F811
    job_dir = tmp_path / "job"
    run_to_the_end(submit(toy, job_dir, *ONE_GPU_COLOCATED, "--num-rollout", "20", "--save-interval", "10"))
    lines = metrics(job_dir)
    released = [float(gb) for kind, _, gb in MEMORY.findall((job_dir / "logs" / "engine-0.log").read_text())
                if kind == "released"]
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1024**3
    keep("colocated_one_gpu", {"peaks_gb_by_rollout": [peaks(m) for m in lines], "engine_released_gb": released,
                               "phase_times": [{k: m.get(k) for k in PHASE_TIMES.values()} for m in lines],
                               "train_tok_per_s": [m.get(Metric.TRAIN_TOKENS_PER_S) for m in lines],
                               "rewards": [m["reward_mean"] for m in lines], "gpu_total_gb": total_gb})
    state = status(job_dir)
    assert state["stop_reason"] == "completed" and state["weight_version"] == 20, state
    assert not events(job_dir, "engine_failed") and not events(job_dir, "trainer_failed")
    no_oom(job_dir)
    assert [m["rollout_id"] for m in lines] == list(range(20))
    for line in lines:
        measured = peaks(line)
        assert {"rollout", "log_probs", "train", "publish"} <= set(measured), line
        assert all(used < total_gb for _, used in measured.values()), measured
        # offloaded while the engine generates: the trainer holds less then than when it trains
        assert measured["rollout"][0] < measured["train"][0], measured
    assert len(released) == 20 and max(released) < FREED_GB, released
    rewards = [m["reward_mean"] for m in lines]
    assert rewards[0] < 0.2 and max(rewards[-4:]) > 0.5, rewards


@needs_gpus(2)
def test_two_gpus_the_trainer_on_one_two_engines_on_the_other(gpu_cluster, toy, tmp_path: Path) -> None:  # noqa: F811
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, *TWO_ENGINES_ON_ONE_GPU, "--num-rollout", "6")
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 1, JOB_START_S, "the first rollout")
        steps = status(job_dir)["steps"]
        engines = {name: visible_gpus(engine_pid(steps[name]["url"])) for name in ("engine-0", "engine-1")}
        trainer = visible_gpus(heartbeat(job_dir)["pid"])
        wait_job_gone(job_id, timeout_s=JOB_END_S)
    finally:
        cancel(job_id)
    assert engines["engine-0"] == engines["engine-1"] != trainer and trainer, (engines, trainer)
    state = status(job_dir)
    assert state["stop_reason"] == "completed", state
    lines = metrics(job_dir)
    assert [m["rollout_id"] for m in lines] == list(range(6)) and all(m["engines_updated"] == 2 for m in lines)
    assert all(m[Metric.PUBLISH_BYTES] > 0 for m in lines)
    never_stale(job_dir, engines=2)
    no_oom(job_dir)
    keep("two_gpus_shared", {"trainer_gpu": trainer, "engine_gpus": engines, "lines": lines})


def preempt(job_id: str) -> None:
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)


def same_bf16(x: float, y: float) -> bool:
    return y == pytest.approx(x, rel=BF16_REL, abs=BF16_ABS)


@needs_gpus(2)
def test_a_preempted_gpu_job_resumes_exactly(gpu_cluster, toy, tmp_path: Path) -> None:  # noqa: F811
    whole_dir, cut_dir = tmp_path / "whole", tmp_path / "cut"
    run_to_the_end(submit(toy, whole_dir, *ONE_ENGINE_NCCL, *RESUME_FLAGS))
    job_id = submit(toy, cut_dir, *ONE_ENGINE_NCCL, *RESUME_FLAGS)
    try:
        wait_for(lambda: rollouts_done(cut_dir) >= 3, JOB_START_S, "a few rollouts")
        preempt(job_id)
        wait_for(lambda: events(cut_dir, "requeue"), RECOVERY_S, "the requeue")
        wait_job_gone(job_id, timeout_s=JOB_END_S)
    finally:
        cancel(job_id)
    state = status(cut_dir)
    assert state["stop_reason"] == "completed" and state["requeues"] == 1, state
    whole, cut = metrics(whole_dir), metrics(cut_dir)
    compared = [{key: (x[key], y[key]) for key in ("rollout_id", "reward_mean", "weight_version", "loss", "grad_norm")}
                for x, y in zip(whole, cut)]
    keep("preemption_two_gpus", {"events": events(cut_dir, "preemption") + events(cut_dir, "requeue"),
                                 "whole_vs_resumed": compared})
    assert [m["rollout_id"] for m in cut] == [m["rollout_id"] for m in whole] == list(range(RESUME_ROLLOUTS))
    for row in compared:
        # the samples: their rewards and the version that generated them, exactly
        for key in ("reward_mean", "weight_version"):
            assert row[key][0] == row[key][1], row
        for key in ("loss", "grad_norm"):
            assert same_bf16(*row[key]), row
    never_stale(cut_dir, engines=1)


@needs_gpus(2)
def test_the_only_engine_relaunched_in_a_rollout_gets_the_weights_of_a_restarted_trainer(
        gpu_cluster, toy, tmp_path: Path) -> None:  # noqa: F811
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, *ONE_ENGINE_NCCL, "--num-rollout", "100000", "--rollout-batch-size", "8",
                    "--engine-stranded-timeout", "10", *SLOW_REWARD)
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 2, JOB_START_S, "the first rollouts")
        url = status(job_dir)["steps"]["engine-0"]["url"]
        kill_in(job_dir, "rollout", lambda: engine_pid(url), "a rollout being generated")
        wait_for(lambda: events(job_dir, "engines_stranded"), RECOVERY_S, "the supervisor to see the engine stranded")
        try:
            wait_for(lambda: heartbeat(job_dir).get("phase") != "rollout" or events(job_dir, "trainer_restarted"),
                     SAVE_NOW_S, "the trainer to leave its rollout on the save-now signal")
        except TimeoutError:
            keep("engine_relaunched_nccl_stuck", stuck_trainer(job_dir))
            raise
        wait_for(lambda: events(job_dir, "engine_recovered", "engine-0"), RECOVERY_S, "engine-0 recovered")
        stop_after(job_dir, job_id, 3, "rollouts after the recovery")
    finally:
        cancel(job_id)
    failed = events(job_dir, "engine_failed", "engine-0")
    joined = JOINED.findall((job_dir / "logs" / "engine-0.log").read_text())
    keep("engine_relaunched_nccl", {"engine_failed": failed, "groups_joined": joined,
                                    "engines_stranded": events(job_dir, "engines_stranded"),
                                    "engine_recovered": events(job_dir, "engine_recovered", "engine-0")})
    assert len(failed) == 1, f"the relaunched engine failed again (sent a bucket outside its group?): {failed}"
    # the job's only engine, relaunched in a rollout: the trainer restarted to publish to it
    assert len(events(job_dir, "engines_stranded")) == 1 and len(events(job_dir, "trainer_restarted")) == 1
    assert not events(job_dir, "save_now_unanswered")
    # a group formed again for the relaunched engine (each formation joins LANES groups: the job's only engine)
    assert len({name for name, _ in joined}) >= 2 * LANES and all(backend == "nccl" for _, backend in joined), joined
    lines = metrics(job_dir)
    assert [m["rollout_id"] for m in lines] == list(range(len(lines))), "a rollout id was skipped or repeated"
    assert all(m["engines_updated"] == 1 for m in lines[-3:]), lines[-3:]
    never_stale(job_dir, engines=1)


@needs_gpus(4)
def test_four_gpus_dp2_trainer_two_engines_and_faults_over_nccl(gpu_cluster, toy, tmp_path: Path) -> None:  # noqa: F811
    job_dir = tmp_path / "job"
    job_id = submit(toy, job_dir, *DP2_TWO_ENGINES_NCCL, "--num-rollout", "100000", "--save-interval", "2",
                    "--rollout-batch-size", "8", *SLOW_REWARD)
    try:
        wait_for(lambda: rollouts_done(job_dir) >= 2, JOB_START_S, "the first rollouts")
        steps = status(job_dir)["steps"]
        urls = {name: steps[name]["url"] for name in ("engine-0", "engine-1")}
        gpus = {f"trainer rank {r}": visible_gpus(trainer_rank(job_dir, r)) for r in (0, 1)}
        gpus.update({name: visible_gpus(engine_pid(url)) for name, url in urls.items()})
        assert len(set(gpus.values())) == 4 and all(gpus.values()), f"four GPUs, one each: {gpus}"

        # a: engine-0 SIGKILLed while rank 0 generates a rollout
        kill_in(job_dir, "rollout", lambda: engine_pid(urls["engine-0"]), "a rollout being generated")
        wait_for(lambda: events(job_dir, "engine_recovered", "engine-0"), RECOVERY_S, "engine-0 recovered")
        [recovered] = events(job_dir, "engine_recovered", "engine-0")
        done = rollouts_done(job_dir)
        wait_for(lambda: rollouts_done(job_dir) >= done + 2, RECOVERY_S, "rollouts after the recovery")
        relaunched_gpu = visible_gpus(engine_pid(urls["engine-0"]))

        # b: trainer rank 0 SIGKILLed in an optimizer step
        killed = heartbeat(job_dir)["pid"]
        kill_in(job_dir, "train", lambda: killed, "a training step")
        wait_for(lambda: events(job_dir, "trainer_restarted"), RECOVERY_S, "the trainer restarted")
        stop_after(job_dir, job_id, 2, "rollouts after the restart")
    finally:
        cancel(job_id)
    state = status(job_dir)
    assert state["stop_reason"] == "stopped by user", state
    assert recovered["in_router"] and recovered["weight_version"] is not None, recovered
    assert relaunched_gpu == gpus["engine-0"], "replaced on its own GPU"
    log = (job_dir / "logs" / "trainer.log").read_text()
    assert "resumed from" in log, "the restarted trainer resumes from its checkpoint"
    joined = {name: JOINED.findall((job_dir / "logs" / f"{name}.log").read_text()) for name in urls}
    assert all(backend == "nccl" for groups in joined.values() for _, backend in groups), joined
    # engine-0: its first group, the relaunched engine's, the restarted trainer's; engine-1 left the
    # first group when engine-0 died and joined the rebuilt one, then the restarted trainer's
    assert len({name for name, _ in joined["engine-0"]}) >= 3 and len({name for name, _ in joined["engine-1"]}) >= 3
    lines = metrics(job_dir)
    assert [m["rollout_id"] for m in lines] == list(range(len(lines))), "a rollout id was skipped or repeated"
    assert lines[-1]["engines_updated"] == 2 and lines[-1][Metric.PUBLISH_BYTES] > 0
    assert {"rollout", "log_probs", "train", "publish"} <= set(peaks(lines[-1]))
    never_stale(job_dir, engines=2)
    no_oom(job_dir)
    keep("four_gpus_faults", {"gpus": gpus, "engine_failed": events(job_dir, "engine_failed"),
                              "engine_recovered": events(job_dir, "engine_recovered"),
                              "trainer_failed": events(job_dir, "trainer_failed"),
                              "trainer_restarted": events(job_dir, "trainer_restarted"), "groups_joined": joined,
                              "last_line": lines[-1]})
