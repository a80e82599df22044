"""The per-job API key: 0600, stable across supervisor restarts, passed by environment, redacted."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from contract.job_dir import API_KEY_ENV as ENV_VAR
from contract.job_dir import JobDir
from supervisor.keys import create_key, load_key, redact, step_env

ROOT = Path(__file__).resolve().parents[2]


def test_key_file_is_0600_and_the_same_key_comes_back(tmp_path: Path) -> None:
    job_dir = JobDir(tmp_path)
    old = os.umask(0)  # even a permissive umask must not loosen the file
    try:
        key = create_key(job_dir)
    finally:
        os.umask(old)
    assert stat.S_IMODE(job_dir.api_key.stat().st_mode) == 0o600
    assert len(key) >= 40 and create_key(job_dir) == key == load_key(job_dir)
    assert step_env(key, {"PATH": "/bin"}) == {"PATH": "/bin", ENV_VAR: key}


def test_a_readable_key_file_is_refused(tmp_path: Path) -> None:
    job_dir = JobDir(tmp_path)
    create_key(job_dir)
    os.chmod(job_dir.api_key, 0o644)
    with pytest.raises(PermissionError, match="mode 0600"):
        load_key(job_dir)


def test_redact_hides_the_key_and_credential_shapes() -> None:
    text = (f"launch --api-key s3cret-A now; curl -H 'Authorization: Bearer tok-B'; {ENV_VAR}=val-C; "
            '{"api_key": "val-D"}; plain secret-E here')
    out = redact(text, "secret-E")
    for secret in ("s3cret-A", "tok-B", "val-C", "val-D", "secret-E"):
        assert secret not in out
    assert out.startswith("launch --api-key *** now") and "plain *** here" in out


def test_the_router_log_loses_its_colour_codes() -> None:
    code = ("import os; from supervisor.with_key import plain_output; pump = plain_output(); "
            "os.write(1, b'\\x1b[2m2026\\x1b[0m \\x1b[32m INFO\\x1b[0m started\\n'); os.write(2, b'\\x1b[33mWARN\\x1b[0m x\\n'); "
            "os.close(1); os.close(2); pump.wait(10)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, cwd=ROOT)
    assert done.stdout == b"2026  INFO started\nWARN x\n", done
