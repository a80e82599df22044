"""A real SLURM cluster on loopback (slurmctld, slurmdbd with MariaDB, munge, N emulated slurmd)."""

from slurm.devcluster.cluster import DevCluster
from slurm.devcluster.config import ClusterShape

__all__ = ["ClusterShape", "DevCluster"]
