"""The per-job API key that engines and the router require (invariant 6).

It lives in the job dir in a file only the owner can read, and reaches steps through the
SLURMRL_API_KEY environment variable: never on a command line (ps shows those to every user
of the node) and never in a log (`redact` before writing anything that might hold it).
"""

from __future__ import annotations

import os
import re
import secrets
import stat

from contract.job_dir import API_KEY_ENV, JobDir

_KEY_BYTES = 32
# Values that look like credentials even when the exact key is not known to the caller.
_PATTERNS = (
    re.compile(r"(Bearer\s+)\S+", re.IGNORECASE),
    re.compile(r"(--api-key[=\s]+)\S+"),
    re.compile(rf"({API_KEY_ENV}=)\S+"),
    re.compile(r"""(["']api_key["']\s*:\s*["'])[^"']+"""),
)
REDACTED = "***"


def create_key(job_dir: JobDir) -> str:
    """The job's key, made on first call; later calls (a requeued supervisor) return the same."""
    path = job_dir.api_key
    try:
        # O_EXCL with mode 0600: the file never exists with a looser mode, and two
        # supervisors racing cannot both write one.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_key(job_dir)
    key = secrets.token_urlsafe(_KEY_BYTES)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())
    return key


def load_key(job_dir: JobDir) -> str:
    """Read the key back, refusing a file that others could read or that another user owns."""
    path = job_dir.api_key
    st = path.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{path} must be owned by uid {os.getuid()} with mode 0600 "
                              f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
    key = path.read_text().strip()
    if not key:
        raise ValueError(f"{path} is empty")
    return key


def step_env(key: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a step: `base` (default: ours) with the key set."""
    return {**(os.environ if base is None else base), API_KEY_ENV: key}


def key_from_env() -> str | None:
    """The key as a step sees it."""
    return os.environ.get(API_KEY_ENV) or None


def redact(text: str, *keys: str | None) -> str:
    """`text` with every given key and anything shaped like a credential replaced by ***."""
    for key in keys:
        if key:
            text = text.replace(key, REDACTED)
    for pattern in _PATTERNS:
        text = pattern.sub(rf"\g<1>{REDACTED}", text)
    return text
