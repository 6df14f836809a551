"""What the `grpo train` benchmarks share (bench_async.py, bench_lora.py, bench_vs_trl.py): run the
real CLI in a fresh run folder, time the whole process and read back its metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_demo import ROOT


@dataclass
class Run:
    run_dir: Path
    wall: float  # seconds of the whole `grpo train` process (start-up included)
    rows: list[dict]  # metrics.jsonl, in order

    @property
    def train(self) -> list[dict]:
        return [r for r in self.rows if r["split"] == "train"]

    @property
    def val(self) -> list[dict]:
        return [r for r in self.rows if r["split"] == "val"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def grpo_train(name: str, args: list[str], prefix: str = "grpo-bench-") -> Run:
    """`grpo train --run-dir <fresh> *args` from the repository root; exits naming `name` and the
    tail of its stderr when the run fails."""
    run_dir = Path(tempfile.mkdtemp(prefix=prefix)) / "run"
    cmd = [sys.executable, "-m", "grpo_cli.main", "train", "--run-dir", str(run_dir), *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name}: grpo train failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return Run(run_dir, wall, read_metrics(run_dir))
