"""Start-up of an async `grpo train` launch: seconds from the process start to its first step.

Runs the real CLI on the async demo config (no validation, no checkpoints, 2 steps) and watches
its metrics.jsonl: time to first step is the moment the first training row appears, measured
from the launch. Step 1's `timing/wait_for_groups_s` is the part of it the trainer spent
waiting for the collector's first batch (the collector's own start-up shows there). CPU
seconds of the launch's process tree until its first step come beside the wall times: on a
shared machine they move much less with other work. Usage:
    uv run --no-sync python benchmarks/e2e/bench_async_startup.py [--repeats 2]
Prints a markdown table row per launch and the median; the figures go to
benchmarks/results/e2e_async_cpu.md by hand, with the machine and the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_demo import ROOT, git_commit, machine  # noqa: E402

QUIET = [
    "logger.wandb_enabled=false",
    "logger.tensorboard_enabled=false",
    "logger.plot_enabled=false",
    "checkpointing.enabled=false",
    "grpo.val_period=0",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.max_num_steps=2",
]
POLL_S = 0.25


def first_train_row(path: Path) -> dict | None:
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        if line.strip() and (row := json.loads(line))["split"] == "train":
            return row
    return None


def launch(extra: list[str]) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="grpo-bench-startup-")) / "run"
    cmd = [
        sys.executable,
        "-m",
        "grpo_cli.main",
        "train",
        "--config",
        "grpo_arith_tiny_async.yaml",
        "--run-dir",
        str(run_dir),
        *QUIET,
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cpu = TreeCpu(proc.pid)
    while (row := first_train_row(run_dir / "metrics.jsonl")) is None and proc.poll() is None:
        cpu.sample()
        time.sleep(POLL_S)
    first = time.perf_counter() - start
    cpu.sample()
    _, err = proc.communicate()
    if proc.returncode != 0 or row is None:
        raise SystemExit(f"grpo train failed:\n{err[-4000:]}")
    return {
        "first_step_s": first,
        "wait_s": row.get("timing/wait_for_groups_s", float("nan")),
        "step_s": row.get("timing/step_s", float("nan")),
        "wall_s": time.perf_counter() - start,
        "cpu_s": cpu.total(),
    }


class TreeCpu:
    """CPU seconds (user + system) of a launch's whole process tree up to now: the run, Ray's
    processes and workers, vLLM's engine process. Sampled while the run lives (a process's
    last sample counts), so it moves much less than wall time with other work on a shared
    machine."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.seen: dict[int, float] = {}

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            try:
                times = proc.cpu_times()
                self.seen[proc.pid] = max(self.seen.get(proc.pid, 0.0), times.user + times.system)
            except psutil.NoSuchProcess:
                pass

    def total(self) -> float:
        return sum(self.seen.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print(f"machine: {machine()}; commit {git_commit()}; load {os.getloadavg()[1]:.1f}")
    print(
        "| launch | time to first step s | step 1 waiting for groups s | step 1 s | process wall s | CPU s to first step (process tree) |"
    )
    print("|---|---|---|---|---|---|")
    runs = []
    for i in range(args.repeats):
        r = launch(args.overrides)
        runs.append(r)
        print(
            f"| {i + 1} | {r['first_step_s']:.1f} | {r['wait_s']:.1f} | {r['step_s']:.1f} | {r['wall_s']:.1f} | "
            f"{r['cpu_s']:.0f} |",
            flush=True,
        )
    print(
        f"median time to first step {statistics.median(r['first_step_s'] for r in runs):.1f} s, "
        f"median step-1 wait {statistics.median(r['wait_s'] for r in runs):.1f} s, "
        f"median CPU {statistics.median(r['cpu_s'] for r in runs):.0f} s; load {os.getloadavg()[1]:.1f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
