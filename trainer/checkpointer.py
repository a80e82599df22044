"""The checkpoint manager: one place that saves and restores every stateful part of the trainer.

A checkpoint folder (trainer.checkpoint owns the folders) holds what the backend writes: model,
optimizer, LR schedule and every rank's RNG state, plus the trainer state in common.pt. The
trainer state is the union of each part's `state_dict()` (the loop's progress, the eval owed,
the rollout source's data buffer with its partial-rollout groups, the rollout journal's lineage),
each part owning its own keys; on resume each part reads them back with `load_state_dict()`.
Rank 0's trainer state is the one written (the data and the journal live on rank 0).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from contract.control_protocol import CallerFenced, superseded
from contract.job_dir import JobDir, Phase
from trainer import checkpoint
from trainer.backend import Backend
from trainer.rollout_source import Heartbeat
from trainer.save_space import tensor_bytes
from trainer.weight_folders import write_hf_folder

log = logging.getLogger(__name__)

ROLLOUT_ID_KEY = "rollout_id"  # the rollout a checkpoint was saved after (its iteration)
HF_SHARD_BYTES = 5 * 2**30  # --save-hf's shards: Hugging Face's default max_shard_size


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CheckpointConfig:
    save_dir: Path | None  # --save: None, no checkpoints
    load_dir: Path | None  # --load
    load_step: int | None  # --ckpt-step: exactly that checkpoint
    save_interval: int | None  # a checkpoint after every save_interval-th rollout (and after the last)
    keep: int | None  # checkpoints kept (the newest)
    num_rollout: int
    job_dir: Path | None  # a newer run of the job there fences this trainer's saves
    save_hf: str | None = None  # --save-hf: also an HF folder at save_hf.format(rollout_id=...) with each save
    model_files: Path | None = None  # the config and tokenizer an HF folder gets


class Checkpointer:
    def __init__(self, backend: Backend, config: CheckpointConfig, parts: Sequence[Stateful],
                 after_save: Sequence[Callable[[dict[str, Any]], None]], heartbeat: Heartbeat) -> None:
        """parts: every stateful part on this rank; after_save: told the trainer state once its
        checkpoint is the latest (the rollout journal drops what it holds)."""
        self.backend = backend
        self.config = config
        self.parts = list(parts)
        self.after_save = list(after_save)
        self.heartbeat = heartbeat
        self.last_saved: int | None = None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for part in self.parts:
            own = part.state_dict()
            clash = state.keys() & own.keys()
            assert not clash, f"two parts of the trainer state write {sorted(clash)}"
            state.update(own)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            part.load_state_dict(state)
        self.last_saved = state[ROLLOUT_ID_KEY]

    def due(self, rollout_id: int) -> bool:
        cfg = self.config
        last = rollout_id == cfg.num_rollout - 1
        on_interval = bool(cfg.save_interval and (rollout_id + 1) % cfg.save_interval == 0)
        return cfg.save_dir is not None and (last or on_interval)

    def resume(self) -> Path | None:
        """Restore the backend and every part from --load's checkpoint, if it holds one."""
        cfg = self.config
        found = checkpoint.find_loadable(cfg.load_dir, cfg.load_step) if cfg.load_dir else None
        if found is not None:
            self.load_state_dict(self.backend.load(found, weights_only=False))
        return found

    def save(self, rollout_id: int) -> float:
        """Checkpoint after rollout_id (collective); returns the seconds it took."""
        began = time.monotonic()
        cfg = self.config
        assert cfg.save_dir is not None
        # A trainer of a run SLURM requeued away (its node cut off, then back, SIGTERM saving it)
        # must not write over the newer run's checkpoints.
        if self.backend.broadcast_object(cfg.job_dir is not None and superseded(JobDir(cfg.job_dir))):
            raise CallerFenced(f"not saving rollout {rollout_id}: a newer run of the job owns {cfg.job_dir}")
        self.heartbeat(Phase.SAVE, rollout_id)
        state = self.backend.broadcast_object(self.state_dict())
        assert state[ROLLOUT_ID_KEY] == rollout_id, (state[ROLLOUT_ID_KEY], rollout_id)
        # Each step of the save beats again: the supervisor's trainer_save_timeout bounds a save without progress.
        checkpoint.save(cfg.save_dir, rollout_id, lambda folder: self.backend.save(folder, state),
                        keep=cfg.keep, needs_bytes=tensor_bytes(self.backend),
                        progress=lambda: self.heartbeat(Phase.SAVE, rollout_id))
        self.last_saved = rollout_id
        for tell in self.after_save:
            tell(state)
        if cfg.save_hf:
            self._save_hf(cfg.save_hf.format(rollout_id=rollout_id))
        return time.monotonic() - began

    def _save_hf(self, folder: str) -> None:
        """slime's --save-hf: the actor's weights as an HF checkpoint (collective; rank 0 writes)."""
        assert self.config.model_files is not None
        tensors = [(name, tensor.detach().cpu()) for name, tensor in self.backend.hf_weights()]  # rank 0's
        if self.backend.rank == 0:
            write_hf_folder(Path(folder), tensors, self.config.model_files, HF_SHARD_BYTES)
            log.info("saved the weights as an HF checkpoint in %s", folder)

    def unsaved(self, rollout_id: int) -> bool:
        """Whether stopping after rollout_id (-1: none done) leaves work no checkpoint holds."""
        return self.config.save_dir is not None and rollout_id >= 0 and self.last_saved != rollout_id
