"""The toy RL task the demo and the tests train on: "repeat D" -> the answer starts with D.

A tiny random model gets it right about 1 time in 30 at first; GRPO teaches it within a few
dozen rollouts on a laptop CPU, so a rising reward shows the whole loop (rollout, training,
weight publishing) works. Rewarded by rollout.rewards.toy_reward (--rm-type toy).
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def write_toy_data(path: str | Path, num_prompts: int = 64, labels: str = "0123", seed: int = 0) -> Path:
    """A jsonl file of {"input": "repeat D\\n", "label": "D"} rows (use --label-key label)."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"input": f"repeat {d}\n", "label": d} for d in (rng.choice(labels) for _ in range(num_prompts))]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
