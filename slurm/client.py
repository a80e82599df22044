"""The one client of SLURM's programs: every sbatch-less call slurmrl makes to srun, scancel,
scontrol, squeue, sacct and sinfo goes through SlurmClient (tests/slurm/test_one_client.py checks
it). It owns their argv, a named bound on each call, the record of whether SLURM answered of late
(slurm/contact.py: a call that fails or times out is an outage, not an answer), and the pace and
count of step launches (slurm/pacing.py). (sbatch is run by Submitit for `slurmrl submit`.)

A call never raises for SLURM's silence: `call` answers a Reply whose `answered` is False (it timed
out, the program is missing, or slurmctld did not answer); `require` turns that, and a refusal,
into SlurmUnavailable for callers that cannot go on without the answer.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from slurm.contact import PROCESS_CONTACT, SlurmContact, slurm_answered
from slurm.pacing import LaunchPacer, StepBudget

PROGRAMS = ("sbatch", "srun", "scancel", "scontrol", "squeue", "sacct", "sinfo")
# One call to scontrol, squeue, scancel, sacct or sinfo that asks slurmctld or slurmdbd (the job
# spec's fault_tolerance.slurm_command_timeout overrides it for the supervisor's client).
COMMAND_TIMEOUT_S = 30.0
# `scontrol show hostnames`: expands a node list on this machine, without asking slurmctld.
HOSTNAMES_TIMEOUT_S = 10.0


class SlurmUnavailable(RuntimeError):
    """SLURM did not answer (no client, no controller, no SLURM_CONF), or refused: unknown, not gone."""


@dataclass(frozen=True)
class Reply:
    """What one SLURM program said; returncode None when it did not run to an end (timed out, or
    not installed: `why` says which)."""

    program: str
    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    why: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def timed_out(self) -> bool:
        return self.returncode is None and self.why.startswith("timed out")

    @property
    def answered(self) -> bool:
        """Whether slurmctld answered (whatever it said: "Invalid job id" is an answer)."""
        return self.returncode is not None and slurm_answered(self.returncode, self.stderr)


class SlurmClient:
    """Runs SLURM's programs. `env` is added to the programs' environment (the
    devcluster's SLURM_CONF); `timeout_s` bounds each query (COMMAND_TIMEOUT_S by default)."""

    def __init__(self, timeout_s: float = COMMAND_TIMEOUT_S, env: Mapping[str, str] | None = None,
                 pacer: LaunchPacer | None = None, contact: SlurmContact | None = None) -> None:
        self.timeout_s = timeout_s
        self.env = dict(env) if env else None
        # Whether SLURM answered of late, from every call: the process's record unless given one,
        # so that the supervisor's parts (steps, nodes, requeue) share what each of them heard.
        self.contact = PROCESS_CONTACT if contact is None else contact
        self.pacer = pacer or LaunchPacer()
        self.steps = StepBudget(self.max_step_count)  # the job's steps against MaxStepCount

    def call(self, program: str, *args: str, timeout_s: float | None = None) -> Reply:
        """Run `program args...` within timeout_s (the client's by default) and record whether SLURM answered."""
        if program not in PROGRAMS or program == "srun":
            raise ValueError(f"{program!r}: not a SLURM query program (srun: use launch)")
        bound = self.timeout_s if timeout_s is None else timeout_s
        try:
            done = subprocess.run([program, *args], capture_output=True, text=True, timeout=bound,
                                  stdin=subprocess.DEVNULL, env=self._environment(), check=False)
        except subprocess.TimeoutExpired:
            reply = Reply(program, None, why=f"timed out: {program} did not answer within {bound:.0f} s")
        except FileNotFoundError:
            reply = Reply(program, None, why=f"there is no {program} here (no SLURM client)")
        except OSError as err:
            reply = Reply(program, None, why=f"{program} could not run: {err}")
        else:
            reply = Reply(program, done.returncode, done.stdout, done.stderr)
        self.contact.record(reply.answered)
        return reply

    def require(self, program: str, *args: str, unknown_job_ok: bool = False, timeout_s: float | None = None) -> str:
        """The program's output; SlurmUnavailable when it did not answer or refused ("" for an
        unknown job id where unknown_job_ok: a job SLURM has forgotten)."""
        reply = self.call(program, *args, timeout_s=timeout_s)
        if reply.returncode is None:
            raise SlurmUnavailable(reply.why[len("timed out: "):] if reply.timed_out else reply.why)
        if reply.returncode != 0:
            if unknown_job_ok and "invalid job id" in reply.stderr.lower():
                return ""
            said = (reply.stderr.strip().splitlines() or ["no message"])[-1]
            raise SlurmUnavailable(f"{said} (is SLURM_CONF set?)")
        return reply.stdout

    def launch(self, argv: Sequence[str], output: IO[bytes], env: Mapping[str, str] | None = None,
               piped: bool = False) -> subprocess.Popen[bytes]:
        """Start `srun ...` (argv from slurm.step_spec.srun_argv) as a child in its own process group,
        its output to `output` (piped: its stdin and stdout are pipes to the step, its stderr goes to
        `output`): paced (LaunchPacer) and counted against MaxStepCount (StepLimitReached)."""
        if not argv or argv[0] != "srun":
            raise ValueError(f"not an srun command line: {list(argv)[:3]}")
        self.steps.take()
        self.pacer.acquire()
        if piped:
            return subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=output,
                                    env=self._environment(env), process_group=0)
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                env=self._environment(env), process_group=0)

    def hostnames(self, nodelist: str) -> list[str]:
        """The node names of a SLURM node list (node[1-3],x); SlurmUnavailable if scontrol fails."""
        if not any(c in nodelist for c in "[,"):
            return [nodelist]
        return self.require("scontrol", "show", "hostnames", nodelist, timeout_s=HOSTNAMES_TIMEOUT_S).split()

    def max_step_count(self) -> int | None:
        """SLURM's MaxStepCount (`scontrol show config`); None when scontrol does not say."""
        reply = self.call("scontrol", "show", "config")
        for line in reply.stdout.splitlines() if reply.ok else ():
            key, _, value = line.partition("=")
            if key.strip() == "MaxStepCount" and value.strip().isdigit():
                return int(value.strip())
        return None

    def _environment(self, env: Mapping[str, str] | None = None) -> dict[str, str] | None:
        if env is None and self.env is None:
            return None
        return {**(os.environ if env is None else env), **(self.env or {})}
