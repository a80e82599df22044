"""The job-dir contract: what the trainer, the supervisor, the engines and the CLI share through a
job's directory and environment, in one place. Torch-free; imports nothing of slurmrl.

    JOB_DIR/spec.yaml                 the job spec (contract/spec.py), final as submitted
    JOB_DIR/model_files/              --hf-checkpoint's config and tokenizer, kept at submission (MODEL_FILES)
    JOB_DIR/slurm_job_id              SLURM's id of the job
    JOB_DIR/submitit/                 Submitit's pickles and the batch step's logs
    JOB_DIR/api_key                   the per-job key (0600), reaching steps as $SLURMRL_API_KEY
    JOB_DIR/control.sock              the supervisor's control socket (contract/control_protocol.py)
    JOB_DIR/supervisor_state.json     the supervisor's state store (what `slurmrl status` reads)
    JOB_DIR/events.jsonl              the supervisor's events, one JSON line each
    JOB_DIR/trainer_heartbeat.json    the trainer's phase and when it last moved (Heartbeat)
    JOB_DIR/trainer_fatal.json        why the trainer ended in a way no restart can fix (e.g. a full disk)
    JOB_DIR/metrics.jsonl             the trainer's metrics, one line per rollout (Metric keys)
    JOB_DIR/weights/VERSION/          weights published to disk, one HF folder per version
    JOB_DIR/checkpoints/              the trainer's --save default
    JOB_DIR/hf_torch_dist/            --hf-checkpoint converted once to torch_dist (without --ref-load)
    JOB_DIR/rollout_journal/          rollouts generated since the last save, replayed after a restart
    JOB_DIR/logs/STEP.log             each step's output
    JOB_DIR/tensorboard/              the trainer's scalars; supervisor/ below it, the supervisor's
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

API_KEY_ENV = "SLURMRL_API_KEY"  # the job's key, as every step sees it (never on a command line)
JOB_DIR_ENV = "SLURMRL_JOB_DIR"  # the job dir, as every step sees it


@dataclass(frozen=True)
class JobDir:
    """Every path in a job's directory."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    spec = property(lambda self: self.root / "spec.yaml")
    model_files = property(lambda self: self.root / "model_files")
    slurm_job_id = property(lambda self: self.root / "slurm_job_id")
    submitit = property(lambda self: self.root / "submitit")
    api_key = property(lambda self: self.root / "api_key")
    control_socket = property(lambda self: self.root / "control.sock")
    state = property(lambda self: self.root / "supervisor_state.json")
    events = property(lambda self: self.root / "events.jsonl")
    heartbeat = property(lambda self: self.root / "trainer_heartbeat.json")
    trainer_fatal = property(lambda self: self.root / "trainer_fatal.json")
    trainer_finished = property(lambda self: self.root / "trainer_finished.json")
    metrics = property(lambda self: self.root / "metrics.jsonl")
    weights = property(lambda self: self.root / "weights")
    checkpoints = property(lambda self: self.root / "checkpoints")
    hf_torch_dist = property(lambda self: self.root / "hf_torch_dist")
    rollout_journal = property(lambda self: self.root / "rollout_journal")
    logs = property(lambda self: self.root / "logs")
    tensorboard = property(lambda self: self.root / "tensorboard")
    profiles = property(lambda self: self.root / "profiles")  # slurmrl profile's traces
    supervisor_tensorboard = property(lambda self: self.root / "tensorboard" / "supervisor")
    wandb_run = property(lambda self: self.root / "wandb_run.json")  # --use-wandb: the run a resume continues

    def log(self, step: str) -> Path:
        return self.logs / f"{step}.log"

    def weights_of(self, version: int) -> Path:
        """The HF folder of a published weight version."""
        return self.weights / str(version)


# ------------------------------------------------------------------ the model's files
# What is read from an HF model folder besides its weights: the config, the generation config and
# the tokenizer. Published weight folders carry them next to the weights.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
               "chat_template.jinja")


def keep_model_files(hf_checkpoint: Path, job_dir: JobDir) -> list[str]:
    """Copy the MODEL_FILES that `hf_checkpoint` has into JOB_DIR/model_files/ (at submission), so a
    model folder deleted or moved while the job runs breaks no trainer restart and no published
    weight folder. An older copy is replaced whole. Returns the names copied."""
    tmp = Path(tempfile.mkdtemp(prefix=".model_files.", dir=job_dir.root))
    try:
        copied = [name for name in MODEL_FILES if (Path(hf_checkpoint) / name).is_file()]
        for name in copied:
            shutil.copy2(Path(hf_checkpoint) / name, tmp / name)
        if job_dir.model_files.exists():
            shutil.rmtree(job_dir.model_files)
        os.rename(tmp, job_dir.model_files)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return copied


