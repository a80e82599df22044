"""ScalarWriter: scalars that TensorBoard reads back, written without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from supervisor.tensorboard import ScalarWriter


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_scalars_read_back(tmp_path: Path) -> None:
    logdir = tmp_path / "tensorboard" / "supervisor"  # made by the writer
    writer = ScalarWriter(logdir)
    for step in range(5):
        writer.add_scalar("supervisor/engines_up", step % 3, step)
    writer.add_scalar("supervisor/recover_seconds", 1.5, 7)
    writer.add_scalar("supervisor/recover_seconds", 0.25, 9)
    writer.flush()
    assert _scalars(logdir)["supervisor/engines_up"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 0.0), (4, 1.0)]
    writer.add_scalar("supervisor/engine_restarts", 2, 2)
    writer.close()
    assert _scalars(logdir) == {
        "supervisor/engines_up": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 0.0), (4, 1.0)],
        "supervisor/recover_seconds": [(7, 1.5), (9, 0.25)],
        "supervisor/engine_restarts": [(2, 2.0)],
    }


def test_import_loads_no_torch_or_tensorflow(tmp_path: Path) -> None:
    code = ("import sys; from supervisor.tensorboard import ScalarWriter; w = ScalarWriter(sys.argv[1]); "
            "w.add_scalar('a', 1.0, 0); w.close(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow')))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"
