"""--rm-type remote_rm against a real aiohttp reward server on 127.0.0.1: slime's payload, the
answer as the reward (a dict picked by --reward-key), retries through a timeout and 5xx answers,
bounded concurrency; a server that stays down, or refuses, fails the rollout naming --rm-url."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from aiohttp import web

from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.generate import RolloutArgs, generate_rollout
from rollout.remote_rm import RemoteRewardError
from rollout.tiny_model import write_tiny_model
from tests.rollout.servers import free_port
from trainer.batch import TrainSample

START_WAIT_S = 10.0  # seconds the server thread may take to listen
STOP_WAIT_S = 10.0
PROMPTS, N = 4, 2


@dataclass
class RewardServer:
    """Answers {"score": 1.0 if the response holds the label else 0.0, "seen": n}. The first
    `hang` requests wait past any client timeout, the next `fail` get a 503; a label "bad" gets 400."""

    hang: int = 0
    fail: int = 0
    delay_s: float = 0.0
    payloads: list[dict] = field(default_factory=list)
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        n = self.requests
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            body = await request.json()
            if n <= self.hang:
                await asyncio.sleep(30)
            if n <= self.hang + self.fail:
                return web.Response(status=503, text="warming up")
            if body["label"] == "bad":
                return web.Response(status=400, text="no such label")
            await asyncio.sleep(self.delay_s)
            self.payloads.append(body)
            return web.json_response({"score": float(str(body["label"]) in body["response"]), "seen": n})
        finally:
            self.in_flight -= 1


@pytest.fixture
def serve() -> Iterator:
    """serve(server) -> its URL; every server started is stopped at the end."""
    stops = []

    def start(server: RewardServer) -> str:
        port, ready = free_port(), threading.Event()
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/reward", server.handle)
        # Handlers still hanging at the end are cancelled, not waited for.
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert ready.wait(START_WAIT_S), "the reward server did not start listening"
        stops.append((loop, thread))
        return f"http://127.0.0.1:{port}/reward"

    yield start
    for loop, thread in stops:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_WAIT_S)
        assert not thread.is_alive(), "the reward server did not stop"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _args(model: Path, rm_url: str, **kw) -> RolloutArgs:
    # The custom generate answers without an engine: the router is never called.
    return replace(RolloutArgs(hf_checkpoint=str(model), router_url="http://127.0.0.1:1", rollout_batch_size=PROMPTS,
                               n_samples_per_prompt=N, rm_type="remote_rm", rm_url=rm_url, rm_retry_backoff=0.01,
                               custom_generate_function_path="tests.rollout.reward_plugins.answer_by_index"), **kw)


def _buffer(tmp_path: Path, labels: list[str]) -> DataBuffer:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"what is {x}?", "label": x}) + "\n" for x in labels))
    return DataBuffer(JsonlDataSource(data, label_key="label", n_samples_per_prompt=N, shuffle=False))


def test_rewards_come_from_the_server_through_a_timeout_and_503s(serve, model: Path, tmp_path: Path) -> None:
    server = RewardServer(hang=1, fail=2)
    args = _args(model, serve(server), rm_timeout=0.5, rm_max_retries=4)
    groups = generate_rollout(args, 0, _buffer(tmp_path, ["11", "12", "13", "14"]))
    samples = [s for g in groups for s in g]
    assert server.requests == len(samples) + 3  # three attempts failed and were retried
    assert all(isinstance(s.reward, dict) for s in samples)
    assert [s.reward["score"] for s in samples] == [float(s.index % 2 == 0) for s in samples]
    # slime's payload: the prompt, the response and the label
    key = lambda p: json.dumps(p, sort_keys=True)  # noqa: E731
    assert sorted(map(key, server.payloads)) == sorted(
        key({"prompt": s.prompt, "response": s.response, "label": s.label}) for s in samples)
    # --reward-key picks what is trained on; without it a dict reward is refused by name
    assert [TrainSample.from_sample(s, "score").reward for s in samples] == [s.reward["score"] for s in samples]
    with pytest.raises(ValueError, match="the reward is a dict .*: give --reward-key"):
        TrainSample.from_sample(samples[0])


def test_requests_in_flight_are_bounded(serve, model: Path, tmp_path: Path) -> None:
    server = RewardServer(delay_s=0.05)
    generate_rollout(_args(model, serve(server), rm_concurrency=2), 0, _buffer(tmp_path, ["1", "2", "3", "4"]))
    assert server.requests == PROMPTS * N
    assert server.max_in_flight <= 2


def test_a_server_that_stays_down_fails_the_rollout_naming_rm_url(model: Path, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/reward"  # nothing listens there
    with pytest.raises(RemoteRewardError, match=f"--rm-url {url}: the reward server failed all 3 attempts .*"
                                                "Connect"):
        generate_rollout(_args(model, url, rm_max_retries=3), 0, _buffer(tmp_path, ["1", "2", "3", "4"]))


def test_a_server_that_keeps_failing_and_one_that_refuses(serve, model: Path, tmp_path: Path) -> None:
    url = serve(RewardServer(fail=10**6))
    with pytest.raises(RemoteRewardError, match=r"failed all 2 attempts .*\(last: HTTP 503 warming up\)"):
        generate_rollout(_args(model, url, rm_max_retries=2), 0, _buffer(tmp_path, ["1", "2", "3", "4"]))
    url = serve(RewardServer())
    with pytest.raises(RemoteRewardError, match=f"--rm-url {url} refused sample 0: HTTP 400 no such label"):
        generate_rollout(_args(model, url, rm_max_retries=5), 0, _buffer(tmp_path, ["bad", "2", "3", "4"]))