def model_files_dir(job_dir: JobDir, hf_checkpoint: str) -> str:
    """Where config.json and the tokenizer are read from: the job dir's copy when submission kept
    one, else the model folder itself."""
    kept = job_dir.model_files
    return str(kept) if (kept / "config.json").is_file() else hf_checkpoint


# ------------------------------------------------------------------ the trainer's heartbeat
class Phase(str, Enum):
    """What the trainer is doing; each has its own heartbeat timeout (FaultToleranceSpec)."""

    START = "start"  # from launch to the first beat (loading, resuming)
    ROLLOUT = "rollout"
    TRAIN = "train"  # beats once per optimizer step
    PUBLISH = "publish"
    SAVE = "save"


@dataclass(frozen=True)
class Heartbeat:
    phase: Phase
    time: float  # unix time of the beat
    rollout_id: int | None
    pid: int | None = None
    since: float | None = None  # unix time this phase of this rollout began (None: unknown, take `time`)

    @property
    def began(self) -> float:
        return self.time if self.since is None else self.since


def write_heartbeat(job_dir: JobDir, phase: Phase, rollout_id: int, since: float | None = None) -> None:
    """A beat: the trainer is in `phase` of rollout_id, since `since` (unix time; None: now, a new phase).
    A beat in the same phase again (an optimizer step, a save's progress) keeps the phase's `since`."""
    now = time.time()
    beat = {"phase": Phase(phase).value, "rollout_id": rollout_id, "time": now, "pid": os.getpid(),
            "since": now if since is None else since}
    # Not fsync'd: it is rewritten every few seconds, and a beat lost to a crash of the node
    # matters to no one.
    write_atomic(job_dir.heartbeat, json.dumps(beat), durable=False)


def read_heartbeat(job_dir: JobDir, launched: float) -> Heartbeat:
    """The trainer's latest beat if it came from the launch at `launched` (unix time); before that
    beat, or with an unreadable file, the trainer is starting, since its launch."""
    try:
        beat = json.loads(job_dir.heartbeat.read_text())
        if float(beat["time"]) >= launched:
            since = beat.get("since")
            return Heartbeat(Phase(beat["phase"]), float(beat["time"]), beat.get("rollout_id"), beat.get("pid"),
                             None if since is None else float(since))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not written yet, or a predecessor's
    return Heartbeat(Phase.START, launched, None)


TRAINER_FATAL_EXIT = 3  # the trainer's exit code with a fatal reason written: no restart would help


def write_trainer_fatal(job_dir: JobDir, reason: str) -> None:
    write_atomic(job_dir.trainer_fatal, json.dumps({"reason": reason, "time": time.time(), "pid": os.getpid()}))


def read_trainer_fatal(job_dir: JobDir, launched: float) -> str | None:
    """The fatal reason the trainer launched at `launched` (unix time) left, if it left one."""
    try:
        fatal = json.loads(job_dir.trainer_fatal.read_text())
        return str(fatal["reason"]) if float(fatal["time"]) >= launched else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_trainer_finished(job_dir: JobDir) -> None:
    """The trainer's last act before it exits 0: the record of its end that does not need SLURM's
    accounting (a supervisor that did not see it end learns it here; sacct may have nothing)."""
    write_atomic(job_dir.trainer_finished, json.dumps({"time": time.time(), "pid": os.getpid()}))


def read_trainer_finished(job_dir: JobDir, launched: float) -> bool:
    """Whether the trainer launched at `launched` (unix time) ran to its end and exits 0."""
    try:
        return float(json.loads(job_dir.trainer_finished.read_text())["time"]) >= launched
    except (OSError, ValueError, KeyError, TypeError):
        return False


