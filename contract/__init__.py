"""The contract layer: the job spec, the job-dir contract (paths, phases, metric keys, durable
writes) and the control protocol. Torch-free; imports nothing of slurmrl outside this folder, so
every package may import it."""
