"""SLURM: the one client of its programs (client.py, with the outage record contact.py, the launch
pace and step count pacing.py, srun's command line step_spec.py), the table of its environment
variables (env.py), the batch step's watchdog, sbatch templates and the loopback development cluster."""
