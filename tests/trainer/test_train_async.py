"""slime's train_async.py (--train-async, trainer.ahead_source) with the loop's parts, no model or
engines: a rollout function generates from the real data buffer, a fake backend trains. Rollout
N+1 is generated while rollout N trains; --update-weights-interval; --keep-old-actor; each
sample's staleness; a checkpoint holds the rollout generated ahead, and a resume trains every
sample id exactly once. (The built-in round stopped mid-generation, with a real engine:
tests/trainer/test_ahead_stop.py.)"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch

from contract.job_dir import JobDir, Metric
from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.generate import RolloutArgs
from rollout.sample import Sample, Status
from tests.trainer.test_loop_parts import FakeBackend, Lines, no_advantages
from trainer import save_now
from trainer.ahead_source import AheadRolloutSource
from trainer.batch import TrainSample
from trainer.checkpointer import CheckpointConfig, Checkpointer
from trainer.evals import EvalSchedule
from trainer.loop import STALENESS_MAX, Loop, Progress
from trainer.losses import LossConfig
from trainer.old_actor import OldActor
from trainer.phase_memory import PhaseMemory
from trainer.profiling import TrainProfiler
from trainer.publisher import Publisher
from trainer.rollout_journal import RolloutJournal
from trainer.rollout_source import AHEAD_KEY, ENGINE_WAIT_RATIO, RolloutGenerator
from trainer.save_now import StopRequests
from trainer.train_data import TrainData
from trainer.train_step import TrainStep, TrainStepConfig

GROUPS, PER_GROUP = 2, 2
NEXT_STARTS_WITHIN_S = 20.0  # bound on rollout N+1's generation starting while rollout N trains


class Engines:
    """What the rollout function's samples are generated with: the version last published."""
    version = 0
    started: dict[int, threading.Event] = {}  # rollout id -> its generation began
    generated: list[int] = []  # rollout ids, in the order their generation began


def rollout_fn(args: RolloutArgs, rollout_id: int, buffer: DataBuffer, evaluation: bool) -> list[list[Sample]]:
    """A --rollout-function-path: GROUPS prompt groups from the data buffer, answered at once by
    'engines' at Engines.version."""
    Engines.generated.append(rollout_id)
    Engines.started.setdefault(rollout_id, threading.Event()).set()
    groups = buffer.get(GROUPS)
    for group in groups:
        for s in group:
            s.tokens, s.response_length, s.loss_mask = [1, 2, 3, 4], 2, [1, 1]
            s.reward, s.status, s.weight_version = float(s.index % 2), Status.COMPLETED, Engines.version
    return groups


class TrainingBackend(FakeBackend):
    """A fake backend with an actor module (for --keep-old-actor): each optimizer step adds 1 to
    its weight, log-probs are the weight; it records what each rollout trained on."""

    def __init__(self, wait_for_next: bool = False) -> None:
        super().__init__()
        self.model = torch.nn.Linear(1, 1, bias=False)
        self.model.weight.data.zero_()
        self.wait_for_next = wait_for_next
        self.overlapped: list[bool] = []  # rollout N: N+1's generation began while N trained
        self.trained: dict[int, list[TrainSample]] = {}

    def log_probs(self, samples: list[TrainSample], ids: list[int], model: str = "actor",
                  with_entropy: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        w = float(self.model.weight.detach())
        return {i: (torch.full((samples[i].response_length,), w), torch.ones(samples[i].response_length))
                for i in ids}

    def train_step(self, samples: list[TrainSample], ids: list[int], loss: Any, need_entropy: bool,
                   role: str = "actor", rollout_id: int = 0, step_id: int = 0) -> dict[str, float]:
        if step_id == 0:
            self.trained[rollout_id] = samples
            if self.wait_for_next:
                nxt = Engines.started.setdefault(rollout_id + 1, threading.Event())
                self.overlapped.append(nxt.wait(NEXT_STARTS_WITHIN_S))
        self.model.weight.data += 1
        return super().train_step(samples, ids, loss, need_entropy, role, rollout_id, step_id)


def data(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"q{i}", "label": str(i)}) + "\n" for i in range(40)))
    return path


def build(tmp_path: Path, backend: TrainingBackend, num_rollout: int, *, interval: int = 1,
          keep_old_actor: bool = False, save_interval: int = 0, published: list[int] | None = None
          ) -> tuple[Loop, Lines]:
    Engines.version = 0
    reporter = Lines()
    buffer = DataBuffer(JsonlDataSource(data(tmp_path), label_key="label", seed=1, n_samples_per_prompt=PER_GROUP))
    args = RolloutArgs(hf_checkpoint="unused", router_url="http://127.0.0.1:1",
                       rollout_function_path=f"{__name__}.rollout_fn")
    journal = RolloutJournal(JobDir(tmp_path).rollout_journal, "flags")
    generator = RolloutGenerator(args, buffer, journal, TrainData(None), save_now.install())
    source = AheadRolloutSource(generator, backend.broadcast_object, reporter.heartbeat, save_now.install(),
                                num_rollout)
    progress = Progress()
    evals = EvalSchedule(None, True, None, None, reporter.heartbeat, reporter.amend)
    save_dir = tmp_path / "ckpt"
    checkpointer = Checkpointer(backend, CheckpointConfig(
        save_dir=save_dir, load_dir=save_dir, load_step=None, save_interval=save_interval, keep=None,
        num_rollout=num_rollout, job_dir=None), [progress, evals, source, journal], [journal.checkpointed],
        reporter.heartbeat)
    profiler = TrainProfiler(0)
    old_actor = OldActor(backend, interval) if keep_old_actor else None
    train_step = TrainStep(backend, TrainStepConfig(
        global_batch_size=2, need_entropy=False, on_policy_tolerance=None, ref_model=False, teacher=False,
        critic=False, value_clip=0.2, per_token_loss=False), LossConfig(), no_advantages, profiler,
        reporter.heartbeat, PhaseMemory(None), old_actor=old_actor)

    class EnginesPublisher(Publisher):
        def publish(self, version: int, rollout_id: int, weights: Any) -> dict[str, Any]:
            Engines.version = version
            if published is not None:
                published.append(version)
            return super().publish(version, rollout_id, weights)

    stops = StopRequests(save_now.install(), None, backend.broadcast_object, profiler.arm)
    loop = Loop(backend, progress, source, train_step, EnginesPublisher(None, list, None, reporter.heartbeat),
                checkpointer, evals, stops, None, reporter, profiler, PhaseMemory(None),  # type: ignore[arg-type]
                num_rollout, False, interval, old_actor)
    return loop, reporter


