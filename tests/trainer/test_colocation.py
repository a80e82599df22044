"""--offload-train / --offload-rollout (trainer.colocation) with `python -m trainer` (megatron
backend, gloo) and 2 CPU engines behind the real router: the engines release their memory before
every training phase and take it back (weights before the publish, the KV cache after it), the
trainer's state goes to the host and back (a no-op in memory on CPU, the same code path), and the
run's samples, losses and weights equal those of a run without offload."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.trainer.test_rl_loop import SAME_STEP, cluster, files, metrics, trainer  # noqa: F401 (fixtures)

ROLLOUTS = 3


def _memory_events(log: str) -> list[tuple[str, str, str]]:
    return re.findall(r"cpu_engine memory (released|resumed) tags=(\S+) weight_version=(\S+)", log)


def test_offload_orders_the_phases_and_changes_no_result(files, cluster, tmp_path: Path) -> None:  # noqa: F811
    router, engines = cluster
    common = ["--num-rollout", str(ROLLOUTS), "--rollout-batch-size", "8", "--lr", "1e-2", "--adam-eps", "1",
              "--seed", "7"]
    trainer(files, router, tmp_path / "plain", *common)
    before = [len(_memory_events(e.log.read_text())) for e in engines]
    job = tmp_path / "colocated"
    trainer(files, router, job, *common, "--save", str(job / "ckpt"), "--save-interval", "2",
            "--offload-train", "--offload-rollout")
    for engine, skip in zip(engines, before):
        events = _memory_events(engine.log.read_text())[skip:]
        # per rollout: release all (training) -> resume weights (publish of v+1) -> resume KV
        expected = []
        for rollout_id in range(ROLLOUTS):
            expected += [("released", "weights,kv_cache", str(rollout_id)), ("resumed", "weights", str(rollout_id)),
                         ("resumed", "kv_cache", str(rollout_id + 1))]
        assert events == expected, events
    plain, colocated = metrics(tmp_path / "plain"), metrics(job)
    assert [m["rollout_id"] for m in colocated] == list(range(ROLLOUTS))
    for a, b in zip(plain, colocated):
        assert (a["reward_mean"], a["weight_version"]) == (b["reward_mean"], b["weight_version"])
        for key in ("loss", "pg_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], **SAME_STEP), key
    # saved while the trainer held the GPUs, before the publish: rollouts 1 and 2 (the last)
    assert sorted(p.name for p in (job / "ckpt").glob("iter_*")) == ["iter_0000001", "iter_0000002"]
