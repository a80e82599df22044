"""Every SLURM program slurmrl runs is run by the one client, slurm/client.py: a scan of the product
packages' source (ast) for a subprocess, os.exec*/os.spawn* or asyncio subprocess call whose command
line names sbatch, srun, scancel, scontrol, squeue, sacct or sinfo anywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

from slurm.client import PROGRAMS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("supervisor", "trainer", "rollout", "jobs", "contract", "ckpt_tools", "slurm", "slime")
# Modules that may run a SLURM program themselves, and why. (Submitit runs sbatch and sacct for
# `slurmrl submit` and its job handle, jobs/submit.py and jobs/hetjob.py: inside the library, not
# in this source, so they need no entry here; the devcluster's daemons and sacctmgr are not SLURM
# client programs, and its sinfo/scontrol/scancel/squeue calls go through the client.)
ALLOWED = {
    "slurm/client.py": "the client itself",
}
_RUNNERS = {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput",
            "create_subprocess_exec", "create_subprocess_shell", "system", "popen"}
_RUNNER_PREFIXES = ("exec", "spawn")
_MODULES = {"subprocess", "os", "asyncio", "pty"}


def _runner_name(name: str) -> bool:
    return name in _RUNNERS or name.startswith(_RUNNER_PREFIXES)


def _runners(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The local names of the process-running modules, and of runners imported from them."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name in _MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module in _MODULES:
            functions |= {a.asname or a.name for a in node.names if _runner_name(a.name)}
    return modules, functions


def _is_runner(func: ast.expr, modules: set[str], functions: set[str]) -> bool:
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id in modules and _runner_name(func.attr)
    return isinstance(func, ast.Name) and func.id in functions


def _names_program(node: ast.AST) -> bool:
    """A string in the call's arguments that is a SLURM program, or a shell line that starts with one."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            words = sub.value.split()
            if words and Path(words[0]).name in PROGRAMS:
                return True
    return False


def _program_argv(node: ast.AST) -> bool:
    """A list or tuple literal that starts with a SLURM program: a command line built to be run."""
    return (isinstance(node, (ast.List, ast.Tuple)) and bool(node.elts) and isinstance(node.elts[0], ast.Constant)
            and isinstance(node.elts[0].value, str) and Path(node.elts[0].value).name in PROGRAMS)


PARSE_TRIES = 3


def _parse(source: str) -> ast.Module:
    """ast.parse, again where CPython 3.11 trips over another thread's parse (gh-106905: "AST constructor
    recursion depth mismatch", a SystemError; seen in CI beside a test's leftover threads)."""
    for _ in range(PARSE_TRIES - 1):
        try:
            return ast.parse(source)
        except SystemError as err:
            if "recursion depth mismatch" not in str(err):
                raise
    return ast.parse(source)


def slurm_calls(source: str) -> list[int]:
    """Line numbers in `source` where a SLURM program is run: a runner call that names one, and, in
    a module that runs processes at all, a command line of one built to be run later."""
    tree = _parse(source)
    modules, functions = _runners(tree)
    calls = [node for node in ast.walk(tree)
             if isinstance(node, ast.Call) and _is_runner(node.func, modules, functions)]
    direct = {node.lineno for node in calls
              if any(_names_program(arg) for arg in [*node.args, *(k.value for k in node.keywords)])}
    built = {node.lineno for node in ast.walk(tree) if _program_argv(node)} if calls else set()
    return sorted(direct | built)


def test_the_scan_finds_each_way_of_running_a_program() -> None:
    source = """
import os, subprocess as sp, asyncio
from subprocess import check_output as out
sp.run(["squeue", "-h"], timeout=5)
sp.Popen(["/usr/bin/srun", "--jobid=1", "x"])
os.execvp("scancel", ["scancel", "1.2"])
out("scontrol show hostnames n[1-2]", shell=True)
asyncio.create_subprocess_exec("sacct", "-j", "1")
sp.run(["ip", "link"])
print("squeue")
client.call("squeue", "-h")
argv = ["sinfo", "-N"]
"""
    assert slurm_calls(source) == [4, 5, 6, 7, 8, 12]
    assert not slurm_calls('argv = ["srun", "x"]')  # built, but nothing in the module runs it


def test_only_the_client_runs_slurm_programs() -> None:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            lines = slurm_calls(path.read_text())
            if lines and rel not in ALLOWED:
                found[rel] = lines
    assert not found, f"SLURM programs run outside slurm/client.py (ask slurm.client.SlurmClient): {found}"


def test_the_allow_list_is_not_stale() -> None:
    for rel, why in ALLOWED.items():
        assert slurm_calls((ROOT / rel).read_text()) or rel == "slurm/client.py", f"{rel} ({why}) runs none"
