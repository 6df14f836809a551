"""kernels, data and envs are leaves; train joins them; cli sits on top (shared/DESIGN.md).

Checked two ways: statically over every module's imports, and at run time by importing every
module of a leaf in a fresh interpreter where the other grpo packages cannot be imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "grpo_kernels": set(),
    "grpo_data": set(),
    "grpo_envs": set(),
    "grpo_train": {"grpo_kernels", "grpo_data", "grpo_envs"},
    "grpo_cli": {"grpo_train", "grpo_kernels", "grpo_data", "grpo_envs"},
}


def package_src(pkg: str) -> Path:
    return ROOT / "packages" / pkg.replace("_", "-") / "src" / pkg


def imported_grpo_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in ALLOWED}
    return found


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_static_imports_follow_the_direction(pkg):
    bad = []
    for path in sorted(package_src(pkg).rglob("*.py")):
        for other in imported_grpo_packages(path) - ALLOWED[pkg] - {pkg}:
            bad.append(f"{path.relative_to(ROOT)} imports {other}")
    assert not bad, "\n".join(bad)


def test_static_check_sees_a_violation(tmp_path):
    offender = tmp_path / "m.py"
    offender.write_text("import os\nfrom grpo_train.config import x\nimport grpo_envs.base\n")
    assert imported_grpo_packages(offender) == {"grpo_train", "grpo_envs"}


BLOCKER = """
import importlib, importlib.abc, pkgutil, sys
blocked = set(sys.argv[2].split(','))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in blocked:
            raise ImportError(f'{name} is outside this package')
sys.meta_path.insert(0, Block())
pkg = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):
    importlib.import_module(info.name)
print('imported', sys.argv[1])
"""


@pytest.mark.parametrize("leaf", ["grpo_kernels", "grpo_data", "grpo_envs"])
def test_leaf_imports_without_the_other_packages(leaf):
    blocked = ",".join(sorted(set(ALLOWED) - {leaf}))
    result = subprocess.run([sys.executable, "-c", BLOCKER, leaf, blocked], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
