"""CPU engine throughput at concurrency 1 and 16, and a generate_rollout round sent straight to the
engine against the same round through the real sglang-router (the router's overhead).

    python -m bench.bench_rollout [--tokens 64] [--requests 32]     (from the repository root)

Everything runs on 127.0.0.1: one CPU engine on the tiny model, one router in front of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp

from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.generate import RolloutArgs, generate_rollout
from rollout.router_client import RouterClient
from rollout.tiny_model import write_tiny_model
from tests.rollout.servers import API_KEY, engine, router


async def _throughput(url: str, concurrency: int, requests: int, tokens: int) -> float:
    """Completion tokens per second with `concurrency` requests in flight."""
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body = {"text": f"repeat: {i % 10}", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True,
                                                                  "temperature": 1.0, "sampling_seed": i}}
        async with gate, session.post(url + "/generate", json=body) as response:
            return (await response.json())["meta_info"]["completion_tokens"]

    async with aiohttp.ClientSession(headers=headers) as session:
        start_s = time.perf_counter()
        counts = await asyncio.gather(*(one(session, i) for i in range(requests)))
        return sum(counts) / (time.perf_counter() - start_s)


def _round_seconds(model: Path, url: str, data: Path) -> tuple[float, int]:
    args = RolloutArgs(hf_checkpoint=str(model), router_url=url, api_key=API_KEY, rollout_batch_size=32,
                       n_samples_per_prompt=4, rollout_max_response_len=32, rm_type="toy", rollout_concurrency=16)
    buffer = DataBuffer(JsonlDataSource(data, label_key="label", n_samples_per_prompt=4, seed=0))
    start_s = time.perf_counter()
    groups = generate_rollout(args, 0, buffer)
    return time.perf_counter() - start_s, sum(s.response_length for g in groups for s in g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    model = write_tiny_model(work / "model")
    data = work / "toy.jsonl"
    data.write_text("".join(json.dumps({"input": f"repeat: {i % 10}", "label": str(i % 10)}) + "\n" for i in range(32)))
    servers = []
    try:
        servers.append(engine(model, work / "engine.log"))
        servers.append(router(work / "router.log"))
        engine_url, router_url = servers[0].url, servers[1].url
        client = RouterClient(router_url, API_KEY, timeout_s=10)
        client.add_worker(engine_url, api_key=API_KEY)
        client.wait_listed(engine_url, timeout_s=60)

        asyncio.run(_throughput(engine_url, 4, 8, 8))  # warm up
        one = asyncio.run(_throughput(engine_url, 1, args.requests // 4, args.tokens))
        sixteen = asyncio.run(_throughput(engine_url, 16, args.requests, args.tokens))
        print(f"cpu_engine, tiny model, {args.tokens} tokens a request:")
        print(f"  concurrency  1: {one:8.0f} tokens/s")
        print(f"  concurrency 16: {sixteen:8.0f} tokens/s  ({sixteen / one:.1f}x concurrency 1: batching)")

        direct_s, direct_tokens = _round_seconds(model, engine_url, data)
        routed_s, routed_tokens = _round_seconds(model, router_url, data)
        assert direct_tokens == routed_tokens, "the same seeds must give the same round either way"
        print(f"generate_rollout, 32 prompts x 4 samples, {direct_tokens} tokens:")
        print(f"  straight to the engine: {direct_s:6.2f} s  {direct_tokens / direct_s:7.0f} tokens/s")
        print(f"  through the router:     {routed_s:6.2f} s  {routed_tokens / routed_s:7.0f} tokens/s  "
              f"(router overhead: {routed_s / direct_s:.3f}x the time)")
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    main()
