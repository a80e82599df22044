"""`python -m trainer [flags]`: one process per GPU (or CPU worker), as a SLURM step or alone."""

from __future__ import annotations

import logging
import os
import sys

from trainer import save_now
from trainer.args import ArgsError, main_error, parse_args


# Intel's conditions for run-to-run identical MKL results on CPU (exact resume compares losses bit
# for bit): no dynamic thread counts, and CNR mode, strict for gemm (no measurable cost here). Set
# before torch is imported.
REPRODUCIBLE_MKL = {"MKL_CBWR": "AUTO,STRICT", "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}


def main(argv: list[str] | None = None) -> None:
    for name, value in REPRODUCIBLE_MKL.items():
        os.environ.setdefault(name, value)
    save_now.install()  # before anything slow: the supervisor's save-now signal must not kill a loading trainer
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args = parse_args(argv)
    except ArgsError as err:
        main_error(err)
    from trainer import dist_env
    from trainer.setup import build

    dist_env.setup(master_port=args.master_port)
    if args.debug_rollout_only:
        from trainer import rollout_only

        rollout_only.run(args)
        return
    try:
        loop, initial, load_reference = build(args)
    except ArgsError as err:
        main_error(err)
    loop.start(initial, load_reference)
    loop.run()
    dist_env.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
