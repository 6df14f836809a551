"""Time the offline demo (`grpo train`, default config) and break a step down by phase.

Runs the real CLI in a fresh run folder, then reads its metrics.jsonl. Writes a markdown
report with the machine it ran on. Usage:
    uv run --no-sync python benchmarks/e2e/bench_demo.py [--out benchmarks/results/e2e_demo_cpu.md] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("generate", "reward", "logprob", "train", "refit", "refit_check")


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except OSError:
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "e2e_demo_cpu.md")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="grpo-bench-")) / "run"
    cmd = [sys.executable, "-m", "grpo_cli.main", "train", "--run-dir", str(run_dir), *args.overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    steady = train[1:] or train  # the first step includes warm-up

    def med(key: str) -> float:
        values = [r[key] for r in steady if key in r]
        return statistics.median(values) if values else float("nan")

    lines = [
        "# Offline demo (`grpo train`, default config) on CPU",
        "",
        f"- machine: {machine()}",
        f"- commit: {git_commit()}; command: `{' '.join(['grpo', 'train', *args.overrides])}`",
        f"- total wall time (process start to exit, incl. Ray, vLLM and validation): **{wall:.0f} s** for {len(train)} steps",
        f"- held-out greedy accuracy: **{val[0]['accuracy']:.3f} -> {val[-1]['accuracy']:.3f}** "
        f"(steps {val[0]['step']} -> {val[-1]['step']}; {len(val)} validations)"
        if val
        else "- no validation rows",
        f"- train reward: {train[0]['reward_mean']:.3f} (step 1) -> {train[-1]['reward_mean']:.3f} (step {train[-1]['step']})",
        "",
        "Median per step (steps 2..N):",
        "",
        "| phase | seconds |",
        "|---|---|",
        *[f"| {p} | {med(f'timing/{p}_s'):.3f} |" for p in PHASES],
        f"| **step** | **{med('timing/step_s'):.3f}** |",
        "",
        f"Generation throughput: {med('tokens_per_s'):.0f} generated tokens/s (median); "
        f"refit check max |Δ logprob|: {max(r.get('refit/max_abs_logprob_diff', 0.0) for r in train):.2e}.",
        "",
        "Validation curve: " + ", ".join(f"step {r['step']}: {r['accuracy']:.3f}" for r in val),
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
