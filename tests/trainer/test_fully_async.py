"""The fully asynchronous rollout (slime's fully_async_rollout path, miles' flags) as the loop's
source, against a real CPU engine behind the real router, its decode steps held (the engine's
--decode-step-hold-ms) so that groups are still generating when the trainer takes a rollout or
publishes: groups in flight across rollout boundaries, the bounded queue, each pause mode, the
staleness bound with a slow engine, a stop that keeps the tokens, and slime's path accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.engine_client import EngineClient
from rollout.fully_async import FullyAsyncWorker
from rollout.generate import RolloutArgs
from rollout.group_ledger import DROP, RETRY, GroupLedger
from rollout.router_client import RouterClient
from rollout.sample import Status
from rollout.toy_task import write_toy_data
from slurm.devcluster.daemons import wait_for
from tests.rollout.servers import API_KEY
from tests.trainer.held_engine import TOKENS_SEEN_S, engine, generated_tokens, model
from trainer import save_now
from trainer.fully_async_source import (
    DROPPED_STALE,
    REQUEUED,
    RETRIED_STALE,
    FullyAsyncOptions,
    FullyAsyncSource,
)
from trainer.rollout_source import Rollout
from trainer.train_data import TrainData

BATCH, N, MAX_TOKENS = 2, 2, 12
PUBLISH_S = 120.0  # bound on one weight load


__all__ = ["engine", "model"]  # the fixtures


class Ledger(GroupLedger):
    """Records the most groups it ever held in flight and ready at once, and the groups it still
    held right after each rollout was taken."""
    most = 0
    left: list[set[int]] = []

    def take(self) -> Any:
        group = super().take()
        Ledger.most = max(Ledger.most, len(self.in_flight) + len(self.ready))
        return group

    def take_ready(self, *args: Any) -> Any:
        with self.changed:
            taken = super().take_ready(*args)
            if taken is not None:
                Ledger.left.append({g[0].group_index for g in self.ready} | set(self.in_flight))
            return taken

    def full(self) -> bool:
        with self.changed:
            return len(self.in_flight) + len(self.ready) == self.capacity


def source(model: Path, router: RouterClient, tmp_path: Path, *, capacity: int = 3 * BATCH,
           max_staleness: int | None = None, handler: str = DROP, mode: str = "retract") -> FullyAsyncSource:
    args = RolloutArgs(hf_checkpoint=str(model), router_url=router.url, api_key=API_KEY, rollout_batch_size=BATCH,
                       n_samples_per_prompt=N, rollout_max_response_len=MAX_TOKENS, rm_type="toy")
    buffer = DataBuffer(JsonlDataSource(write_toy_data(tmp_path / "toy.jsonl", num_prompts=200), label_key="label",
                                        n_samples_per_prompt=N, seed=3))
    worker = FullyAsyncWorker(args, Ledger(buffer, capacity))
    return FullyAsyncSource(worker, None, lambda: sorted(router.workers()), EngineClient(API_KEY, 30),
                            FullyAsyncOptions(BATCH, max_staleness, handler, mode, TrainData(None)), lambda obj: obj,
                            lambda phase, rollout_id: None, save_now.install())


def publish(src: FullyAsyncSource, router: RouterClient, model: Path, version: int) -> None:
    """A weight update as the loop does it: pause the engines, load `version` (the same weights), go on."""
    assert src.settle(publishing=True)
    for url in router.workers():
        EngineClient(API_KEY, PUBLISH_S).load_from_disk(url, model, version, PUBLISH_S)
    src.published(version)


def take(src: FullyAsyncSource, rollout_id: int, version: int) -> Rollout:
    rollout = src.rollout(rollout_id, version)
    assert rollout is not None
    return rollout


def test_groups_generate_across_rollouts_within_the_bounded_queue(engine, model: Path, tmp_path: Path) -> None:
    router, _ = engine
    Ledger.most, Ledger.left = 0, []
    src = source(model, router, tmp_path, capacity=2 * BATCH)
    src.published(1)
    ledger = src.worker.ledger if src.worker else None
    assert isinstance(ledger, Ledger)
    rollouts = []
    try:
        for r in range(3):  # the trainer trains while the worker fills the buffer up to its capacity
            if r:
                wait_for(ledger.full, TOKENS_SEEN_S, "the worker filling the buffer")
            rollouts.append(take(src, r, 1))
    finally:
        src.close()
    groups = [{s.group_index for s in r.samples()} for r in rollouts]
    # Groups still generating, or finished, when rollout r was taken are trained in a later rollout, or are
    # still in the buffer at the end: none is lost. (Rollouts take groups as they finish, so a group begun
    # after rollout r may finish, and be taken, before one left over from r: CI saw rollout 2 take 5 and 6
    # while 4 went on generating.)
    for r in (0, 1):
        assert Ledger.left[r] <= set().union(*groups[r + 1:], Ledger.left[2]), (r, groups, Ledger.left)
    assert Ledger.left[0] & (groups[1] | groups[2]), "no generation went on across a rollout's end"
    assert Ledger.most == 2 * BATCH, "never more groups generating and finished than the capacity"
    trained = [s.sample_index for r in rollouts for s in r.samples()]
    assert len(trained) == len(set(trained)) == 3 * BATCH * N


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_a_weight_update_pauses_the_engines_in_the_chosen_mode(engine, model: Path, tmp_path: Path,
                                                               mode: str) -> None:
    router, server = engine
    src = source(model, router, tmp_path, mode=mode)
    src.published(1)
    try:
        take(src, 0, 1)
        before = generated_tokens(server)
        wait_for(lambda: generated_tokens(server) > before, TOKENS_SEEN_S, "groups generating")
        in_flight = set(src.worker.ledger.in_flight) if src.worker else set()
        publish(src, router, model, 2)
        rollouts = [take(src, r, 2) for r in (1, 2, 3)]
    finally:
        src.close()
    samples = [s for r in rollouts for g in r.groups for s in g.samples]
    spanning = [s for r in rollouts for g in r.groups if g.samples[0].group_index in in_flight for s in g.samples]
    assert in_flight and spanning, "groups that were generating during the update were trained"
    if mode == "abort":  # slime's fully async: they start again from their prompts, with the new weights
        assert sum(r.metrics[REQUEUED] for r in rollouts) >= 1
        assert all(s.weight_version == 2 for s in spanning)
    else:  # the engines kept them: tokens of both versions, counted from the older
        assert sum(r.metrics[REQUEUED] for r in rollouts) == 0
        assert all(s.weight_version == 1 for s in spanning), "its oldest tokens are version 1's"
    assert all(s.staleness == 0 for s in samples), "staleness is the loop's to set"


@pytest.mark.parametrize("handler", [DROP, RETRY])
def test_staleness_never_exceeds_the_bound_with_a_slow_engine(engine, model: Path, tmp_path: Path,
                                                              handler: str) -> None:
    """Generation runs 3 rollouts ahead of a trainer that publishes after each: groups that waited
    would be 2 and 3 versions stale. With --max-weight-staleness 1 none is trained."""
    router, _ = engine
    src = source(model, router, tmp_path, capacity=4 * BATCH, max_staleness=1, handler=handler)
    src.published(1)
    versions, stale = [], 0
    try:
        take(src, 0, 1)
        wait_for(lambda: len(src.worker.ledger.ready) >= 3 * BATCH if src.worker else False, TOKENS_SEEN_S * 3,
                 "generation three rollouts ahead")
        for r in range(1, 4):
            publish(src, router, model, 1 + r)
            rollout = take(src, r, 1 + r)
            versions += [(1 + r) - (s.weight_version or 0) for s in rollout.samples()]
            stale += rollout.metrics[DROPPED_STALE if handler == DROP else RETRIED_STALE]
    finally:
        src.close()
    assert max(versions) <= 1, "no sample trained beyond the bound"
    assert stale >= 2 * BATCH * N, "groups that would have exceeded it went by the handler"


def test_a_stop_keeps_the_tokens_and_a_resume_continues_from_them(engine, model: Path, tmp_path: Path) -> None:
    router, server = engine
    src = source(model, router, tmp_path)
    src.published(1)
    take(src, 0, 1)
    before = generated_tokens(server)
    wait_for(lambda: generated_tokens(server) >= before + 4, TOKENS_SEEN_S, "tokens generated")
    src.stop_generating()
    state = src.state_dict()
    stopped = {s["index"]: s["tokens"] for g in state["async_ledger"]["buffer"]["pending"] for s in g
               if s["status"] == Status.ABORTED.value and s["response_length"] > 0}
    assert stopped, "groups stopped mid-generation went back to pending with their tokens"

    resumed = source(model, router, tmp_path / "resumed")
    resumed.load_state_dict(state)
    resumed.published(1)
    try:
        rollouts = [take(resumed, r, 1) for r in (1, 2, 3)]
    finally:
        resumed.close()
    continued = {s.sample_index: s.tokens.tolist() for r in rollouts for s in r.samples() if s.sample_index in stopped}
    assert continued, "the stopped groups were trained after the resume"
    for index, tokens in continued.items():
        assert tokens[:len(stopped[index])] == stopped[index], f"sample {index} went on from its tokens"


def test_slimes_fully_async_path_selects_the_source(model: Path, tmp_path: Path) -> None:
    from trainer.args import ArgsError, parse_args

    data = write_toy_data(tmp_path / "toy.jsonl")
    base = ["--hf-checkpoint", str(model), "--num-rollout", "3", "--prompt-data", str(data), "--engine-urls", "u",
            "--n-samples-per-prompt", "2",
            "--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async"]
    config = parse_args([*base, "--train-async", "--max-weight-staleness", "2", "--pause-generation-mode", "in_place"])
    assert config.rollout.fully_async and config.rollout.rollout_plugin is None
    assert (config.asynchronous.max_weight_staleness, config.asynchronous.pause_generation_mode) == (2, "in_place")
    with pytest.raises(ArgsError, match="--max-weight-staleness takes effect with the fully async rollout"):
        parse_args(base[:-2] + ["--max-weight-staleness", "2"])
    with pytest.raises(ArgsError, match="--partial-rollout: the fully async rollout does not take it"):
        parse_args([*base, "--partial-rollout"])
