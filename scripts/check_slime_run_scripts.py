"""Which of slime's run scripts (scripts/ and examples/, those that launch train.py) pass slurmrl's
flag checks, and why the others do not.

    python scripts/check_slime_run_scripts.py SLIME_GIT_DIR

Each script runs in bash from the root of a copy of slime's tree (its /root/slime/ paths made the
copy's), with `ray`, `python3`, `pip`, `pkill`, `sleep`, `curl` and `nvidia-smi` stubbed and the
environment its README asks for set: the train.py argument list the script builds is captured as
bash expands it. That list is read as `slurmrl submit` reads flags (contract.spec_loading: the job
spec's flags, the --sglang-*/--router-* passthrough, the rest the trainer's) and the trainer's
flags are parsed by its own parser (refusals and unknown flags); the files the flags name (models,
data) are not checked, as they are not on this machine. Prints one line per script: PASS, or FAIL
and the first problems.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

_STUB = """#!/bin/bash
# Records train.py's arguments (NUL-separated) when called with it, else does nothing.
args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
    *train.py|*train_async.py) printf '%s\\0' "${args[@]:$((i+1))}" > "$CAPTURE"; exit 0 ;;
  esac
done
exit 0
"""
_PIP = "#!/bin/bash\necho 'megatron-core 0.16.1'\n"  # `pip list | grep megatron-core` finds it (run-qwen3-4B-amd.sh)
_STUBBED = ("ray", "python3", "python", "pkill", "sleep", "nvidia-smi", "hf", "huggingface-cli", "pip", "curl")
SCRIPT_S = 60  # one script's bash run, stubs and all


def run_scripts(git_dir: str) -> list[str]:
    files = subprocess.run(["git", "-C", git_dir, "ls-tree", "-r", "--name-only", "HEAD", "scripts", "examples"],
                           capture_output=True, text=True, check=True).stdout.split()
    out = []
    for path in files:
        if path.endswith(".sh"):
            text = subprocess.run(["git", "-C", git_dir, "show", f"HEAD:{path}"], capture_output=True, text=True,
                                  check=True).stdout
            if "train.py" in text or "train_async.py" in text:
                out.append(path)
    return out


# What the scripts read from the user's environment (their README's settings)
_USER_ENV = {"NUM_GPUS": "8", "BASE_FOLDER": "/root", "BASE_DIR": "/root", "MASTER_ADDR": "127.0.0.1",
             "WANDB_KEY": "key", "WANDB_API_KEY": "key", "HF_TOKEN": "token"}


def captured_argv(tree: Path, stubs: Path, script: str) -> tuple[list[str] | None, str]:
    """(train.py's arguments, or None where the script launched none; the script's last output line)."""
    path = tree / script
    path.write_text(path.read_text().replace("/root/slime/", f"{tree}/"))  # sourced model scripts: the copy's
    capture = Path(tempfile.mkstemp()[1])
    capture.write_bytes(b"")
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "CAPTURE": str(capture), "HOME": str(tree), **_USER_ENV}
    try:  # from slime's root, as its README runs them (bash scripts/run-qwen3-4B.sh)
        done = subprocess.run(["bash", script], cwd=tree, env=env, capture_output=True, text=True, timeout=SCRIPT_S,
                              stdin=subprocess.DEVNULL)
        said = (done.stderr.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired:
        said = f"still running after {SCRIPT_S} s"  # waiting on what the stubs do not start
    data = capture.read_bytes()
    capture.unlink()
    return (data.decode().split("\0")[:-1] if data else None), said


def problems(argv: list[str]) -> list[str]:
    from contract.spec_loading import load_spec
    from trainer.args import ArgsError, build_parser
    from trainer.config.checks import Checks
    from trainer.config.model_checks import check_spec

    spec, found = load_spec(None, argv)
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(spec.trainer.train_args)
    except ArgsError as err:
        return found + [str(err)]
    need = Checks()
    check_spec(args, None, need)  # a --spec whose layers slurmrl does not build, whatever the checkpoint
    return found + need.problems + [f"unknown flag {token}" for token in unknown if token.startswith("--")]


def main() -> None:
    git_dir = sys.argv[1]
    with tempfile.TemporaryDirectory() as root:
        tree, stubs = Path(root, "slime"), Path(root, "stubs")
        tree.mkdir()
        stubs.mkdir()
        archive = subprocess.run(["git", "-C", git_dir, "archive", "HEAD"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        for name in _STUBBED:
            (stubs / name).write_text(_STUB if name != "pip" else _PIP)
            os.chmod(stubs / name, 0o755)
        results = []
        for script in run_scripts(git_dir):
            argv, said = captured_argv(tree, stubs, script)
            found = [f"the script launched no train.py here: {said}"] if argv is None else problems(argv)
            results.append((script, found))
    for script, found in results:
        print(f"{'PASS' if not found else 'FAIL'}\t{script}" + ("" if not found else "\t" + " | ".join(found[:3])))
    print(f"{sum(not f for _, f in results)} of {len(results)} pass")


if __name__ == "__main__":
    main()
