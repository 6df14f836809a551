"""Summarise a `grpo train -c grpo_tool_arith_tiny.yaml` run for benchmarks/results/tool_arith_cpu.md.

Reads the run's metrics.jsonl and prints, as markdown: held-out greedy accuracy with tools at each
validation (and validation turns per sample: 1 + the share of samples that called the tool, since
a call is followed by one answer turn), then per training step the reward, the calculator env's
tool counts per sample (calls, invalid calls, tool errors, answered), turns per sample and the
chat-template drift. Numbers come from the run; this script computes nothing but ratios.

    uv run --no-sync python benchmarks/e2e/summarize_tool_run.py runs/grpo_tool_arith_tiny
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ENV = "env/calculator"
SAMPLES_PER_STEP_KEY = "num_samples"


def load(run_dir: Path) -> tuple[list[dict], list[dict]]:
    path = next(run_dir.rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("split") == "val"], [r for r in rows if r.get("split") == "train"]


def first(row: dict, *keys: str, default=float("nan")):
    return next((row[k] for k in keys if k in row), default)


def main(argv: list[str]) -> int:
    run_dir = Path(argv[0] if argv else "runs/grpo_tool_arith_tiny")
    val, train = load(run_dir)
    print("| validation step | held-out greedy accuracy (tools) | turns per sample |")
    print("|---|---|---|")
    for r in val:
        print(f"| {r['step']} | {r['accuracy']:.3f} | {first(r, 'turns_mean'):.2f} |")
    print()
    print(
        "| step | reward | calls / sample | invalid calls | tool errors | answered / sample | turns / sample | drift samples |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in train:
        n = first(r, "rollout/num_samples", SAMPLES_PER_STEP_KEY, default=128.0)
        print(
            f"| {r['step']} | {first(r, 'reward', 'reward_mean', 'rewards/mean'):.3f} "
            f"| {first(r, f'{ENV}/tool_calls', default=0.0) / n:.2f} | {first(r, f'{ENV}/invalid_tool_calls', default=0.0):.0f} "
            f"| {first(r, f'{ENV}/tool_errors', default=0.0):.0f} | {first(r, f'{ENV}/answered', default=0.0) / n:.2f} "
            f"| {first(r, 'turns_mean', 'rollout/turns_mean'):.2f} | {first(r, 'rollout/chat_drift_samples', default=0.0):.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
