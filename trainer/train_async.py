"""`python -m trainer.train_async [flags]`: slime's train_async.py, the trainer with --train-async
(rollout N+1 is generated while rollout N trains; trainer.ahead_source)."""

from __future__ import annotations

import sys

from trainer.__main__ import main

if __name__ == "__main__":
    main(["--train-async", *sys.argv[1:]])
