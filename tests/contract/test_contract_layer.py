"""contract/ is the bottom layer: every package may import it, so it imports nothing of slurmrl
outside itself (read from the source with ast, the way `../shared/tools/layers.py` reads it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLURMRL_PACKAGES = {"jobs", "supervisor", "trainer", "rollout", "ckpt_tools", "slurm", "slime"}


def _imported_packages(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            tops.add(node.module.split(".")[0])
    return tops


def test_contract_imports_nothing_of_slurmrl_outside_itself() -> None:
    modules = sorted((ROOT / "contract").rglob("*.py"))
    assert len(modules) >= 6, "contract/ holds the spec, its loading, the job dir and the control protocol"
    upward = {str(m.relative_to(ROOT)): sorted(_imported_packages(m) & SLURMRL_PACKAGES) for m in modules}
    assert {m: pkgs for m, pkgs in upward.items() if pkgs} == {}
