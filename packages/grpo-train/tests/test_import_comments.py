"""Every function-level import in grpo-train says why it is not at the top of its module (issue #17).

Two kinds are checked, by walking each module's AST:
- an import of grpo-train's own modules inside a function (it dodges an import cycle or a layer,
  or keeps a heavy module out of a light one);
- in the modules that `grpo --help`, `grpo config`, `grpo plan` and `grpo plot` load (found by
  importing those entry points in a fresh interpreter), an import of a non-stdlib package inside
  a function (kept lazy so that those commands stay torch-free).

The reason is a comment on the import's lines, or a comment line directly above the run of
import statements the import belongs to.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "grpo_train"
# What the light commands import (grpo_cli.main's lazy imports for --help, config, plan and plot).
LIGHT_ENTRY_POINTS = ("grpo_cli.main", "grpo_train.config.checks", "grpo_train.plan", "grpo_train.plotting")


def light_modules() -> set[str]:
    code = (
        f"import importlib, json, sys\nfor m in {LIGHT_ENTRY_POINTS!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('grpo_train'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out))


def _top_names(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    return {(node.module or "").split(".")[0]} if node.level == 0 else {"grpo_train"}


def _commented(lines: list[str], node: ast.stmt, run_start: int) -> bool:
    """A comment on the import's own lines, or a comment line right above its run of imports."""
    end = node.end_lineno or node.lineno
    if any("#" in lines[i - 1] for i in range(node.lineno, end + 1)):
        return True
    return run_start > 1 and lines[run_start - 2].strip().startswith("#")


def _import_runs(func: ast.AST):
    """(import, line of the first import of its run of consecutive import statements) in `func`."""
    for parent in ast.walk(func):
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(parent, field, None)
            if not isinstance(block, list):
                continue
            run_start, prev_end = None, None
            for stmt in block:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    if run_start is None or stmt.lineno != (prev_end or 0) + 1:  # a comment line starts a new run
                        run_start = stmt.lineno
                    prev_end = stmt.end_lineno or stmt.lineno
                    yield stmt, run_start
                else:
                    run_start = None


def uncommented(source: str, light: bool) -> list[int]:
    """Line numbers of the function-level imports of `source` that say no reason; `light`: the
    module is loaded by the torch-free commands."""
    lines = source.splitlines()
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node, run_start in _import_runs(func):
            tops = _top_names(node)
            checked = "grpo_train" in tops or (light and bool(tops - set(sys.stdlib_module_names) - {"__future__"}))
            if checked and not _commented(lines, node, run_start):
                found.append(node.lineno)
    return sorted(set(found))


def test_function_level_imports_say_why():
    light = light_modules()
    assert {"grpo_train.config.schema", "grpo_train.plan"} <= light and "grpo_train.setup" not in light
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for line in uncommented(path.read_text(), name in light):
            problems.append(
                f"{path.relative_to(SRC.parents[2])}:{line}: {path.read_text().splitlines()[line - 1].strip()}"
            )
    assert not problems, "function-level imports without a comment saying why:\n" + "\n".join(problems)


def test_the_check_finds_a_planted_import_and_accepts_the_commented_forms():
    source = "\n".join([
        "def f():",
        "    from grpo_train.setup import build_components",  # 2: no reason
        "    from grpo_train.step import pad_id  # the step imports this module",
        "    # the loops import this module",
        "    from grpo_train.sync_loop import train_sync",
        "    from grpo_train.async_loop import train_async",  # 6: the same run as the line above
        "",
        "def g():",
        "    import json",
        "    import torch",  # 10: fine outside a light module
        "    x = 1  # a comment on code, not on the import",
        "    from grpo_train.plan import make_plan",  # 12: no reason
        "    return x",
    ])  # fmt: skip
    assert uncommented(source, light=False) == [2, 12]
    assert uncommented(source, light=True) == [2, 10, 12]
