"""SLURM-side assets: sbatch templates and the loopback development cluster."""