def run(loop: Loop) -> None:
    Engines.started, Engines.generated = {}, []
    loop.start(None, None)
    loop.run()


def staleness(backend: TrainingBackend) -> list[list[int]]:
    return [[s.staleness for s in backend.trained[r]] for r in sorted(backend.trained)]


def test_rollout_n_plus_1_is_generated_while_n_trains(tmp_path: Path) -> None:
    backend, published = TrainingBackend(wait_for_next=True), []
    loop, reporter = build(tmp_path, backend, 4, published=published)
    run(loop)
    assert backend.overlapped[:3] == [True] * 3, "rollout N+1 began generating before rollout N finished training"
    assert Engines.generated == [0, 1, 2, 3]
    assert published == [0, 1, 2, 3, 4]
    # Rollouts 0 and 1 both come from version 0; then each from the version before the trainer's.
    assert [[s.weight_version for s in backend.trained[r]] for r in range(4)] == [[v] * 4 for v in (0, 0, 1, 2)]
    assert staleness(backend) == [[0] * 4, [1] * 4, [1] * 4, [1] * 4]
    assert [line[STALENESS_MAX] for line in reporter.lines.values()] == [0, 1, 1, 1]
    for line in reporter.lines.values():  # what the trainer waited for data, and the engines for work
        assert 0 <= line[Metric.WAIT_TIME_RATIO] <= 1 and 0 <= line[ENGINE_WAIT_RATIO] <= 1
        assert line[Metric.TRAIN_STARTED_AT] <= line[Metric.TRAIN_ENDED_AT]


def test_update_weights_interval_publishes_every_nth_rollout(tmp_path: Path) -> None:
    backend, published = TrainingBackend(), []
    loop, reporter = build(tmp_path, backend, 4, interval=2, published=published)
    run(loop)
    assert published == [0, 2, 4], "the initial weights, then after rollouts 1 and 3"
    assert [backend.trained[r][0].weight_version for r in range(4)] == [0, 0, 0, 2]
    assert [line[STALENESS_MAX] for line in reporter.lines.values()] == [0, 1, 2, 1], "at most the interval"
    assert [line["published_version"] for line in reporter.lines.values()] == [0, 2, 2, 4]


def test_keep_old_actor_takes_old_log_probs_with_the_generating_weights(tmp_path: Path) -> None:
    backend = TrainingBackend()
    loop, _ = build(tmp_path, backend, 4, keep_old_actor=True)
    run(loop)
    # Version v's weight is 2v (two optimizer steps a rollout); rollout N is generated by version N-1.
    old = [{float(s.old_log_probs[0]) for s in backend.trained[r]} for r in range(4)]  # type: ignore[index]
    assert old == [{0.0}, {0.0}, {2.0}, {4.0}], "each sample's old log-probs are its generating weights'"
    assert float(backend.model.weight.detach()) == 8.0, "the live weights came back after each swap"


def test_without_keep_old_actor_old_log_probs_are_the_current_weights(tmp_path: Path) -> None:
    backend = TrainingBackend()
    loop, _ = build(tmp_path, backend, 3)
    run(loop)
    assert [{float(s.old_log_probs[0]) for s in backend.trained[r]} for r in range(3)] == [  # type: ignore[index]
        {0.0}, {2.0}, {4.0}]


def sample_ids(backend: TrainingBackend) -> dict[int, list[int | None]]:
    return {r: [s.sample_index for s in samples] for r, samples in backend.trained.items()}


def test_a_checkpoint_holds_the_rollout_generated_ahead_and_a_resume_trains_every_sample_once(
        tmp_path: Path) -> None:
    whole = TrainingBackend()
    loop, _ = build(tmp_path / "whole", whole, 4)
    run(loop)

    first = TrainingBackend()
    loop, _ = build(tmp_path / "cut", first, 4, save_interval=2)
    run(loop)
    (tmp_path / "cut" / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")  # the run dies after it
    common = torch.load(tmp_path / "cut" / "ckpt" / "iter_0000001" / "common.pt", weights_only=False)
    assert common[AHEAD_KEY]["rollout_id"] == 2, "rollout 2 was generated ahead, not trained: it is in the checkpoint"
    for entry in (tmp_path / "cut" / "rollout_journal").glob("*.pt"):
        entry.unlink()  # no journal to replay: the checkpoint alone carries rollout 2

    resumed = TrainingBackend()
    loop, _ = build(tmp_path / "cut", resumed, 4, save_interval=2)
    run(loop)
    assert Engines.generated == [3], "rollout 2 came from the checkpoint, not the engines"
    trained = {**{r: ids for r, ids in sample_ids(first).items() if r <= 1}, **sample_ids(resumed)}
    assert trained == sample_ids(whole), "every rollout trains the uninterrupted run's sample ids"
    every = [i for ids in trained.values() for i in ids]
    assert len(every) == len(set(every)) == 4 * GROUPS * PER_GROUP, "no sample lost, none trained twice"
