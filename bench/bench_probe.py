"""Supervisor probe cycle with 1,000 simulated engines: the parallel prober against a sequential
one (slime's way: one engine after another), in the same run.

The engines are one separate process (tests/rollout/fake_engines.py): 1,000 ports on
127.0.0.1, each answering GET /health_generate after a small delay, a few with 503 and a few
never. Reported: cycle wall time, and this (the supervisor's) process's CPU time per cycle and
peak RSS. Run from the repository root: python -m bench.bench_probe
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import requests

from rollout.engine_client import HEALTH_PATH, EngineClient, ProbeResult
from tests.rollout.fake_engines import fake_engines


def sequential_cycle(session: requests.Session, targets: dict[str, str], timeout_s: float) -> dict[str, ProbeResult]:
    results = {}
    for name, url in targets.items():
        start = time.monotonic()
        try:
            resp = session.get(url + HEALTH_PATH, timeout=timeout_s)
            results[name] = ProbeResult(resp.status_code == 200, time.monotonic() - start)
        except requests.RequestException as err:
            results[name] = ProbeResult(False, time.monotonic() - start, type(err).__name__)
    return results


def measure(label: str, cycle: Callable[[], dict[str, ProbeResult]], cycles: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(cycles):
        cpu0, wall0 = time.process_time(), time.monotonic()
        results = cycle()
        walls.append(time.monotonic() - wall0)
        cpus.append(time.process_time() - cpu0)
    failed = sum(not r.ok for r in results.values())
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    print(f"{label:>10}: cycle {wall:6.2f} s (min {min(walls):.2f}, max {max(walls):.2f}), CPU {cpu:5.2f} s/cycle, "
          f"{failed} failed of {len(results)}")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", type=int, default=1000)
    parser.add_argument("--fail", type=int, default=10, help="engines answering 503")
    parser.add_argument("--hang", type=int, default=5, help="engines never answering")
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--cycles", type=int, default=5)
    args = parser.parse_args()
    ok = args.engines - args.fail - args.hang
    with fake_engines(ok, args.fail, args.hang, args.delay_ms) as ports:
        targets = {f"{b}-{i}": f"http://127.0.0.1:{p}" for b, ps in ports.items() for i, p in enumerate(ps)}
        print(f"{len(targets)} engines ({args.fail} x 503, {args.hang} hanging), {args.delay_ms:g} ms per answer, "
              f"timeout {args.timeout:g} s")
        with EngineClient(None, args.timeout) as client:
            client.probe_all(targets)  # first connections, imports
            par_wall, par_cpu = measure("parallel", lambda: client.probe_all(targets), args.cycles)
        rss_parallel = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        with requests.Session() as session:
            seq_wall, seq_cpu = measure("sequential", lambda: sequential_cycle(session, targets, args.timeout), 1)
    print(f"peak RSS after the parallel cycles: {rss_parallel:.0f} MiB (the whole bench process)")
    print(f"sequential / parallel: {seq_wall / par_wall:.1f}x the cycle time, {seq_cpu / par_cpu:.1f}x the CPU")


if __name__ == "__main__":
    main()
