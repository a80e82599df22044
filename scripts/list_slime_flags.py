"""Lists slime's flags, for docs/slime_flags.tsv (the list tests/jobs/test_slime_flags.py walks).

    python scripts/list_slime_flags.py SLIME_GIT_DIR > docs/slime_flags.tsv

Rows: group, flag, default. The groups are slime's own argument groups (slime/utils/arguments.py
and its sglang_utils/arguments.py; the flags each adds with add_argument or with slime's
reset_arg, which registers a Megatron-LM flag with slime's default), then "megatron": the Megatron-LM flags slime's scripts/*.sh
pass (slime parses Megatron-LM's flags too). Ray's own flags in those scripts are left out.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

SLIME_ARGUMENT_FILES = ("slime/utils/arguments.py", "slime/backends/sglang_utils/arguments.py")
# Flags of `ray start` / `ray job submit` / `ray stop` in slime's scripts: not the job's.
RAY_FLAGS = {"--address", "--dashboard-host", "--dashboard-port", "--disable-usage-stats", "--head",
             "--node-ip-address", "--num-gpus", "--runtime-env-json", "--force", "--working-dir"}


def _show(git_dir: str, path: str) -> str:
    return subprocess.run(["git", "-C", git_dir, "show", f"HEAD:{path}"], capture_output=True, text=True,
                          check=True).stdout


def _callee(call: ast.Call) -> str:
    return getattr(call.func, "attr", "") or getattr(call.func, "id", "")


def slime_flags(git_dir: str) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    for path in SLIME_ARGUMENT_FILES:
        tree = ast.parse(_show(git_dir, path))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            group = function.name.removeprefix("add_").removesuffix("_arguments")
            for call in ast.walk(function):
                if not isinstance(call, ast.Call) or _callee(call) not in ("add_argument", "reset_arg"):
                    continue
                # reset_arg(parser, "--flag", ...) adds a Megatron-LM flag with slime's default (or
                # only resets the default of one Megatron-LM already has): a flag slime takes either way.
                names = [a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
                keywords = {k.arg: k.value for k in call.keywords}
                default = ast.unparse(keywords["default"]) if "default" in keywords else (
                    "False" if "store_true" in ast.unparse(keywords.get("action", ast.Constant(""))) else "None")
                negatable = "BooleanOptionalAction" in ast.unparse(keywords.get("action", ast.Constant("")))
                for name in names:
                    rows.append((group, name, default))
                    if negatable:
                        rows.append((group, "--no-" + name[2:], "-"))
    # inner functions are walked once per enclosing function too: keep each flag's innermost group
    seen: dict[str, tuple[str, str, str]] = {}
    for row in rows:
        seen[row[1]] = row
    return list(seen.values())


def script_megatron_flags(git_dir: str, known: set[str]) -> list[tuple[str, str, str]]:
    files = subprocess.run(["git", "-C", git_dir, "ls-tree", "-r", "--name-only", "HEAD", "scripts"],
                           capture_output=True, text=True, check=True).stdout.split()
    used: set[str] = set()
    for path in files:
        if path.endswith(".sh"):
            for line in _show(git_dir, path).splitlines():
                if not line.strip().startswith("#"):
                    used.update(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", line))
    return [("megatron", flag, "-") for flag in sorted(used - known - RAY_FLAGS) if not flag.startswith("--sglang-")]


def main() -> None:
    git_dir = sys.argv[1]
    commit = subprocess.run(["git", "-C", git_dir, "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    rows = slime_flags(git_dir)
    rows += script_megatron_flags(git_dir, {flag for _, flag, _ in rows})
    print(f"# slime {commit}: group\tflag\tdefault (scripts/list_slime_flags.py)")
    for group, flag, default in rows:
        print(f"{group}\t{flag}\t{default}")


if __name__ == "__main__":
    main()
