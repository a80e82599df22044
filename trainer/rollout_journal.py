"""Rollouts done since the last checkpoint, kept until the next one: a trainer restarted from that
checkpoint (a crash, a kill, a node lost under it) trains on them again instead of generating
them again. What it redoes after a failure is then the training steps, not the rollouts (which
take most of an RL step's time).

Exact resume holds: an entry is replayed only by a trainer that continues the very run that
generated it, i.e. one resumed from the same checkpoint (each save has its own lineage id, kept
in the checkpoint) with the same flags (a fingerprint of every flag that is not a placement:
ports, addresses, the key), at the same rollout. Such a trainer holds the weights that generated
the entry (training is reproducible: exact resume compares losses bit for bit), so the entry is
the rollout an uninterrupted run trains on; the data buffer is set to what it was after that
rollout. (Where training is not bitwise reproducible, e.g. GPU kernels that are not
deterministic, the replayed rollout is still the one the uninterrupted run trained on, where a
generated-again one would come from slightly other weights.) Anything else, an entry of another
lineage or other flags, is generated again.

    JOB_DIR/rollout_journal/rollout_<id>.pt   {"rollout_id", "lineage", "fingerprint",
                                               "groups": [[Sample.to_dict()]], "buffer"}

Entries are written atomically (temporary file, then rename) and all removed at each save. The
lineage travels in the checkpoint through `state_dict` / `load_state_dict` (trainer.checkpointer).
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rollout.sample import Sample

log = logging.getLogger(__name__)

LINEAGE_KEY = "journal_lineage"  # in a checkpoint's common state: the id of that save
INITIAL = "initial"  # the lineage of a trainer that started from the initial weights (no checkpoint)
# Flags that say where things run, not what is computed: a requeued or restarted trainer may get others.
PLACEMENT_FLAGS = frozenset({"master_port", "sglang_router_ip", "sglang_router_port", "api_key", "engine_urls"})


def fingerprint(flags: Mapping[str, Any]) -> str:
    """A digest of every flag (name -> value) but the placement ones (a flag added later joins it by itself)."""
    items = sorted((k, repr(v)) for k, v in flags.items() if k not in PLACEMENT_FLAGS)
    return hashlib.sha256(repr(items).encode()).hexdigest()


def new_lineage() -> str:
    return uuid.uuid4().hex


class RolloutJournal:
    def __init__(self, folder: Path, flags_fingerprint: str) -> None:
        """flags_fingerprint: `fingerprint` of the trainer's flags."""
        self.folder = folder
        self.fingerprint = flags_fingerprint
        self.lineage: str | None = INITIAL  # None: resumed from a checkpoint without one (nothing replays)

    def _path(self, rollout_id: int) -> Path:
        return self.folder / f"rollout_{rollout_id}.pt"

    def record(self, rollout_id: int, groups: list[list[Sample]], buffer_state: dict[str, Any] | None) -> None:
        if self.lineage is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(rollout_id)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save({"rollout_id": rollout_id, "lineage": self.lineage, "fingerprint": self.fingerprint,
                    "groups": [[s.to_dict() for s in group] for group in groups], "buffer": buffer_state}, tmp)
        os.replace(tmp, path)

    def replay(self, rollout_id: int) -> tuple[list[list[Sample]], dict[str, Any] | None] | None:
        """(groups, the data buffer's state after them) of this run's rollout `rollout_id`, if the
        journal holds it; None otherwise (also for an entry of another run, or unreadable)."""
        path = self._path(rollout_id)
        if self.lineage is None or not path.is_file():
            return None
        try:
            entry = torch.load(path, weights_only=False)
        except Exception as err:  # noqa: BLE001 - a torn or foreign file: generate the rollout again
            log.warning("rollout journal %s is unreadable (%s): generating rollout %d again", path, err, rollout_id)
            return None
        if (entry.get("rollout_id"), entry.get("lineage"), entry.get("fingerprint")) != (
                rollout_id, self.lineage, self.fingerprint):
            return None
        return [[Sample.from_dict(s) for s in group] for group in entry["groups"]], entry["buffer"]

    def resumed(self, lineage: str | None) -> None:
        """Resumed from a checkpoint of this lineage (None: a checkpoint from before the journal)."""
        self.lineage = lineage

    def saved(self, lineage: str) -> None:
        """A checkpoint of this lineage now holds every rollout done: the entries are no longer needed."""
        self.lineage = lineage
        for pattern in ("rollout_*.pt", ".rollout_*.tmp-*"):  # and what a killed trainer left half-written
            for path in self.folder.glob(pattern) if self.folder.is_dir() else ():
                path.unlink(missing_ok=True)

    # ---- as a part of the checkpoint (trainer.checkpointer)
    def state_dict(self) -> dict[str, Any]:
        """The new checkpoint's lineage: each save has its own."""
        return {LINEAGE_KEY: new_lineage()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resumed(state.get(LINEAGE_KEY))

    def checkpointed(self, state: dict[str, Any]) -> None:
        """The checkpoint holding `state` (this journal's state_dict among it) is written."""
        self.saved(state[LINEAGE_KEY])
