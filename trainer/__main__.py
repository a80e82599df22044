"""`python -m trainer [flags]`: one process per GPU (or CPU worker), as a SLURM step or alone."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import warnings
from pathlib import Path

from contract.job_dir import JobDir, write_trainer_finished
from trainer import save_now
from trainer.args import ArgsError, main_error, parse_args
from trainer.config import TrainerConfig

# Intel's conditions for run-to-run identical MKL results on CPU (exact resume compares losses bit
# for bit): no dynamic thread counts, and CNR mode, strict for gemm (no measurable cost here). Set
# before torch is imported.
REPRODUCIBLE_MKL = {"MKL_CBWR": "AUTO,STRICT", "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}
# What megatron-core and torch say at every start that asks nothing of the user: slurmrl's trainer
# runs megatron-core without TransformerEngine and Apex on purpose (their torch fallbacks), and
# torch_dist checkpoints go through APIs torch marks deprecated. One line in the log says so instead.
_EXPECTED_WARNINGS = (r"(Transformer Engine and )?Apex (is|are) not installed", r"full scope is deprecated",
                      r"`load_state_dict` is deprecated", r"Please use DTensor instead")
_CHATTY_LOGGERS = ("megatron.core.distributed.fsdp",)


def skip_unused_imports(use_wandb: bool) -> None:
    """megatron-core imports wandb at its own import only to learn whether it is installed: half a
    second of every trainer start (restarts included). Without --use-wandb, `import wandb` now
    fails at once and megatron-core goes on without it, as where it is not installed."""
    if not use_wandb:
        sys.modules.setdefault("wandb", None)  # type: ignore[arg-type]  # None: the import fails


def main(argv: list[str] | None = None) -> None:
    for name, value in REPRODUCIBLE_MKL.items():
        os.environ.setdefault(name, value)
    save_now.install()  # before anything slow: the supervisor's save-now signal must not kill a loading trainer
    # `scancel --signal=QUIT JOB.STEP`: every thread's Python stack in the trainer's log (where a hang
    # waits), and the trainer goes on
    faulthandler.register(signal.SIGQUIT, all_threads=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for message in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        config = parse_args(argv)
    except ArgsError as err:
        main_error(err)
    logging.getLogger("trainer").info("megatron-core runs without TransformerEngine and Apex (torch kernels)")
    skip_unused_imports(config.logging.use_wandb)
    from trainer import dist_env
    from trainer.setup import build

    dist_env.setup(master_port=config.run.master_port)
    from trainer.fatal import FATAL_ERRORS, exit_fatal

    rank = int(os.environ["RANK"])
    try:
        if config.run.debug_rollout_only:
            rollout_only(config)
            _finished(config, rank)
            return
        try:
            loop, initial, load_reference = build(config)
        except ArgsError as err:
            main_error(err)
        loop.start(initial, load_reference)
        loop.run()
    except FATAL_ERRORS as err:  # a restart would repeat it: the supervisor fails the job with this reason
        exit_fatal(err, config.run.job_dir, rank)
    dist_env.shutdown()
    _finished(config, rank)


def _finished(config: TrainerConfig, rank: int) -> None:
    """Rank 0 records that the trainer ran to its end, for a supervisor that did not see its exit."""
    if config.run.supervised and rank == 0:
        write_trainer_finished(JobDir(Path(config.run.job_dir)))


def rollout_only(config: TrainerConfig) -> None:
    from trainer.loop_builder import build_rollout_only

    run = build_rollout_only(config)
    if run is None:
        logging.getLogger("trainer").info("--debug-rollout-only: rank 0 generates the rollouts; "
                                          "this rank has nothing to do")
    else:
        run.run()


if __name__ == "__main__":
    main(sys.argv[1:])
