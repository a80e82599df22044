"""Megatron hooks written against slime's signatures; each records its call in HOOK_LOG_ENV's file."""

from __future__ import annotations

import json
import os

HOOK_LOG_ENV = "SLURMRL_TEST_HOOK_LOG"


def _record(entry: dict) -> None:
    with open(os.environ[HOOK_LOG_ENV], "a") as f:
        f.write(json.dumps(entry) + "\n")


def init(args) -> None:
    _record({"hook": "init", "lr": args.lr})


def before_log_prob(args, model, store_prefix) -> None:
    _record({"hook": "log_prob", "chunks": [type(m).__name__ for m in model], "store_prefix": store_prefix})


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) -> None:
    _record({"hook": "train_step", "rollout_id": rollout_id, "step_id": step_id,
             "chunks": [type(m).__name__ for m in model], "lr": opt_param_scheduler.get_last_lr()[0],
             "optimizer_steps": callable(optimizer.step)})
