"""Lint and type check as part of `make test`, so CI enforces them.

ruff runs the rule set of the root pyproject.toml over the whole repository and checks that
`ruff format` would change nothing; basedpyright runs
in "basic" mode over the five packages' src. Type errors that existed when the checker came in
are recorded in .basedpyright/baseline.json (regenerate with `basedpyright --writebaseline`
after fixing some); any new one fails here, and fewer than recorded passes. The check reads a copy
of the baseline, because basedpyright rewrites the file it reads when errors have gone, and a test
must not edit the tree. `--baselinemode=auto` is explicit because basedpyright defaults to `lock`
when the CI variable is set, and `lock` fails when errors have gone.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_check_is_clean():
    out = run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_leaves_the_tree_as_it_is():
    out = run(str(BIN / "ruff"), "format", "--check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_basedpyright_finds_no_new_error(tmp_path):
    baseline = tmp_path / "baseline.json"
    shutil.copy(ROOT / ".basedpyright" / "baseline.json", baseline)
    out = run(str(BIN / "basedpyright"), "--baselinefile", str(baseline), "--baselinemode=auto")
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr
