"""The SLURM environment variables slurmrl reads: one table, and one reader per fact.

SLURM sets these in a job's batch step and in every task of its steps (`man sbatch`, `man srun`,
"OUTPUT ENVIRONMENT VARIABLES"); a step launched by the supervisor inherits the batch step's. Read
them through this module only, so that each has one name, one default and one parser.
(contract/control_protocol.py, below this layer, reads SLURM_JOB_ID and SLURM_RESTART_COUNT for a
caller's run itself: the contract imports nothing of slurmrl; its names are JOB_ID and RESTART_COUNT here.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# The table: each name with what it holds.
JOB_ID = "SLURM_JOB_ID"  # the job's id (a hetjob's leader id in the batch step); sbatch, srun
JOB_ID_OLD = "SLURM_JOBID"  # the same, its pre-17.11 name, still set
RESTART_COUNT = "SLURM_RESTART_COUNT"  # times SLURM requeued the job: its run; unset before the first requeue
JOB_NODELIST = "SLURM_JOB_NODELIST"  # the job's nodes (node[1-3],x); a hetjob's: group 0's
JOB_NODELIST_HET_GROUP = "SLURM_JOB_NODELIST_HET_GROUP_{}"  # a hetjob's group K's nodes
SUBMIT_DIR = "SLURM_SUBMIT_DIR"  # where sbatch ran: the steps' working directory
STEP_NODELIST = "SLURM_STEP_NODELIST"  # a step's nodes, in a task of it
PROCID = "SLURM_PROCID"  # a task's rank within its step
NTASKS = "SLURM_NTASKS"  # the step's task count
LOCALID = "SLURM_LOCALID"  # a task's rank on its node
NODE_NAME = "SLURMD_NODENAME"  # the node a task runs on (slurmd sets it)
CONF = "SLURM_CONF"  # slurm.conf of the cluster the SLURM programs talk to (the devcluster's)


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The SLURM job this process runs in; None outside SLURM."""
    env = os.environ if env is None else env
    return env.get(JOB_ID) or env.get(JOB_ID_OLD) or None


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """The job's run: how many times SLURM requeued it (0 before the first requeue)."""
    env = os.environ if env is None else env
    return int(env.get(RESTART_COUNT) or "0")


def job_nodelist(group: int, env: Mapping[str, str] | None = None) -> str:
    """The node list of the job's het group `group` (the job's own for a job that is not heterogeneous)."""
    env = os.environ if env is None else env
    return env.get(JOB_NODELIST_HET_GROUP.format(group)) or env[JOB_NODELIST]


def submit_dir(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    return env.get(SUBMIT_DIR)

