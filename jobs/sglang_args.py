"""SGLang's own argument parser, run on engine command lines before a job is submitted.

scripts/install.sh puts the sglang wheel and the modules `sglang.srt.server_args` imports in
SIDE_FOLDER (never site-packages: SGLang cannot run here). The parse runs in a child process with
the side folder at the end of its sys.path, so this process never imports sglang and the side
folder never shadows an installed package.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from contract.job_dir import write_atomic

SIDE_FOLDER = Path(__file__).resolve().parents[1] / ".sglang-args"
CACHE = SIDE_FOLDER / "parse-cache"  # one JSON verdict per (pinned versions, argv)
# The values of these flags are the job's own (slurmrl sets them, SGLang only checks their type).
_PER_JOB = {"--model-path": "MODEL", "--host": "HOST", "--port": "1", "--dist-init-addr": "HOST:1",
            "--api-key": "KEY", "--disaggregation-bootstrap-port": "1", "--weight-version": "V"}
# Importing sglang.srt.server_args (torch, transformers) takes ~10 s on a loaded 2-core machine.
PARSE_TIMEOUT_S = 180.0

# argv lists as JSON on stdin -> one error (or null) per list as JSON on stdout
_CHILD = """
import argparse, json, sys
sys.path.append(sys.argv[1])
from sglang.srt.server_args import ServerArgs

class Refused(Exception):
    pass

class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Refused(message)

def error(argv):
    parser = Parser(prog="sglang.launch_server", allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    try:
        parser.parse_args(argv)
    except Refused as err:
        return str(err)
    return None

print(json.dumps([error(argv) for argv in json.load(sys.stdin)]))
"""


class ParserUnavailable(RuntimeError):
    """SGLang's parser cannot be run here; the message says why and how to get it."""


def parse_errors(argvs: list[list[str]], timeout_s: float = PARSE_TIMEOUT_S) -> list[str | None]:
    """SGLang's error for each engine argv (the flags after `-m sglang.launch_server`), None where it
    parses. Raises ParserUnavailable when the side folder is missing or does not import. A verdict
    is remembered in the side folder (keyed by its pinned versions and the argv), so a command line
    seen before costs no import of SGLang."""
    if not (SIDE_FOLDER / "sglang").is_dir():
        raise ParserUnavailable(f"{SIDE_FOLDER} is missing; run scripts/install.sh")
    argvs = [_placeheld(argv) for argv in argvs]
    keys = [_cache_key(argv) for argv in argvs]
    known = {key: json.loads(path.read_text()) for key in keys if (path := CACHE / f"{key}.json").is_file()}
    todo = {key: argv for key, argv in zip(keys, argvs) if key not in known}
    if todo:
        for key, verdict in zip(todo, _run_parser(list(todo.values()), timeout_s)):
            known[key] = verdict
            write_atomic(CACHE / f"{key}.json", json.dumps(verdict), durable=False)
    return [known[key] for key in keys]


def _placeheld(argv: list[str]) -> list[str]:
    """argv with the values slurmrl fills in per job (paths, addresses, ports, the key) replaced by
    fixed ones of the same type: they cannot change SGLang's verdict, and a command line of another
    job (or test) with the same flags then hits the cache."""
    out, pending = [], None
    for token in argv:
        name, eq, _ = token.partition("=")
        if pending is not None:
            out.append(pending)
            pending = None
        elif eq and name in _PER_JOB:
            out.append(f"{name}={_PER_JOB[name]}")
        else:
            out.append(token)
            pending = _PER_JOB.get(token)
    return out


def _cache_key(argv: list[str]) -> str:
    pins = (SIDE_FOLDER / "PINS").read_text() if (SIDE_FOLDER / "PINS").is_file() else ""
    return hashlib.sha256(json.dumps([pins, argv]).encode()).hexdigest()


def _run_parser(argvs: list[list[str]], timeout_s: float) -> list[str | None]:
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, str(SIDE_FOLDER)], input=json.dumps(argvs),
                             capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ParserUnavailable(f"importing it from {SIDE_FOLDER} took over {timeout_s:.0f} s") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ParserUnavailable(f"it does not import from {SIDE_FOLDER} ({last}); run scripts/install.sh")
    return json.loads(out.stdout.strip().splitlines()[-1])
