"""grpo-envs installs and works on its own: wheel → clean venv → math and arithmetic envs.

The wheel is built from the workspace, installed into a fresh venv with only its declared
dependencies (pinned to the versions of uv.lock, so uv's cache serves them), and exercised
in-process by that venv's Python: no grpo-train, no vllm, no torch.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib.util, json
import grpo_envs
from grpo_envs.pool import EnvPool

absent = [m for m in ("torch", "grpo_train", "grpo_data", "grpo_kernels", "vllm", "transformers")
          if importlib.util.find_spec(m) is not None]

def logs(responses):
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": r}] for r in responses]

arith = grpo_envs.make("arithmetic").step(logs(["46", " 46 </s>", "45", "junk"]), [{"ground_truth": "46"}] * 4)
math_env = grpo_envs.make("math", timeout_s=5.0)
maths = math_env.step(logs(["\\boxed{\\frac{1}{2}}", "Answer: 0.5", "\\boxed{2}", ""]), [{"ground_truth": "1/2"}] * 4)
math_env.close()
with EnvPool("math", {"timeout_s": 5.0}, num_workers=1, in_process=True) as pool:
    pooled = pool.step(logs(["\\boxed{3}"]), [{"ground_truth": "3"}])
print(json.dumps({"unexpected": absent, "arith": arith.rewards, "math": maths.rewards,
                  "math_metrics": maths.metrics, "pooled": pooled.rewards, "file": grpo_envs.__file__}))
"""


def _uv() -> list[str]:
    uv = shutil.which("uv")
    return [uv] if uv else [sys.executable, "-m", "uv"]


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_grpo_envs_wheel_installs_and_runs_alone(tmp_path):
    uv = _uv()
    if subprocess.run([*uv, "--version"], capture_output=True).returncode != 0:
        pytest.skip("uv is not available")
    dist = tmp_path / "dist"
    _run([*uv, "build", "--package", "grpo-envs", "--wheel", "-o", str(dist)], cwd=ROOT)
    (wheel,) = dist.glob("grpo_envs-*.whl")
    pins = _run(
        [
            *uv,
            "export",
            "--frozen",
            "--package",
            "grpo-envs",
            "--no-dev",
            "--no-emit-workspace",
            "--no-hashes",
            "--no-header",
            "--no-annotate",
        ],
        cwd=ROOT,
    ).stdout
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(pins)

    venv = tmp_path / "venv"
    _run([*uv, "venv", str(venv), "--python", f"{sys.version_info.major}.{sys.version_info.minor}"])
    python = venv / "bin" / "python"
    install = [*uv, "pip", "install", "--python", str(python), "-c", str(constraints), str(wheel)]
    # From uv's cache when it holds the locked versions; from the index otherwise.
    if subprocess.run([*install, "--offline"], capture_output=True, text=True, timeout=300).returncode != 0:
        _run(install)

    out = _run([str(python), "-c", PROBE], cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(str(venv))  # the installed wheel, not the workspace source
    assert result["unexpected"] == []
    assert result["arith"] == [1.0, 1.0, 0.0, 0.0]
    assert result["math"] == [1.0, 1.0, 0.0, 0.0]
    assert result["math_metrics"]["parse_failures"] == 1.0
    assert result["pooled"] == [1.0]