# ------------------------------------------------------------------ the trainer's metrics
class Metric:
    """Keys of metrics.jsonl that other programs read (the trainer writes more)."""

    ROLLOUT_ID = "rollout_id"
    ROLLOUT_SECONDS = "rollout_seconds"  # generating the rollout
    TRAIN_SECONDS = "train_seconds"  # log-probs and optimizer steps
    LOG_PROBS_SECONDS = "log_probs_seconds"  # of which the forward passes before the first step
    PUBLISH_SECONDS = "publish_seconds"
    PUBLISH_BYTES = "publish_bytes"  # the weights sent (disk: written) by the publish
    TRAIN_TOKENS_PER_S = "perf/actor_train_tok_per_s"  # slime's: the rollout's tokens / the optimizer steps' time
    # slime's, per GPU (trainer/flops.py): 3x the forward FLOPs of the rollout's tokens / the optimizer steps'
    # time, and 1x / the log-probs' time
    TRAIN_TFLOPS = "perf/actor_train_tflops"
    LOG_PROBS_TFLOPS = "perf/log_probs_tflops"
    # slime's: the time the trainer waited since its previous train step (rollout, publish, save, eval)
    # over that plus this train step's
    WAIT_TIME_RATIO = "perf/wait_time_ratio"
    SAVE_SECONDS = "save_seconds"  # only on rollouts that saved
    EVAL_SECONDS = "eval_seconds"  # only on rollouts that evaluated
    TRAIN_STARTED_AT, TRAIN_ENDED_AT = "train_started_at", "train_ended_at"  # unix s: the trace viewer's trainer row


# Each rollout's time by phase, on every metrics line (0 for a phase that did not run), under
# slime's perf/*_time names; disjoint, so they add up to the rollout's wall time (slurmrl report
# stacks them): log-probs are the forward passes before the first optimizer step, train the steps.
PHASE_TIMES = {"rollout": "perf/rollout_time", "log_probs": "perf/log_probs_time", "train": "perf/actor_train_time",
               "publish": "perf/update_weights_time", "save": "perf/save_model_time", "eval": "perf/eval_time"}


# Where the trainer has a GPU, each phase's peak GPU memory (GiB; trainer/phase_memory.py): the
# trainer rank's own, and the GPU's use by every process on it (colocated engines too).
PHASE_PEAK_GPU_MEMORY = {phase: (f"perf/{phase}_trainer_peak_gpu_gb", f"perf/{phase}_gpu_used_peak_gb")
                         for phase in PHASE_TIMES}


def phase_times(metrics: dict[str, Any]) -> dict[str, float]:
    """PHASE_TIMES of a rollout's metrics line, from the seconds the loop measured (Metric's)."""
    log_probs = float(metrics.get(Metric.LOG_PROBS_SECONDS, 0.0))
    seconds = {"rollout": metrics.get(Metric.ROLLOUT_SECONDS, 0.0), "log_probs": log_probs,
               "train": float(metrics.get(Metric.TRAIN_SECONDS, 0.0)) - log_probs,
               "publish": metrics.get(Metric.PUBLISH_SECONDS, 0.0), "save": metrics.get(Metric.SAVE_SECONDS, 0.0),
               "eval": metrics.get(Metric.EVAL_SECONDS, 0.0)}
    return {PHASE_TIMES[phase]: float(value) for phase, value in seconds.items()}


def append_metrics(job_dir: JobDir, rollout_id: int, metrics: dict[str, Any]) -> dict[str, Any]:
    line = {Metric.ROLLOUT_ID: rollout_id, **metrics}
    with open(job_dir.metrics, "a") as f:
        f.write(json.dumps(line) + "\n")
    return line


METRICS_TAIL_BYTES = 1 << 20  # read_metrics reads at most this much of the file's end (a long run's lines pile up)


def read_metrics(job_dir: JobDir, last: int) -> list[dict[str, Any]]:
    """The last `last` lines of metrics.jsonl ([] when there are none or they do not parse), read
    from the file's last METRICS_TAIL_BYTES: the supervisor reads them after every rollout."""
    try:
        with open(job_dir.metrics, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - METRICS_TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
        if size > METRICS_TAIL_BYTES:
            lines = lines[1:]  # begins mid-line
        return [json.loads(line) for line in lines[-last:] if line.strip()]
    except (OSError, ValueError):
        return []


# ------------------------------------------------------------------ durable writes
def write_atomic(path: Path, data: str | bytes, *, durable: bool = True, mode: int | None = None) -> Path:
    """Replace `path` so that a reader sees the old file or the whole new one, never half of it.
    durable: fsync the file and its folder, so the new file also survives a crash of the node.
    mode: the file's permissions (it never exists with looser ones)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename, a new file) survive a crash of the node."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
