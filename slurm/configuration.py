"""Whether SLURM's programs here have a configuration, asked before a submission: without one,
sbatch prints DNS SRV lookup errors that do not say what is missing.

SLURM's programs find slurm.conf at $SLURM_CONF, else at their build's default (/etc/slurm for
Debian's and SchedMD's packages), else at the copy a configless slurmd keeps in /run/slurm/conf,
else through the cluster's DNS SRV record (configless). Only where no file is found is SLURM asked
once, so that a configless cluster is not refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from slurm import env as slurm_env
from slurm.client import SlurmClient

DEFAULT_CONF_FILES = (Path("/etc/slurm/slurm.conf"), Path("/run/slurm/conf/slurm.conf"))
CONF_CHECK_TIMEOUT_S = 10.0  # the one sinfo call asked where no slurm.conf is found (a DNS SRV lookup)
# What SLURM's programs print when they found no configuration at all.
_NO_CONFIG_SOURCE = "Could not establish a configuration source"
_FIX = ("for the devcluster run `slurmrl cluster up`, then the `export SLURM_CONF=...` line `slurmrl cluster "
        "status` prints; for another cluster export SLURM_CONF=/path/to/its/slurm.conf")


def configuration_problem(client: SlurmClient | None = None) -> str | None:
    """Why SLURM's programs have no configuration here, as one line naming the fix; None when they
    have one (or when SLURM says something else: the program's own error then speaks)."""
    conf = os.environ.get(slurm_env.CONF)
    if conf:
        if Path(conf).is_file():
            return None
        return f"{slurm_env.CONF}={conf} names no file; {_FIX}"
    if any(path.is_file() for path in DEFAULT_CONF_FILES):
        return None
    reply = (client or SlurmClient()).call("sinfo", "-h", "-o", "%P", timeout_s=CONF_CHECK_TIMEOUT_S)
    if reply.ok or _NO_CONFIG_SOURCE not in reply.stderr:
        return None  # configless through DNS SRV, or no SLURM client at all (sbatch's absence is said later)
    looked = " or ".join(str(path) for path in DEFAULT_CONF_FILES)
    return (f"no SLURM configuration: {slurm_env.CONF} is unset and there is no slurm.conf at {looked} (nor a "
            f"DNS SRV record of a configless cluster); {_FIX}")
