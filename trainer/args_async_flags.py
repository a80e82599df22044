"""The trainer's flags of asynchronous RL: slime's train_async.py and its flags (trainer.ahead_source,
trainer.old_actor), and miles' flags of the fully asynchronous rollout (trainer.fully_async_source),
which `--rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async`
selects. trainer.args_parser adds them after the rollout flags."""

from __future__ import annotations

import argparse

from rollout.fully_async import PAUSE_MODES
from rollout.group_ledger import DROP, RETRY


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
    # miles' fully asynchronous rollout flags (with slime's fully async --rollout-function-path)
    add("--max-weight-staleness", type=int,
        help="fully async: a group whose oldest tokens are more than N versions behind the trainer that would "
             "train it is not trained (see --async-unused-samples-handler); default: no bound")
    add("--async-data-buffer-capacity-factor", type=float, default=2.0,
        help="fully async: at most floor(F x --rollout-batch-size) groups generating and finished at once; "
             "generation waits for the trainer beyond that")
    add("--async-unused-samples-handler", choices=(DROP, RETRY), default=DROP,
        help="fully async: a group beyond --max-weight-staleness is dropped (counted), or retried from its prompt")
    add("--pause-generation-mode", choices=PAUSE_MODES, default="retract",
        help="fully async, at each weight update: abort (requests end; their groups start again from their "
             "prompts), retract (the engines keep each request and its tokens, recompute its cache and continue "
             "with the new weights) or in_place (the same, keeping the cache)")
