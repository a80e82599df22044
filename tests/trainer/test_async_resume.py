"""Exact resume with work in flight, by sample ids, with the loop's parts (the real data buffer,
rollout journal and checkpoints, a fake backend) against a real CPU engine whose decode steps are
held (--decode-step-hold-ms), so groups are mid-generation when the trainer dies or stops:

- fully async, the trainer killed mid-step: the resume replays the rollouts the journal holds (the
  same sample ids, no request sent), then generates on; every sample id handed out is trained once
  in the final run or still waits in the ledger;
- fully async, a save-now while groups generate (a preemption mid-overlap): they are saved with the
  tokens they have and continue from them after the resume;
- train_async.py with --partial-rollout, a save-now while rollout N+1 generates: its groups go back
  to the data buffer with their tokens, and the resumed run continues them.
(The ledger's moves alone: tests/rollout/test_group_ledger.py; on the devcluster:
tests/integration/test_async_faults.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from contract.job_dir import JobDir
from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.engine_client import EngineClient, EngineError
from rollout.fully_async import FullyAsyncWorker
from rollout.generate import RolloutArgs
from rollout.group_ledger import DROP, GroupLedger
from rollout.router_client import RouterClient
from rollout.toy_task import write_toy_data
from slurm.devcluster.daemons import wait_for
from tests.rollout.servers import API_KEY
from tests.trainer.held_engine import TOKENS_SEEN_S, engine, model, more_tokens
from tests.trainer.test_loop_parts import FakeBackend, Lines, no_advantages
from trainer import save_now
from trainer.ahead_source import AheadRolloutSource
from trainer.batch import TrainSample
from trainer.checkpointer import CheckpointConfig, Checkpointer
from trainer.evals import EvalSchedule
from trainer.fully_async_source import LEDGER_KEY, FullyAsyncOptions, FullyAsyncSource
from trainer.loop import Loop, Progress
from trainer.losses import LossConfig
from trainer.phase_memory import PhaseMemory
from trainer.profiling import TrainProfiler
from trainer.publisher import Publisher
from trainer.rollout_journal import RolloutJournal
from trainer.rollout_source import RolloutGenerator, RolloutSource
from trainer.save_now import StopRequests
from trainer.train_data import TrainData
from trainer.train_step import TrainStep, TrainStepConfig

BATCH, N, MAX_TOKENS, ROLLOUTS = 2, 2, 16, 5


__all__ = ["engine", "model"]  # the fixtures


class Killed(Exception):
    """The trainer dies mid-step (as a SIGKILL would end it)."""


class Backend(FakeBackend):
    """Records each rollout's samples; `at[rollout_id]` runs at that rollout's first step."""

    def __init__(self, at: dict[int, Callable[[], None]] | None = None) -> None:
        super().__init__()
        self.at = at or {}
        self.trained: dict[int, list[TrainSample]] = {}

    def train_step(self, samples: list[TrainSample], ids: list[int], loss: Any, need_entropy: bool,
                   role: str = "actor", rollout_id: int = 0, step_id: int = 0) -> dict[str, float]:
        if step_id == 0:
            self.trained[rollout_id] = samples
            if rollout_id in self.at:
                self.at[rollout_id]()
        return super().train_step(samples, ids, loss, need_entropy, role, rollout_id, step_id)

    def ids(self) -> dict[int, list[int | None]]:
        return {r: [s.sample_index for s in samples] for r, samples in self.trained.items()}


def rollout_args(model: Path, router: RouterClient, **changed: Any) -> RolloutArgs:
    return RolloutArgs(hf_checkpoint=str(model), router_url=router.url, api_key=API_KEY, rollout_batch_size=BATCH,
                       n_samples_per_prompt=N, rollout_max_response_len=MAX_TOKENS, rm_type="toy", **changed)


def buffer(job: Path) -> DataBuffer:
    data = write_toy_data(job / "toy.jsonl", num_prompts=200)
    return DataBuffer(JsonlDataSource(data, label_key="label", n_samples_per_prompt=N, seed=3))


def fully_async(model: Path, router: RouterClient, job: Path, backend: Backend, journal: RolloutJournal) -> Any:
    worker = FullyAsyncWorker(rollout_args(model, router), GroupLedger(buffer(job), 3 * BATCH))
    return FullyAsyncSource(worker, journal, lambda: sorted(router.workers()), EngineClient(API_KEY, 30),
                            FullyAsyncOptions(BATCH, None, DROP, "retract", TrainData(None)), backend.broadcast_object,
                            Lines().heartbeat, save_now.install())


def ahead(model: Path, router: RouterClient, job: Path, backend: Backend, journal: RolloutJournal) -> Any:
    generator = RolloutGenerator(rollout_args(model, router, partial_rollout=True), buffer(job), journal,
                                 TrainData(None), save_now.install())
    return AheadRolloutSource(generator, backend.broadcast_object, Lines().heartbeat, save_now.install(), ROLLOUTS)


def loop(job: Path, backend: Backend, make_source: Callable[..., RolloutSource], model: Path,
         router: RouterClient, save_interval: int, drop: Callable[[str], None] | None = None) -> Loop:
    """The loop over `job` (its checkpoints and rollout journal): a trainer that restarts there
    resumes. drop: told an engine that failed a weight update (the supervisor's part)."""
    reporter, journal = Lines(), RolloutJournal(JobDir(job).rollout_journal, "flags")
    source = make_source(model, router, job, backend, journal)
    progress, evals = Progress(), EvalSchedule(None, True, None, None, reporter.heartbeat, reporter.amend)
    checkpointer = Checkpointer(backend, CheckpointConfig(
        save_dir=job / "ckpt", load_dir=job / "ckpt", load_step=None, save_interval=save_interval, keep=None,
        num_rollout=ROLLOUTS, job_dir=None), [progress, evals, source, journal], [journal.checkpointed],
        reporter.heartbeat)
    profiler = TrainProfiler(0)
    train_step = TrainStep(backend, TrainStepConfig(
        global_batch_size=BATCH * N, need_entropy=False, on_policy_tolerance=None, ref_model=False, teacher=False,
        critic=False, value_clip=0.2, per_token_loss=False), LossConfig(), no_advantages, profiler, reporter.heartbeat,
        PhaseMemory(None))

    class EnginesPublisher(Publisher):
        """Loads each version on the engines (the same weights), as the real transport does: an
        engine whose update fails is dropped."""
        def publish(self, version: int, rollout_id: int, weights: Any) -> dict[str, Any]:
            for url in sorted(router.workers()):
                try:
                    EngineClient(API_KEY, 120).load_from_disk(url, model, version, 120)
                except EngineError:
                    if drop is None:
                        raise
                    drop(url)
            return super().publish(version, rollout_id, weights)

    stops = StopRequests(save_now.install(), None, backend.broadcast_object, profiler.arm)
    return Loop(backend, progress, source, train_step, EnginesPublisher(None, list, None, reporter.heartbeat),
                checkpointer, evals, stops, None, reporter, profiler, PhaseMemory(None), ROLLOUTS,  # type: ignore[arg-type]
                False)


def run(job_loop: Loop) -> None:
    try:
        job_loop.start(None, None)
        job_loop.run()
    finally:
        job_loop.source.close()  # the dead trainer's worker thread ends with its process


def final_ledger_ids(job_loop: Loop) -> set[int]:
    state = job_loop.source.state_dict()[LEDGER_KEY]
    return {s["index"] for g in [*state["buffer"]["pending"], *state["ready"]] for s in g}


def handed_out(job_loop: Loop) -> int:
    source = job_loop.source
    assert isinstance(source, FullyAsyncSource) and source.ledger is not None
    return source.ledger.buffer.source.next_sample_index


def test_fully_async_trainer_killed_mid_step_replays_and_trains_every_sample_once(engine, model: Path,
                                                                                  tmp_path: Path) -> None:
    router, _ = engine

    def kill() -> None:
        raise Killed()
    first = Backend(at={3: kill})
    with pytest.raises(Killed):
        run(loop(tmp_path, first, fully_async, model, router, save_interval=2))  # saved after rollout 1
    started: list[bool] = []
    resumed = Backend(at={r: lambda: started.append(worker.started) for r in (2, 3, 4)})
    second = loop(tmp_path, resumed, fully_async, model, router, save_interval=2)
    worker = second.source.worker  # type: ignore[attr-defined]
    run(second)
    assert sorted(resumed.trained) == [2, 3, 4]
    assert started == [False, False, True], "the worker started only after the journal's rollouts"
    assert resumed.ids()[2] == first.ids()[2] and resumed.ids()[3] == first.ids()[3], \
        "rollouts 2 and 3 were replayed from the journal: the very samples, no request sent"
    final = {**{r: ids for r, ids in first.ids().items() if r <= 1}, **resumed.ids()}
    trained = [i for ids in final.values() for i in ids]
    assert len(trained) == len(set(trained)) == ROLLOUTS * BATCH * N, "none trained twice"
    assert set(trained) | final_ledger_ids(second) == set(range(handed_out(second))), \
        "every sample handed out is trained or waits in the ledger: none lost"


def test_fully_async_save_now_mid_overlap_keeps_the_tokens_generated(engine, model: Path, tmp_path: Path) -> None:
    router, server = engine
    signal = save_now.install()

    def preempt() -> None:
        wait_for(more_tokens(server), TOKENS_SEEN_S, "groups generating while rollout 2 trains")
        signal.requested = True  # SIGUSR1: the supervisor's save-now
    first = Backend(at={2: preempt})
    first_loop = loop(tmp_path, first, fully_async, model, router, save_interval=100)
    try:
        run(first_loop)
    finally:
        signal.requested = False
    assert sorted(first.trained) == [0, 1, 2]
    common = torch.load(tmp_path / "ckpt" / "iter_0000002" / "common.pt", weights_only=False)
    kept = {s["index"]: s["tokens"] for g in common[LEDGER_KEY]["buffer"]["pending"] for s in g
            if s["response_length"] > 0}
    assert kept, "the groups generating at the save-now are in the checkpoint with their tokens"
    resumed = Backend()
    second = loop(tmp_path, resumed, fully_async, model, router, save_interval=100)
    run(second)
    final = {**first.ids(), **resumed.ids()}
    trained = [i for ids in final.values() for i in ids]
    assert len(trained) == len(set(trained)) == ROLLOUTS * BATCH * N
    assert set(trained) | final_ledger_ids(second) == set(range(handed_out(second)))
    continued = {s.sample_index: s.tokens.tolist() for samples in resumed.trained.values() for s in samples
                 if s.sample_index in kept}
    assert continued and all(continued[i][:len(kept[i])] == kept[i] for i in continued), \
        "each went on from the tokens it had"


def test_train_async_save_now_while_the_next_rollout_generates_keeps_its_tokens(engine, model: Path,
                                                                                tmp_path: Path) -> None:
    router, server = engine
    signal = save_now.install()

    def preempt() -> None:
        wait_for(more_tokens(server), TOKENS_SEEN_S, "rollout 2 generating while rollout 1 trains")
        signal.requested = True
    first = Backend(at={1: preempt})
    try:
        run(loop(tmp_path, first, ahead, model, router, save_interval=100))
    finally:
        signal.requested = False
    common = torch.load(tmp_path / "ckpt" / "iter_0000001" / "common.pt", weights_only=False)
    pending = common["data_buffer"]["pending"]
    kept = {s["index"]: s["tokens"] for g in pending for s in g if s["response_length"] > 0}
    assert len(pending) == BATCH and kept, "rollout 2's groups wait in the data buffer with their tokens"
    assert common["ahead_rollout"] is None
    resumed = Backend()
    run(loop(tmp_path, resumed, ahead, model, router, save_interval=100))
    assert sorted(resumed.trained) == [2, 3, 4]
    assert {s["index"] for g in pending for s in g} == set(resumed.ids()[2]), "rollout 2 is the stopped groups"
    trained = [i for ids in {**first.ids(), **resumed.ids()}.values() for i in ids]
    assert len(trained) == len(set(trained)) == ROLLOUTS * BATCH * N and set(trained) == set(range(len(trained)))
    continued = {s.sample_index: s.tokens.tolist() for s in resumed.trained[2]}
    assert all(continued[i][:len(kept[i])] == kept[i] for i in kept), "each went on from the tokens it had"
