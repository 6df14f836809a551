"""Reproduce the start-up failure of two `grpo train` runs started at once, and show the fix.

Ray 2.60's raylet waits a fixed 15 s for its dashboard agent (a Python process) to write its
port file and aborts otherwise ("Timed out waiting for file .../metrics_agent_port_..." in
raylet.err); `ray.init` then raises "The current node timed out during startup". On a loaded
2-core machine two heads starting in the same second made the agent miss it (clean-clone CI,
tests/test_e2e_ppo.py). Here the agent of the first head start is delayed by --agent-delay-s
through a sitecustomize on PYTHONPATH, so the miss happens on any machine:

  plain   `ray.init` as grpo called it before: expected to fail, with the raylet's message;
  grpo    `grpo_train.setup.init_ray` (node-wide start lock, one more start): expected to start.

Writes a markdown report with the machine, its load and the commit. Usage:
    uv run --no-sync python benchmarks/e2e/repro_ray_head_start.py [--agent-delay-s 20]
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_demo import ROOT, git_commit, machine  # noqa: E402

DELAY_AGENT = """
import os, time
_cmd = open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ")
_marker = os.environ.get("GRPO_REPRO_AGENT_MARKER")
if b"dashboard/agent.py" in _cmd and _marker and not os.path.exists(_marker):
    open(_marker, "w").close()  # only the first agent is late: a second head start is not
    time.sleep(float(os.environ["GRPO_REPRO_AGENT_DELAY_S"]))
"""

PLAIN = """
import ray
ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
print("started", ray.get(ray.remote(lambda: 1).remote()) == 1)
"""

GRPO = """
import ray
from grpo_train.config import validate_config_dict
from grpo_train.setup import actor_env_vars, init_ray
init_ray(validate_config_dict({"cluster": {"num_cpus": 2}}).cluster, actor_env_vars())
print("started", ray.get(ray.remote(lambda: 1).remote()) == 1)
"""


def run_case(code: str, delay_s: float, work: Path) -> dict:
    marker = work / f"marker-{time.time_ns()}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")]),
        "GRPO_REPRO_AGENT_MARKER": str(marker),
        "GRPO_REPRO_AGENT_DELAY_S": str(delay_s),
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    }
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "ray", "session_2*")))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    seconds = time.perf_counter() - t0
    raylet_errors = []
    for session in sorted(set(glob.glob(os.path.join(tempfile.gettempdir(), "ray", "session_2*"))) - before):
        err = Path(session, "logs", "raylet.err")
        if err.is_file() and "Timed out waiting for file" in err.read_text():
            missed = Path(err.read_text().split("Timed out waiting for file ")[1].split()[0]).name
            raylet_errors.append(f"Timed out waiting for file {missed[:30]}...")
    lines = [
        ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith(("started", "warning:", "Exception"))
    ]
    return {
        "rc": proc.returncode,
        "seconds": seconds,
        "raylet": raylet_errors,
        "lines": lines,
        "tail": (proc.stdout + proc.stderr)[-600:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agent-delay-s", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ray_head_start_cpu.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="grpo-repro-"))
    (work / "sitecustomize.py").write_text(DELAY_AGENT)
    load_before = os.getloadavg()
    results = {name: run_case(code, args.agent_delay_s, work) for name, code in (("plain", PLAIN), ("grpo", GRPO))}
    load_after = os.getloadavg()
    rows = [
        f"| {name} | {r['rc']} | {r['seconds']:.0f} | {'; '.join(r['raylet']) or '-'} | {' / '.join(r['lines'])} |"
        for name, r in results.items()
    ]
    report = "\n".join(
        [
            "# Ray head start with a late dashboard agent (benchmarks/e2e/repro_ray_head_start.py)",
            "",
            f"Machine: {machine()}. Commit {git_commit()}. Load average (1/5/15 min) before "
            f"{'/'.join(f'{x:.1f}' for x in load_before)}, after {'/'.join(f'{x:.1f}' for x in load_after)} "
            "(a shared machine: seconds are inflated by other users' work).",
            f"The first dashboard agent of each case sleeps {args.agent_delay_s:g} s before importing Ray's dashboard.",
            "",
            "| case | exit | seconds | raylet.err | driver lines |",
            "|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    args.out.write_text(report)
    print(report)
    ok = results["plain"]["rc"] != 0 and results["plain"]["raylet"] and results["grpo"]["rc"] == 0
    if not ok:
        print({k: v["tail"] for k, v in results.items()}, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
