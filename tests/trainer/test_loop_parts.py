"""The loop's seams, without a model or engines: a fake rollout source drives the loop over a fake
backend (CPU, no torch.distributed), and the checkpoint manager saves and restores every stateful
part. (The whole trainer, exactly: tests/trainer/test_rl_loop.py, tests/integration/test_resume.py.)"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from contract.job_dir import JobDir, Phase
from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.generate import RolloutArgs
from rollout.request_transport import RETRIED_METRIC
from rollout.sample import Sample
from trainer import save_now
from trainer.backend import Backend
from trainer.batch import TrainSample
from trainer.checkpointer import CheckpointConfig, Checkpointer
from trainer.evals import EvalSchedule
from trainer.loop import Loop, Progress
from trainer.losses import LossConfig
from trainer.phase_memory import PhaseMemory
from trainer.profiling import TrainProfiler
from trainer.publish import WeightPublisher
from trainer.publisher import Publisher
from trainer.rollout_journal import RolloutJournal
from trainer.rollout_source import (
    Rollout,
    RolloutGenerator,
    RolloutSource,
    SampleGroup,
    SyncRolloutSource,
)
from trainer.save_now import StopRequests
from trainer.train_data import TrainData
from trainer.train_step import TrainStep, TrainStepConfig

ROLLOUTS = 3


class FakeBackend(Backend):
    """One rank; log-probs are zeros; an optimizer step counts itself; save/load write a real
    (tiny) DCP folder and common.pt, as the real backends do."""

    rank, world_size, dp_rank, dp_size = 0, 1, 0, 1

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, int]] = []  # (rollout_id, step_id, batch size)
        self.weight = torch.zeros(2)

    def log_probs(self, samples: list[TrainSample], ids: list[int], model: str = "actor",
                  with_entropy: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        return {i: (torch.zeros(samples[i].response_length),
                    torch.ones(samples[i].response_length) if with_entropy else None) for i in ids}

    def train_step(self, samples: list[TrainSample], ids: list[int], loss: Any, need_entropy: bool,
                   role: str = "actor", rollout_id: int = 0, step_id: int = 0) -> dict[str, float]:
        self.steps.append((rollout_id, step_id, len(ids)))
        self.weight += 1
        return {"loss": float(len(self.steps)), "grad_norm": 1.0}

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "w", self.weight

    def save(self, ckpt_dir: Path, common: dict[str, Any]) -> None:
        dcp.save({"w": self.weight}, checkpoint_id=str(ckpt_dir), no_dist=True)
        torch.save(common, ckpt_dir / "common.pt")

    def load(self, ckpt_dir: Path, weights_only: bool) -> dict[str, Any]:
        state = {"w": torch.empty(2)}
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=True)
        self.weight = state["w"]
        return {} if weights_only else torch.load(ckpt_dir / "common.pt", weights_only=False)

    def broadcast_object(self, obj: Any) -> Any:
        return obj


def sample(reward: float, group_index: int, weight_version: int) -> TrainSample:
    return TrainSample(tokens=torch.arange(5), response_length=2, loss_mask=torch.ones(2), reward=reward,
                       group_index=group_index, weight_version=weight_version)


class FakeSource(RolloutSource):
    """Two groups of two samples per rollout, tagged with the version the loop says it has."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def rollout(self, rollout_id: int, weight_version: int) -> Rollout | None:
        self.asked.append((rollout_id, weight_version))
        return Rollout(rollout_id, [SampleGroup(weight_version, [sample(1.0, g, weight_version), sample(0.0, g, weight_version)])
                                    for g in range(2)], {RETRIED_METRIC: rollout_id})

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Lines:
    """A Reporter that keeps the rollouts' lines and heartbeats."""

    def __init__(self) -> None:
        self.lines: dict[int, dict[str, Any]] = {}
        self.beats: list[tuple[Phase, int]] = []

    def heartbeat(self, phase: Phase, rollout_id: int) -> None:
        self.beats.append((phase, rollout_id))

    def rollout(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        self.lines[rollout_id] = metrics

    def drop_from(self, rollout_id: int) -> None:
        self.lines = {k: v for k, v in self.lines.items() if k < rollout_id}

    def amend(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        self.lines[rollout_id].update(metrics)

    def close(self) -> None:
        pass


def build(backend: FakeBackend, source: Any, reporter: Lines, save_dir: Path | None,
          published: list[int] | None = None, transport: WeightPublisher | None = None,
          memory: PhaseMemory | None = None, fwd_flops: Callable[[list[int]], float] | None = None) -> Loop:
    """The loop over these parts; transport: rank 0's weight publisher (None: nothing is sent);
    memory: the per-phase GPU memory (None: no GPU); fwd_flops: the model's FLOPs (None: no perf/*_tflops)."""
    memory = memory or PhaseMemory(None)
    progress = Progress()
    evals = EvalSchedule(None, True, None, None, reporter.heartbeat, reporter.amend)
    checkpointer = Checkpointer(backend, CheckpointConfig(
        save_dir=save_dir, load_dir=save_dir, load_step=None, save_interval=2, keep=None, num_rollout=ROLLOUTS,
        job_dir=None), [progress, evals, source], [], reporter.heartbeat)
    profiler = TrainProfiler(0)
    train_step = TrainStep(backend, TrainStepConfig(
        global_batch_size=2, need_entropy=False, on_policy_tolerance=None, ref_model=False, teacher=False,
        critic=False, value_clip=0.2, per_token_loss=False, fwd_flops=fwd_flops), LossConfig(), no_advantages, profiler, reporter.heartbeat,
        memory)

    class Recording(Publisher):
        def publish(self, version: int, rollout_id: int, weights: Any) -> dict[str, Any]:
            if published is not None:
                published.append(version)
            return super().publish(version, rollout_id, weights)

    publisher = Recording(transport, list, None, reporter.heartbeat)
    stops = StopRequests(save_now.install(), None, backend.broadcast_object, profiler.arm)
    return Loop(backend, progress, source, train_step, publisher, checkpointer, evals, stops, None,
                reporter, profiler, memory, ROLLOUTS, True)  # type: ignore[arg-type]  # Lines stands in for a Reporter


def no_advantages(samples: list[TrainSample]) -> None:
    for s in samples:
        s.advantages = torch.zeros(s.response_length)


def test_a_rollout_source_drives_the_loop(tmp_path: Path) -> None:
    backend, source, reporter, published = FakeBackend(), FakeSource(), Lines(), []
    loop = build(backend, source, reporter, tmp_path / "ckpt", published)
    loop.start(None, None)
    loop.run()
    # Rollout N is asked for with the version trained on N rollouts, which the engines then serve.
    assert source.asked == [(0, 0), (1, 1), (2, 2)]
    assert published == [0, 1, 2, 3]
    assert backend.steps == [(r, s, 2) for r in range(ROLLOUTS) for s in range(2)], "4 samples, batches of 2"
    assert [(m["weight_version"], m["published_version"]) for m in reporter.lines.values()] == [(0, 1), (1, 2), (2, 3)]
    assert [m["passrate/pass@1"] for m in reporter.lines.values()] == [0.5] * ROLLOUTS
    assert [m[RETRIED_METRIC] for m in reporter.lines.values()] == list(range(ROLLOUTS)), "the source's own numbers"
    assert [("save_model_time" in m or "save_seconds" in m) for m in reporter.lines.values()] == [False, True, True]
    assert (Phase.TRAIN, 2) in reporter.beats and (Phase.SAVE, 2) in reporter.beats


def test_a_resumed_loop_goes_on_where_the_checkpoint_left(tmp_path: Path) -> None:
    first = build(FakeBackend(), FakeSource(), Lines(), tmp_path / "ckpt")
    first.start(None, None)
    first.run()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")  # back to rollout 1's save
    backend, source, reporter, published = FakeBackend(), FakeSource(), Lines(), []
    resumed = build(backend, source, reporter, tmp_path / "ckpt", published)
    resumed.start(None, None)
    assert (resumed.progress.next_rollout, resumed.progress.weight_version) == (2, 2)
    assert torch.equal(backend.weight, torch.full((2,), 4.0)), "the backend's state came back too"
    resumed.run()
    assert source.asked == [(2, 2)] and published == [2, 3]


def test_save_now_during_training_saves_without_publishing(tmp_path: Path) -> None:
    signal = save_now.install()
    backend, reporter, published = FakeBackend(), Lines(), []

    class SignalledWhileTraining(FakeSource):
        def rollout(self, rollout_id: int, weight_version: int) -> Rollout | None:
            signal.requested = rollout_id == 0  # as SIGUSR1 after the rollout was generated
            return super().rollout(rollout_id, weight_version)

    loop = build(backend, SignalledWhileTraining(), reporter, tmp_path / "ckpt", published)
    try:
        loop.start(None, None)
        loop.run()
    finally:
        signal.requested = False
    assert published == [0], "the trained weights are not published: the resumed run publishes them"
    assert list(reporter.lines) == [0] and loop.checkpointer.last_saved == 0
    common = torch.load(tmp_path / "ckpt" / "iter_0000000" / "common.pt", weights_only=False)
    assert (common["rollout_id"], common["weight_version"]) == (0, 1)


def test_the_checkpoint_manager_restores_every_part(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}", "label": str(i)}) + "\n" for i in range(10)))

    def parts() -> tuple[Progress, EvalSchedule, SyncRolloutSource, RolloutJournal, DataBuffer]:
        buffer = DataBuffer(JsonlDataSource(data, label_key="label", seed=3, n_samples_per_prompt=2))
        journal = RolloutJournal(JobDir(tmp_path).rollout_journal, "flags")
        generator = RolloutGenerator(None, buffer, journal, TrainData(None), save_now.install())  # type: ignore[arg-type]
        return (Progress(), EvalSchedule(2, True, None, None, Lines().heartbeat, Lines().amend),
                SyncRolloutSource(generator, lambda obj: obj, Lines().heartbeat), journal, buffer)

    def checkpointer(backend: FakeBackend, progress: Progress, evals: EvalSchedule, source: SyncRolloutSource,
                     journal: RolloutJournal) -> Checkpointer:
        return Checkpointer(backend, CheckpointConfig(
            save_dir=tmp_path / "ckpt", load_dir=tmp_path / "ckpt", load_step=None, save_interval=1, keep=None,
            num_rollout=10, job_dir=None), [progress, evals, source, journal], [journal.checkpointed], Lines().heartbeat)

    progress, evals, source, journal, buffer = parts()
    buffer.get(3)  # the data source moves on
    buffer.add([[Sample(index=0, group_index=7, prompt="left unfinished")]])  # a partial rollout's group
    progress.next_rollout, progress.weight_version, evals.owed = 5, 5, 4
    saving = checkpointer(FakeBackend(), progress, evals, source, journal)
    saving.save(4)
    assert journal.lineage is not None and journal.lineage != "initial", "the journal took the new lineage"

    progress2, evals2, source2, journal2, buffer2 = parts()
    loading = checkpointer(FakeBackend(), progress2, evals2, source2, journal2)
    assert loading.resume() == tmp_path / "ckpt" / "iter_0000004"
    assert (progress2.next_rollout, progress2.weight_version, evals2.owed) == (5, 5, 4)
    assert buffer2.state_dict() == buffer.state_dict() and buffer2.pending[0][0].group_index == 7
    assert journal2.lineage == journal.lineage and loading.last_saved == 4
    assert loading.state_dict().keys() == saving.state_dict().keys() == {
        "rollout_id", "weight_version", "eval_owed", "data_buffer", "journal_lineage"}, "common.pt's keys as before"


RETRIES = {0: 2, 1: 0, 2: 5}  # requests a rollout function sent again, by rollout


def retrying_rollout(args: RolloutArgs, rollout_id: int, buffer: DataBuffer | None, evaluation: bool) -> list:
    """A --rollout-function-path whose requests needed RETRIES[rollout_id] retries (counted where the
    request transport counts them)."""
    args.request_counts.retried += RETRIES[rollout_id]
    return [[Sample(index=0, group_index=0, prompt="p", tokens=[1, 2], response_length=1, reward=1.0)]]


def test_each_rollouts_line_counts_the_requests_it_retried(tmp_path: Path) -> None:
    args = RolloutArgs(hf_checkpoint="unused", router_url="http://127.0.0.1:1",
                       rollout_function_path=f"{__name__}.retrying_rollout")
    journal = RolloutJournal(JobDir(tmp_path).rollout_journal, "flags")
    generator = RolloutGenerator(args, None, journal, TrainData(None), save_now.install())
    source = SyncRolloutSource(generator, lambda obj: obj, Lines().heartbeat)
    assert [source.rollout(r, 0).metrics[RETRIED_METRIC] for r in RETRIES] == list(RETRIES.values())
    # Generated again after a restart: replayed from the rollout journal, no request sent.
    assert generator.generate(2) and generator.metrics[RETRIED_METRIC] == 0
