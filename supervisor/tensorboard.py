"""TensorBoard scalars without torch: the events torch.utils.tensorboard.SummaryWriter.add_scalar
writes, through the tensorboard package's own event-file writer and protos, so that the control
plane starts without importing torch."""

from __future__ import annotations

import time
from pathlib import Path

from tensorboard.compat.proto import event_pb2, summary_pb2


class ScalarWriter:
    """One event file in `logdir` (created if missing). Events are queued and written by a
    background thread: every 120 s, on flush() and on close(), as SummaryWriter does."""

    def __init__(self, logdir: str | Path) -> None:
        # Imported here: tensorboard.summary's package init loads numpy and boto3 (~0.3 s), which
        # only a process that writes scalars should pay for, not every importer of the daemon.
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(logdir))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(value))])
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
