"""The engine's start-up states (in process, no port) and its command-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollout.cpu_engine.args import parse_args
from rollout.cpu_engine.engine import UP, load_engine
from rollout.cpu_engine.server import build_app
from tests.rollout.cpu_engine_helpers import REPO, asgi_get, make_tiny_model


def _status(app, path: str) -> int:
    return asgi_get(app, path)[0]


def test_health_is_503_until_warmup_is_done(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model")
    engine = load_engine(parse_args(["--model-path", str(model)]))
    app = build_app(engine)
    engine.scheduler.start()
    try:
        for path in ("/health", "/health_generate", "/ping", "/ready"):
            assert _status(app, path) == 503, path
        engine.status = UP  # what the server does once its warmup generation went through
        for path in ("/health", "/health_generate", "/ping", "/ready"):
            assert _status(app, path) == 200, path
        assert engine.scheduler.stats()["forward_passes"] == 2  # each probe ran a 1-token generation
    finally:
        engine.scheduler.stop()


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["--model-path", "/nonexistent/model"], 1, "cpu_engine: error: /nonexistent/model is not a Hugging Face model"),
    (["--model-path", "m", "--port", "0"], 2, "--port must be 1..65535"),
    (["--model-path", "m", "--max-running-requests", "0"], 2, "--max-running-requests must be 1 or more"),
])
def test_bad_command_lines_fail_clearly(argv: list[str], code: int, message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "rollout.cpu_engine", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == code
    assert message in done.stderr
