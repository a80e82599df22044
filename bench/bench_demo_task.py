"""The demo task's reward curve against the toy task's: `python -m trainer` with 2 CPU engines
behind the real sglang-router (batch-invariant, so each curve is reproducible), 60 rollouts each.

Four runs: the toy job's and the demo job's train_args (examples/toy_job.yaml, demo_job.yaml),
each also on the other's prompts, so the effect of the label set and of the lr show apart:

    toy  = labels 0123,       lr 1e-2 (the toy job)      demo = labels 0123456789, lr 2e-3 (the demo job)
    toy prompts at the demo's lr                          demo prompts at the toy's lr

Prints each curve and its mean per 10 rollouts.   PYTHONPATH=. python -m bench.bench_demo_task
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rollout.tiny_model import write_tiny_model
from rollout.toy_task import write_toy_data
from tests.rollout.servers import engines_behind_router
from tests.trainer.test_demo_task import DEMO_LABELS, job_flags
from tests.trainer.test_rl_loop import metrics, trainer

ROLLOUTS = 60
WINDOW = 10


def _with(flags: list[str], **values: str) -> list[str]:
    flags = list(flags)
    for key, value in values.items():
        flags[flags.index(f"--{key.replace('_', '-')}") + 1] = value
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    root = parser.parse_args().workdir or Path(tempfile.mkdtemp(prefix="bench_demo_"))
    (root / "servers").mkdir(parents=True, exist_ok=True)
    toy, demo = job_flags("toy_job.yaml"), job_flags("demo_job.yaml")
    lr = {name: flags[flags.index("--lr") + 1] for name, flags in (("toy", toy), ("demo", demo))}
    runs = {  # name: (labels, flags)
        "toy job": ("0123", toy),
        "demo job": (DEMO_LABELS, demo),
        f"toy prompts, lr {lr['demo']}": ("0123", _with(toy, lr=lr["demo"])),
        f"demo prompts, lr {lr['toy']}": (DEMO_LABELS, _with(demo, lr=lr["toy"])),
    }
    model = write_tiny_model(root / "model", seed=0)
    with engines_behind_router(model, root / "servers", deterministic=True) as (router, _):
        for i, (name, (labels, flags)) in enumerate(runs.items()):
            data = write_toy_data(root / f"data{i}.jsonl", labels=labels)
            trainer((model, data), router, root / f"job{i}", *_with(flags, num_rollout=str(ROLLOUTS)))
            rewards = [m["reward_mean"] for m in metrics(root / f"job{i}")]
            windows = [sum(rewards[k:k + WINDOW]) / WINDOW for k in range(0, ROLLOUTS, WINDOW)]
            print(f"{name}: mean per {WINDOW} rollouts " + " ".join(f"{w:.2f}" for w in windows))
            print("  per rollout " + " ".join(f"{r:.2f}" for r in rewards), flush=True)


if __name__ == "__main__":
    main()
