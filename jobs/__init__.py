"""Job specs, sbatch rendering and submission; also home of the `slurmrl` command line."""
