"""The CPU engine over two "nodes" (two processes on 127.0.0.1), as SGLang's --nnodes 2: node rank 0
serves HTTP, rank 1 follows it; the trainer's publisher sizes its update group from /server_info
(tp_size 2: world 3) and both ranks join it; disk updates work too; a dead rank 1 ends rank 0 with
exit code 1 within PEER_TIMEOUT_S, and a dead rank 0 ends rank 1."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from rollout.cpu_engine.node_link import HEARTBEAT_S, PEER_TIMEOUT_S
from tests.rollout.cpu_engine_helpers import (
    EngineProcess,
    free_port,
    make_tiny_model,
    wait_until,
)
from trainer.publish import WeightPublisher

# A rank's death is seen within one exchange (PEER_TIMEOUT_S) after the next heartbeat; the rest
# is the process's own exit.
DEATH_SEEN_S = PEER_TIMEOUT_S + HEARTBEAT_S + 5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("models")
    return {seed: make_tiny_model(root / f"seed{seed}", seed=seed) for seed in (0, 1)}


def two_ranks(model: Path, logs: Path) -> tuple[EngineProcess, EngineProcess]:
    """Rank 0 (serving) and rank 1 of one engine; rank 1 is started first: it waits for rank 0."""
    common = ["--skip-server-warmup", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}",
              "--weight-update-group-timeout", "30"]
    follower = EngineProcess(model, logs / "rank1.log", api_key="k", extra=[*common, "--node-rank", "1"])
    leader = EngineProcess(model, logs / "rank0.log", api_key="k", extra=[*common, "--node-rank", "0"])
    return leader, follower


@pytest.fixture
def engine(models: dict[int, Path], tmp_path: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    leader, follower = two_ranks(models[0], tmp_path)
    try:
        leader.wait_ready()
        wait_until(lambda: "follows node rank 0" in follower.log_text(), 30, "rank 1 to join")
        yield leader, follower
    finally:
        leader.stop()
        follower.stop()


def test_only_rank_0_serves_and_tp_size_counts_every_rank(engine: tuple[EngineProcess, EngineProcess]) -> None:
    leader, follower = engine
    assert leader.get("/server_info").json()["tp_size"] == 2
    with pytest.raises(requests.ConnectionError):
        follower.get("/health")
    assert follower.proc.poll() is None


@pytest.mark.parametrize("transport", ["nccl", "disk"])  # nccl: an update group, on gloo here (no GPU)
def test_weight_updates_reach_an_engine_of_two_ranks(transport: str, engine: tuple[EngineProcess, EngineProcess],
                                                     models: dict[int, Path], tmp_path: Path) -> None:
    leader, follower = engine
    publisher = WeightPublisher(transport, tmp_path / "job", models[0], "k", timeout_s=30, backend="gloo")
    tensors = load_file(models[1] / "model.safetensors")
    try:
        result = publisher.publish(1, [leader.url], tensors.items())
        assert result.updated == [leader.url] and not result.dropped, result.dropped
        if transport == "nccl":  # rank 1 joined as rank 2 of 3: without it the rendezvous fails
            assert all(lane.world_size == 3 for lane in publisher._group.lanes)
    finally:
        publisher.close()
    name = next(iter(tensors))
    served = leader.post("/get_weights_by_name", {"name": name, "truncate_size": 2}).json()
    assert torch.allclose(torch.tensor(served), tensors[name][:2].float()), name
    assert leader.get("/model_info").json()["weight_version"] == "1"
    assert follower.proc.poll() is None and "failed" not in follower.log_text()


def test_a_dead_rank_1_fails_the_engine(engine: tuple[EngineProcess, EngineProcess]) -> None:
    leader, follower = engine
    follower.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    assert leader.proc.wait(DEATH_SEEN_S) == 1
    assert time.monotonic() - killed < DEATH_SEEN_S
    assert "the engine stops" in leader.log_text()


def test_a_hung_rank_1_fails_the_engine_and_a_dead_rank_0_ends_rank_1(models: dict[int, Path],
                                                                       tmp_path: Path) -> None:
    leader, follower = two_ranks(models[0], tmp_path)
    try:
        leader.wait_ready()
        wait_until(lambda: "follows node rank 0" in follower.log_text(), 30, "rank 1 to join")
        follower.proc.send_signal(signal.SIGSTOP)  # a hang: only the exchange's timeout can tell
        assert leader.proc.wait(DEATH_SEEN_S) == 1
        follower.proc.send_signal(signal.SIGCONT)
        assert follower.proc.wait(DEATH_SEEN_S) == 1
        assert "node rank 0 did not answer" in follower.log_text()
    finally:
        leader.stop()
        follower.proc.send_signal(signal.SIGCONT)
        follower.stop()
