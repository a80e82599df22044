"""The trainer's flags of asynchronous RL: slime's train_async.py and its flags (trainer.ahead_source,
trainer.old_actor). trainer.args_parser adds them after the rollout flags."""

from __future__ import annotations

import argparse


def add_async_flags(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--train-async", action="store_true",
        help="slime's train_async.py (`slurmrl submit train_async.py ...`, `python -m trainer.train_async`): "
             "rollout N+1 is generated while rollout N trains, one step off-policy; not with --colocate")
    add("--update-weights-interval", type=int, default=1,
        help="with --train-async: publish the trained weights to the engines after every N-th rollout (slime's; "
             "train.py publishes after every rollout)")
    add("--keep-old-actor", action="store_true",
        help="the PPO ratio's old log-probs are taken with the weights that generated each sample (kept in host "
             "memory per published version), not the current actor's")
