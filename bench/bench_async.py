"""Asynchronous RL against the synchronous loop, in one process: samples trained per second and the
reward per trained sample. `python -m trainer` (the megatron backend, on the CPU) on the toy task
against 2 CPU engines behind the real sglang-router, the same engines for every run, whose decode
steps are held `--hold-ms` each (the CPU engine's --decode-step-hold-ms: a SIMULATION of GPU
decode, the engine sleeping without using the CPU, so that generation and training do not share
cores, as where the trainer and the engines have GPUs of their own). Runs, in turn:

    sync          slime's train.py: generate rollout N, then train it
    train_async   slime's train_async.py: rollout N+1 generated while N trains
    fully_async   train_async.py with slime's fully async rollout (groups across rollouts)

Samples trained per second is taken in the steady state: the samples of rollouts 1..N-1 over the
time from the end of rollout 0's training to the end of the last one's (trainer start-up and the
first rollout, which nothing overlaps, left out). Prints each run's rate, its ratio to sync (the
goal: >= 1.6x), its mean reward per trained sample, and where the time went.

    PYTHONPATH=. python -m bench.bench_async [--rollouts 12] [--hold-ms 40] [--response-len 16] [--batch 16]
                                             [--steps-per-rollout 1]

On a GPU machine (2 GPUs or more) the trainer runs on GPU 0 and its cores are its own; with
`--engine-device cuda --hold-ms 0` the engines decode for real on GPU 1 (no simulation).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from rollout.tiny_model import write_tiny_model
from rollout.toy_task import write_toy_data
from tests.rollout.servers import engines_behind_router
from tests.trainer.test_rl_loop import metrics, trainer

FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
MODES = {"sync": [], "train_async": ["--train-async"],
         "fully_async": ["--train-async", "--rollout-function-path", FULLY_ASYNC]}


def steady_rate(lines: list[dict]) -> float:
    """Samples trained per second from the end of rollout 0's training to the end of the last's."""
    return sum(m["samples"] for m in lines[1:]) / (lines[-1]["train_ended_at"] - lines[0]["train_ended_at"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=12)
    parser.add_argument("--hold-ms", type=float, default=40.0, help="each decode step of the engines (simulated GPU)")
    parser.add_argument("--response-len", type=int, default=16, help="--rollout-max-response-len")
    parser.add_argument("--batch", type=int, default=16, help="--rollout-batch-size (x 8 samples per prompt)")
    parser.add_argument("--steps-per-rollout", type=int, default=1,
                        help="--num-steps-per-rollout: optimizer steps a rollout, training that much longer "
                             "(published runs train 32-38%% of a synchronous step)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="the runs, in this order, sync first (the others' ratios are against it)")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--engine-device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: both engines on GPU 1 (real decode, give --hold-ms 0), the trainer on GPU 0")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if modes[0] != "sync" or not set(modes) <= set(MODES):
        parser.error(f"--modes must start with sync and name only {', '.join(MODES)}; got {args.modes!r}")
    engine_flags = ["--decode-step-hold-ms", str(args.hold_ms)]
    if args.engine_device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            parser.error(f"--engine-device cuda needs 2 GPUs (the trainer on GPU 0, the engines on GPU 1); "
                         f"torch sees {torch.cuda.device_count()}")
        engine_flags += ["--device", "cuda", "--base-gpu-id", "1", "--mem-fraction-static", "0.3"]
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_async_"))
    (root / "servers").mkdir(parents=True, exist_ok=True)
    model = write_tiny_model(root / "model", seed=0)
    data = write_toy_data(root / "toy.jsonl", num_prompts=512)
    flags = ["--num-rollout", str(args.rollouts), "--rollout-batch-size", str(args.batch), "--lr", "1e-2",
             "--rollout-max-response-len", str(args.response_len),
             "--num-steps-per-rollout", str(args.steps_per_rollout)]
    rates: dict[str, float] = {}
    with engines_behind_router(model, root / "servers", flags=tuple(engine_flags)) as (router, _):
        for mode in modes:
            extra = MODES[mode]
            trainer((model, data), router, root / mode, *flags, *extra, timeout_s=1800)
            lines = metrics(root / mode)
            rates[mode] = steady_rate(lines)
            samples = sum(m["samples"] for m in lines)
            reward = sum(m["reward_mean"] * m["samples"] for m in lines) / samples
            # the noise: the standard error of the rollouts' mean rewards
            noise = statistics.stdev(m["reward_mean"] for m in lines) / len(lines) ** 0.5
            waited = sum(m["rollout_seconds"] for m in lines[1:]) / (len(lines) - 1)
            trained = sum(m["train_seconds"] for m in lines[1:]) / (len(lines) - 1)
            stale = max(m["async/staleness_max"] for m in lines)
            print(f"{mode:12s} {rates[mode]:7.1f} samples/s  x{rates[mode] / rates['sync']:.2f} of sync  "
                  f"reward per trained sample {reward:.3f} +- {noise:.3f}  (a rollout: waited {waited:.2f} s for data, "
                  f"trained {trained:.2f} s; staleness at most {stale})", flush=True)


if __name__ == "__main__":
    main()
