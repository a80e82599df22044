"""The head-node supervisor: launches, watches, fences and restarts the job's SLURM steps."""
