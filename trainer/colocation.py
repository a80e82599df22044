"""The order of phases when the trainer and the engines share GPUs (--colocate; slime's train.py),
so that the two never hold their peaks at once:

    generate (engines hold the GPUs; with --offload-train the trainer's state is on the host)
    to_trainer():     engines release weights and KV cache -> the supervisor is told (it defers
                      engine restarts and probes meanwhile) -> the trainer onloads
    log-probs, training (and a save that falls due)
    before_publish(): the trainer moves grads and optimizer state to the host -> engines resume
                      their weights
    publish           both hold weights only
    to_engines():     the trainer moves its weights to the host -> engines resume the KV cache ->
                      the supervisor is told, and may start deferred engine restarts

Every method is collective: each rank moves its own state; rank 0 alone calls the engines and the
supervisor, and the ranks meet (a broadcast) between the two halves of a switch. An engine whose
release or resume fails is dropped, as a failed weight update is: the supervisor replaces it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rollout.engine_client import EngineClient, EngineError
from trainer.backend import Backend
from trainer.offload import TrainerOffload
from trainer.supervisor_link import SupervisorLink

log = logging.getLogger(__name__)

ALL_TAGS = ["weights", "kv_cache"]  # what slurmrl releases (SGLang's cuda_graph goes with them on GPUs)


class EngineSide:
    """Rank 0's half: the engines' memory and the supervisor's word on who holds the GPUs."""

    def __init__(self, client: EngineClient, engines: Callable[[], list[str]],
                 drop: Callable[[str, str], None], supervisor: SupervisorLink | None) -> None:
        self.client = client
        self.engines = engines
        self.drop = drop
        self.supervisor = supervisor
        self.released: dict[str, set[str]] = {}  # url -> the tags this trainer released there

    def release_all(self) -> None:
        for url in self.engines():
            if url not in self.released:
                self._each(url, self.client.release_memory, ALL_TAGS)
        if self.supervisor:  # engines that came up meanwhile: released by the supervisor, resumed by us
            for url in self.supervisor.gpus_to_trainer(sorted(self.released)):
                self.released[url] = set(ALL_TAGS)

    def resume(self, tags: list[str]) -> None:
        for url, held in list(self.released.items()):
            todo = [t for t in tags if t in held]
            if todo and self._each(url, self.client.resume_memory, todo, resume=True):
                held.difference_update(todo)
            if not held:
                del self.released[url]

    def engines_hold(self) -> None:
        if self.supervisor:
            self.supervisor.gpus_to_engines()

    def _each(self, url: str, call: Callable[[str, list[str]], None], tags: list[str], resume: bool = False) -> bool:
        try:
            call(url, tags)
        except EngineError as err:
            self.released.pop(url, None)
            self.drop(url, f"{'resume' if resume else 'release'} of {', '.join(tags)} failed: {err}")
            return False
        if not resume:
            self.released[url] = set(tags)
        log.info("engine %s: %s %s", url, "resumed" if resume else "released", ", ".join(tags))
        return True


class Colocation:
    def __init__(self, backend: Backend, offload_train: bool, engines: EngineSide | None) -> None:
        """engines: rank 0's EngineSide with --offload-rollout, else None."""
        self.backend = backend
        self.offload = TrainerOffload(backend.offloadable()) if offload_train else None
        self.engines = engines

    def to_trainer(self) -> None:
        if self.engines:
            self.engines.release_all()
        self._meet()
        if self.offload:
            self.offload.onload()

    def before_publish(self) -> None:
        if self.offload:
            self.offload.offload(keep_weights=True)
        self._meet()
        if self.engines:
            self.engines.resume(["weights"])

    def to_engines(self) -> None:
        if self.offload:
            self.offload.offload()
        self._meet()
        if self.engines:
            self.engines.resume(ALL_TAGS)
            self.engines.engines_hold()

    def _meet(self) -> None:
        self.backend.broadcast_object(None)  # no rank goes on before rank 0's engine calls are done
