"""The trainer's side of the supervisor's control socket (rank 0 only).

The supervisor owns the engines: it says which are ready (at the current weight version, or
waiting for it), hears which failed, learns each published version, and can ask the trainer
to save and stop between rollouts (`slurmrl stop`, preemption).

A supervisor that crashes is restarted by its watchdog (slurm.watchdog) and adopts the
trainer; the calls the trainer cannot go on without wait out that gap (up to gap_s: the spec's
fault_tolerance.supervisor_gap) instead of ending the training. A trainer of a run of the job that
SLURM requeued away (its node cut off, then back) is told so (CallerFenced) on its next call, and
ends there: it publishes, saves and logs nothing more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from contract.control_protocol import Call, CallerFenced, ControlClient, ControlError, SupervisorUnreachable
from contract.job_dir import JobDir
from contract.spec import FaultToleranceSpec

log = logging.getLogger(__name__)

_RETRY_S = 1.0  # between two asks while no supervisor answers
_STARTING_POLL_S = 0.1  # between two asks while the engines' first start is under way


class SupervisorLink:
    def __init__(self, job_dir: JobDir, call_timeout_s: float, gap_s: float, retry_s: float = _RETRY_S,
                 engine_start_s: float = FaultToleranceSpec.engine_start_timeout) -> None:
        """call_timeout_s bounds one call; gap_s, how long calls are asked again while no supervisor
        answers (a restart takes seconds; a supervisor gone this long is not coming back);
        engine_start_s, how long the first publish waits while the engines' first start is under way."""
        self.client = ControlClient(job_dir, call_timeout_s)
        self.gap_s = gap_s
        self.retry_s = retry_s
        self.engine_start_s = engine_start_s
        # url -> relaunches so far, of the engines the last ready/serving answer named (the publisher forms
        # its weight-update group again when an engine's count moved: a new process at the same url)
        self.launches: dict[str, int] = {}

    @classmethod
    def of(cls, job_dir: JobDir, ft: FaultToleranceSpec) -> SupervisorLink:
        return cls(job_dir, ft.control_call_timeout, ft.supervisor_gap, engine_start_s=ft.engine_start_timeout)

    def ready_engines(self) -> list[str]:
        """Engines that should get the next weight version. The trainer starts beside its engines:
        while the supervisor says they are starting and none is ready, it waits (engine_start_s at
        most; past that the supervisor has failed the job), so its first publish reaches them."""
        deadline = time.monotonic() + self.engine_start_s
        while True:
            answer = self._call(Call.READY_ENGINES)
            if not answer.get("starting") or time.monotonic() > deadline:
                return self._engines(answer)
            time.sleep(_STARTING_POLL_S)

    def serving_engines(self) -> list[str]:
        """The engines the supervisor serves with now, asked once (ControlError if it does not answer)."""
        return self._engines(self.client.call(Call.READY_ENGINES))

    def _engines(self, answer: dict[str, Any]) -> list[str]:
        self.launches = {url: int(count) for url, count in answer.get("launches", {}).items()}
        return list(answer["engines"])

    def engine_failed(self, url: str, reason: str) -> None:
        # Not waited for (the rollout goes on meanwhile): a restarted supervisor probes the engine itself.
        self._tell(self.client.call, Call.ENGINE_FAILED, url=url, reason=reason)

    def engine_unresponsive(self, url: str, reason: str) -> None:
        # Its requests time out or come back unparseable while its probes may pass: replaced, not probed.
        self._tell(self.client.call, Call.ENGINE_UNRESPONSIVE, url=url, reason=reason)

    def plugin_error(self, plugin: str, error: str, sample: int) -> None:
        # Its first failure on a sample (rollout.sample_errors): an event; the rollout goes on.
        self._tell(self.client.call, Call.PLUGIN_ERROR, plugin=plugin, error=error, sample=sample)

    def published(self, version: int, updated: list[str], dropped: dict[str, str]) -> None:
        # Waited for: a restarted supervisor must learn the version the engines now serve.
        self._tell(self._call, Call.PUBLISHED, version=version, updated=updated, dropped=dropped)

    def gpus_to_trainer(self, released: list[str]) -> list[str]:
        """--colocate: the trainer takes the GPUs (it released `released`). The supervisor defers
        engine restarts and probes, and answers once no engine is starting, with the engines it
        released itself (those that came up meanwhile): the trainer resumes them with the rest."""
        return list(self._call(Call.GPU_HOLDER, holder="trainer", released=released)["released"])

    def gpus_to_engines(self) -> None:
        self._call(Call.GPU_HOLDER, holder="engines", released=[])

    def stop_requested(self, rollout_id: int) -> bool:
        """Between rollouts: should the trainer save now and end? (Also the trainer's liveness.)"""
        return self.poll(rollout_id)[0]

    def poll(self, rollout_id: int) -> tuple[bool, dict[str, Any] | None]:
        """stop_requested, and a `slurmrl profile --train` request ({"dir", "steps"}) if one waits."""
        answer = self._call(Call.TRAINER_POLL, rollout_id=rollout_id)
        return bool(answer.get("stop")), answer.get("profile")

    def _call(self, name: Call, **args: object) -> dict[str, Any]:
        """The call, asked again while no supervisor answers, for up to gap_s."""
        deadline = time.monotonic() + self.gap_s
        warned = False
        while True:
            try:
                return self.client.call(name, **args)
            except SupervisorUnreachable as err:
                if time.monotonic() + self.retry_s > deadline:
                    raise
                if not warned:
                    log.warning("%s; asking %s again for up to %.0f s", err, name, self.gap_s)
                    warned = True
                time.sleep(self.retry_s)

    def _tell(self, call: Callable[..., dict[str, Any]], name: Call, **args: object) -> None:
        # A report that does not arrive must not stop training: the supervisor re-checks engines itself.
        try:
            call(name, **args)
        except CallerFenced:
            raise  # a newer run of the job owns it: this trainer ends, writing nothing more
        except ControlError as err:
            log.warning("could not tell the supervisor %s: %s", name, err)
