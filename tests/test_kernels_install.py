"""grpo-kernels builds as a wheel and installs alone with pip into a clean venv (plus torch)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def uv_cmd() -> list[str]:
    exe = shutil.which("uv")
    return [exe] if exe else [sys.executable, "-m", "uv"]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert result.returncode == 0, f"{cmd}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
def test_kernels_wheel_installs_alone_with_pip(tmp_path):
    dist = tmp_path / "dist"
    run([*uv_cmd(), "build", "--package", "grpo-kernels", "--wheel", "-o", str(dist)], cwd=ROOT)
    wheel = next(dist.glob("grpo_kernels-*.whl"))
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    # The CPU torch wheel comes from the repo's ./wheels link (made by scripts/bootstrap.sh).
    links = ROOT / "wheels"
    env = {**os.environ, "PIP_FIND_LINKS": str(links)}
    # torch (the one heavy dependency, ~800 MB) comes from uv's cache in seconds; pip then
    # installs the grpo-kernels wheel itself and checks its requirements against what is there.
    run(
        [*uv_cmd(), "pip", "install", "-q", "--python", str(py), "--find-links", str(links), "torch==2.13.0+cpu"],
        env=env,
    )
    run([str(py), "-m", "pip", "install", "-q", str(wheel)], env=env)
    code = (
        "import grpo_kernels, grpo_kernels._C as C, numpy as np;"
        "bins = C.pack_first_fit_decreasing(np.array([5, 3, 4, 2], dtype=np.int64), 8);"
        "print(bins.tolist())"
    )
    out = run([str(py), "-c", code], cwd=tmp_path)
    assert out.stdout.strip() == "[0, 0, 1, 1]"
    listing = run([str(py), "-m", "pip", "list", "--format=freeze"]).stdout
    assert "grpo-train" not in listing and "grpo-data" not in listing and "vllm" not in listing
