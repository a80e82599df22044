"""The whole loop, no mocks: `python -m trainer` (megatron backend, gloo) + 2 CPU engines + the real
sglang-router on the toy task.

- The reward rises from about 0.05 to above 0.6: the engines generate every sample, so this only
  happens if each new weight version reaches them.
- Save, resume, continue: an interrupted run whose latest checkpoint is damaged falls back to the
  one before and then produces exactly the rollout ids, data and losses of an uninterrupted run.
- --true-on-policy-mode: the trainer's log-probs equal the engines' to 1e-5.
- --debug-rollout-only generates and dumps rollouts without a model; --debug-train-only replays
  such a dump without engines and reproduces the normal run's training step.
- Eval (--eval-interval, named sets) reports per set in metrics.jsonl and TensorBoard, and the
  resumed run's eval numbers equal the uninterrupted run's.
- PPO (critic, GAE) resumes exactly; on-policy distillation pulls the student towards a teacher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from contract.job_dir import PHASE_TIMES
from rollout import debug_data
from rollout.router_client import RouterClient
from rollout.tiny_model import write_tiny_model
from rollout.toy_task import write_toy_data
from tests.rank_devices import hidden_gpus
from tests.rollout.servers import API_KEY, Server, engines_behind_router, free_port

TOY = ["--label-key", "label", "--rm-type", "toy", "--rollout-shuffle", "--rollout-max-response-len", "1",
       "--n-samples-per-prompt", "8", "--attention-backend", "local", "--use-dynamic-batch-size",
       "--max-tokens-per-gpu", "4096", "--lr-decay-style", "constant", "--adam-beta2", "0.98", "--weight-decay", "0"]

# Two runs of one step agree to float32 noise, not bit for bit (the CPU BLAS may split a sum over
# fewer threads on a loaded machine). The on-policy GRPO loss is a mean of +-1-sized terms that
# cancels to ~0, so that noise shows absolutely: rollout 0's loss was -9.3e-10 in one run and
# 1.26e-6 in another (CI). A resume that loses or repeats state moves grad_norm by far more.
SAME_STEP = {"rel": 1e-5, "abs": 1e-5}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rl_loop")
    return write_tiny_model(root / "model", seed=0), write_toy_data(root / "toy.jsonl", num_prompts=64)


@pytest.fixture(scope="module")
def cluster(files, tmp_path_factory) -> Iterator[tuple[RouterClient, list[Server]]]:
    # Shared by the tests: every trainer run first publishes its own starting weights. Batch-invariant,
    # so that runs compared bit for bit get the same samples whatever else the engines ran.
    with engines_behind_router(files[0], tmp_path_factory.mktemp("servers"), deterministic=True) as pair:
        yield pair


def trainer(files: tuple[Path, Path], router: RouterClient | None, job: Path, *flags: str,
            processes: int = 1, timeout_s: float = 600, env: dict[str, str] | None = None,
            returncode: int = 0) -> str:
    """Run `python -m trainer` (under torchrun with several processes, on the CPU where there are
    fewer GPUs than processes) to its end; returns its output (asserts its exit code: 0)."""
    model, data = files
    launcher = [sys.executable, "-m", "trainer"] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "trainer"]
    argv = [*launcher, "--hf-checkpoint", str(model), "--prompt-data", str(data),
            "--job-dir", str(job), *TOY, *flags]
    if router is not None:
        host, port = router.url.removeprefix("http://").split(":")
        argv += ["--sglang-router-ip", host, "--sglang-router-port", port]
    env = {**os.environ, **hidden_gpus(processes), "SLURMRL_API_KEY": API_KEY, **(env or {})}
    done = subprocess.run(argv, env=env, capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)
    assert done.returncode == returncode, (f"trainer exited {done.returncode}, not {returncode}:\n"
                                           f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return done.stdout + done.stderr


def metrics(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


def test_reward_rises_and_engines_follow_the_weights(files, cluster, tmp_path: Path) -> None:
    router, engines = cluster
    rollouts = 30
    trainer(files, router, tmp_path / "job", "--num-rollout", str(rollouts), "--rollout-batch-size", "16",
            "--lr", "1e-2", "--log-passrate")
    rewards = [m["reward_mean"] for m in metrics(tmp_path / "job")]
    assert [m["rollout_id"] for m in metrics(tmp_path / "job")] == list(range(rollouts))
    # --log-passrate: pass@1 is the mean reward of 0/1 rewards; pass@k grows with k
    assert all(m["passrate/pass@1"] == pytest.approx(m["reward_mean"]) for m in metrics(tmp_path / "job"))
    assert all(m["passrate/pass@1"] <= m["passrate/pass@2"] <= m["passrate/pass@4"] for m in metrics(tmp_path / "job"))
    # per-phase timings every rollout (metrics.jsonl and TensorBoard): where the time goes
    assert all(0 < m["log_probs_seconds"] < m["train_seconds"] and m["rollout_seconds"] > 0 and m["publish_seconds"] > 0
               for m in metrics(tmp_path / "job"))
    assert rewards[0] < 0.2, rewards
    assert sum(rewards[-8:]) / 8 > 0.6, f"the reward did not rise: {rewards}"
    for engine in engines:
        info = requests.get(engine.url + "/model_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        assert info.json()["weight_version"] == str(rollouts), "an engine missed the last weight version"
        served = engine.log.read_text()
        assert f"weight_version={rollouts - 1} " in served, "an engine never served a late weight version"


def _rollout_tokens(job: Path, rollout_id: int) -> list[list[int]]:
    return [s.tokens for group in debug_data.load(str(job / "rollouts/{rollout_id}.pt"), rollout_id) for s in group]


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])
def test_resume_after_a_damaged_checkpoint_equals_an_uninterrupted_run(files, cluster, tmp_path: Path,
                                                                       estimator: str) -> None:
    """PPO adds a critic with its own optimizer, saved beside the actor: it must resume exactly too.
    Eval runs before training and after every second rollout, at its own temperature: the resumed
    run's eval numbers are the uninterrupted run's, and eval moves no training sample."""
    router, _ = cluster
    evals = write_toy_data(tmp_path / "eval.jsonl", num_prompts=4, seed=1)
    # --adam-eps 1: Adam's first steps are about lr * sign(g), so a last-bit difference in a near-zero
    # gradient element (two runs from the same start have shown them, see below) would flip a
    # weight by 2 lr and change later samples; with eps 1 the update follows the gradient, and what
    # this test proves, that a resume restores everything, is untouched.
    common = ["--rollout-batch-size", "8", "--lr", "1e-2", "--adam-eps", "1", "--save-interval", "2", "--seed", "7",
              "--advantage-estimator", estimator, "--eval-interval", "2", "--eval-prompt-data", "toy", str(evals),
              "--n-samples-per-eval-prompt", "2", "--eval-temperature", "0.7"]

    def run(name: str, rollouts: int) -> str:
        job = tmp_path / name
        return trainer(files, router, job, "--num-rollout", str(rollouts), "--save", str(job / "ckpt"),
                       "--load", str(job / "ckpt"), "--save-debug-rollout-data", str(job / "rollouts/{rollout_id}.pt"),
                       *common)

    run("whole", 6)
    run("parts", 4)  # saves after rollouts 1 and 3
    latest = tmp_path / "parts/ckpt/iter_0000003"
    victim = max(latest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    output = run("parts", 6)
    assert "iter_0000003 is damaged" in output and "resumed from" in output and "iter_0000001" in output

    whole, parts = metrics(tmp_path / "whole"), metrics(tmp_path / "parts")
    assert [m["rollout_id"] for m in parts] == list(range(6)), "a rollout id was skipped or repeated"
    for a, b in zip(whole, parts):  # the samples first: equal losses of other samples mean nothing
        tokens = [_rollout_tokens(tmp_path / run, a["rollout_id"]) for run in ("whole", "parts")]
        assert tokens[0] == tokens[1], f"rollout {a['rollout_id']}: the engines generated other samples"
        assert (a["reward_mean"], a["weight_version"]) == (b["reward_mean"], b["weight_version"])
        for key in ("loss", "pg_loss", "grad_norm") + (("value_loss", "critic_grad_norm") if estimator == "ppo" else ()):
            assert b[key] == pytest.approx(a[key], **SAME_STEP), f"rollout {a['rollout_id']}: {key}"
        assert {k: v for k, v in a.items() if "eval/" in k} == {k: v for k, v in b.items() if "eval/" in k}
    evaluated = [m["rollout_id"] for m in whole if "eval/toy" in m]
    assert evaluated == [1, 3, 5] and "before_train/eval/toy" in whole[0], "slime's eval schedule"
    assert [m["rollout_id"] for m in whole if m.get("eval_seconds", 0) > 0] == evaluated
    assert {"eval/toy-pass@1", "eval/toy-pass@2", "eval/toy-truncated_ratio"} <= set(whole[1])
    # every phase's time on every line (slime's perf/*_time), disjoint: they match the loop's own seconds
    for m in whole:
        assert m["perf/rollout_time"] == m["rollout_seconds"] > 0 and m["perf/update_weights_time"] > 0
        assert m["perf/log_probs_time"] + m["perf/actor_train_time"] == pytest.approx(m["train_seconds"])
        assert m["perf/log_probs_time"] > 0 and m["perf/actor_train_time"] > 0
        assert (m["perf/eval_time"] > 0) == (m["rollout_id"] in evaluated)
        assert (m["perf/save_model_time"] > 0) == (m["rollout_id"] % 2 == 1)  # --save-interval 2
    scalars = EventAccumulator(str(tmp_path / "whole/tensorboard")).Reload().Tags()["scalars"]
    assert {"eval/toy", "eval/toy-pass@2", "before_train/eval/toy", "eval_seconds", "log_probs_seconds"} <= set(scalars)
    assert set(PHASE_TIMES.values()) <= set(scalars)


@pytest.mark.parametrize("save_interval, checkpoint", [("2", "iter_0000001"), ("100", None)],
                         ids=["after-a-checkpoint", "before-any-checkpoint"])
def test_a_killed_trainer_trains_again_on_its_rollouts_from_the_journal_and_equals_an_uninterrupted_run(
        files, cluster, tmp_path: Path, save_interval: str, checkpoint: str | None) -> None:
    """Killed in rollout 3 with its last checkpoint after rollout 1 (or none yet), the trainer
    resumes from it (or starts again) and trains on the rollouts after it as they were generated
    before the kill (the rollout journal), without the engines; every rollout's samples, rewards and
    losses then equal an uninterrupted run's, and each is in metrics.jsonl once (a start with no
    checkpoint kept the killed run's lines, and added them again)."""
    router, _ = cluster
    common = ["--num-rollout", "4", "--rollout-batch-size", "8", "--lr", "1e-2", "--adam-eps", "1",
              "--save-interval", save_interval, "--seed", "7",
              "--rollout-sample-hook-path", "tests.trainer.plugins.die_in_rollout"]
    redone = [2] if checkpoint else [0, 1, 2]

    def run(name: str, **options: Any) -> str:
        job = tmp_path / name
        return trainer(files, router, job, "--save", str(job / "ckpt"), "--load", str(job / "ckpt"),
                       "--save-debug-rollout-data", str(job / "rollouts/{rollout_id}.pt"), *common, **options)

    run("whole")
    run("parts", env={"SLURMRL_TEST_DIE_IN_ROLLOUT": "3"}, returncode=137)
    journal = tmp_path / "parts/rollout_journal"
    assert sorted(p.name for p in journal.iterdir()) == [f"rollout_{n}.pt" for n in redone], "the rollouts after it"
    generated = (tmp_path / "parts/rollouts/2.pt").stat().st_mtime_ns
    output = run("parts")
    assert ("resumed from" in output and checkpoint in output) if checkpoint else "resumed from" not in output
    assert all(f"rollout {n}: replayed from the rollout journal" in output for n in redone), output
    assert (tmp_path / "parts/rollouts/2.pt").stat().st_mtime_ns == generated, "rollout 2 was generated again"
    assert list(journal.iterdir()) == [], "the final save clears the journal"
    whole, parts = metrics(tmp_path / "whole"), metrics(tmp_path / "parts")
    assert [m["rollout_id"] for m in parts] == list(range(4)), "a rollout id was skipped or repeated"
    for a, b in zip(whole, parts):
        tokens = [_rollout_tokens(tmp_path / run, a["rollout_id"]) for run in ("whole", "parts")]
        assert tokens[0] == tokens[1], f"rollout {a['rollout_id']}: other samples"
        assert (a["reward_mean"], a["weight_version"]) == (b["reward_mean"], b["weight_version"])
        for key in ("loss", "pg_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], **SAME_STEP), f"rollout {a['rollout_id']}: {key}"


def test_tp2_over_a_weight_update_group_stays_on_policy(files, cluster, tmp_path: Path) -> None:
    """Two trainer processes at TP=2 publish through a gloo update group (--update-weight-transport
    nccl on CPU engines); in --true-on-policy-mode every step checks that the engines' log-probs
    equal the trainer's, which holds only if each version arrived intact."""
    router, engines = cluster
    trainer(files, router, tmp_path / "job", "--num-rollout", "3", "--rollout-batch-size", "8",
            "--true-on-policy-mode", "--lr", "1e-2", "--tensor-model-parallel-size", "2",
            "--update-weight-transport", "nccl", "--attention-backend", "sdpa", processes=2)
    rows = metrics(tmp_path / "job")
    assert [m["rollout_id"] for m in rows] == [0, 1, 2]
    assert all(m["logp_mismatch_max"] < 1e-5 and m["engines_updated"] == 2 for m in rows), rows
    assert rows[-1]["entropy"] < rows[0]["entropy"], "the weights the engines sample from did not change"


def test_debug_rollout_only_dump_replayed_by_debug_train_only_is_the_normal_training_step(
        files, cluster, tmp_path: Path) -> None:
    """A normal run dumps rollout 0; --debug-rollout-only (no model, no training) generates and
    dumps the same rollout from --hf-checkpoint's weights; --debug-train-only on that dump, with
    no engines, gives the normal run's training metrics."""
    router, _ = cluster
    one = ("--num-rollout", "1", "--rollout-batch-size", "8")
    normal, rollouts = str(tmp_path / "normal/{rollout_id}.pt"), str(tmp_path / "rollouts/{rollout_id}.pt")
    trainer(files, router, tmp_path / "normal", *one, "--save-debug-rollout-data", normal)
    trainer(files, router, tmp_path / "collect", *one, "--debug-rollout-only", "--save-debug-rollout-data", rollouts)
    trainer(files, None, tmp_path / "replay", *one, "--debug-train-only", "--load-debug-rollout-data", rollouts)
    tokens = [[s.tokens for g in debug_data.load(path, 0) for s in g] for path in (normal, rollouts)]
    assert tokens[0] == tokens[1], "--debug-rollout-only should sample from the same weights"
    trained, collected, replayed = (metrics(tmp_path / name)[0] for name in ("normal", "collect", "replay"))
    assert "loss" not in collected and not (tmp_path / "collect/hf_torch_dist").exists(), "no model, no training"
    assert trained["reward_mean"] == collected["reward_mean"] == replayed["reward_mean"]
    for key in ("loss", "pg_loss", "grad_norm", "entropy"):
        assert replayed[key] == pytest.approx(trained[key], **SAME_STEP), key


def test_on_policy_distillation_moves_the_student_towards_the_teacher(files, cluster, tmp_path: Path) -> None:
    """No reward (it is always 0): only the teacher's log-probs, folded into the advantage, move
    the student; the KL to the teacher falls. The teacher is another random model."""
    from ckpt_tools.convert import hf_to_torch_dist

    router, _ = cluster
    teacher = hf_to_torch_dist(write_tiny_model(tmp_path / "teacher_hf", seed=1), tmp_path / "teacher",
                               iteration=None, progress=False)
    trainer(files, router, tmp_path / "job", "--num-rollout", "12", "--rollout-batch-size", "8", "--lr", "5e-3",
            "--rollout-max-response-len", "4", "--custom-rm-path", "tests.trainer.plugins.zero_reward",
            "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(teacher), "--opd-kl-coef", "1.0")
    kl = [m["teacher_kl"] for m in metrics(tmp_path / "job")]
    assert all(m["reward_mean"] == 0 for m in metrics(tmp_path / "job"))
    assert sum(kl[-3:]) / 3 < 0.6 * kl[0], f"the student did not move towards the teacher: {kl}"


def test_fsdp_backend_runs_the_loop_on_policy(files, cluster, tmp_path: Path) -> None:
    """The fsdp backend (HF model, FSDP2 over gloo) drives the same loop: its log-probs equal the
    engines' after every publish over the update group."""
    router, _ = cluster
    trainer(files, router, tmp_path / "job", "--num-rollout", "3", "--rollout-batch-size", "8", "--lr", "1e-2",
            "--train-backend", "fsdp", "--true-on-policy-mode", "--update-weight-transport", "nccl", processes=2)
    rows = metrics(tmp_path / "job")
    assert [m["rollout_id"] for m in rows] == [0, 1, 2]
    assert all(m["logp_mismatch_max"] < 1e-5 and m["engines_updated"] == 2 for m in rows), rows
    assert rows[-1]["entropy"] < rows[0]["entropy"]


# A version, or a bucket of one, that did not reach an engine moves its log-probs by the step's
# size (about 0.1 here). The bound leaves room for one outlier of the trainer's own, not the
# transport's: in about one run in ten, the trainer's packed log-prob of one token (prompt
# "repeat 2", token 95, at version 0) was 1.3e-4 from the engine's, which equalled HF's and an
# unpacked megatron forward's to 1e-6 (not explained yet).
TRANSPORT_EXACT = 1e-3


def test_the_tensor_transport_keeps_the_engines_on_policy(files, cluster, tmp_path: Path) -> None:
    """--update-weight-transport tensor (the engines map the trainer's shared memory, as colocated
    engines map its GPU memory): after every publish the engines' log-probs are the trainer's."""
    router, _ = cluster
    trainer(files, router, tmp_path / "job", "--num-rollout", "3", "--rollout-batch-size", "8", "--lr", "1e-2",
            "--true-on-policy-mode", "--true-on-policy-tolerance", str(TRANSPORT_EXACT),
            "--update-weight-transport", "tensor")
    rows = metrics(tmp_path / "job")
    assert [m["rollout_id"] for m in rows] == [0, 1, 2]
    assert all(m["logp_mismatch_max"] < TRANSPORT_EXACT and m["engines_updated"] == 2 and m["publish_bytes"] > 0
               for m in rows), rows
    assert rows[-1]["entropy"] < rows[0]["entropy"], "the weights the engines sample from did not change"
    assert not (tmp_path / "job" / "weights").exists() or not any((tmp_path / "job" / "weights").iterdir())
