"""Sync vs async GRPO on the offline demo: wall time per step and generation utilisation.

Runs the real CLI once per variant (sync; async with max_trajectory_age_steps 1 and 2; async
with in-flight weight updates) in fresh run folders and reads their metrics.jsonl. Generation
utilisation is the share of the training loop's wall time during which the generator worked:
sum of generation seconds / sum of step seconds over steps 2..N (step 1 includes warm-up).
Writes a markdown report with the machine it ran on. Usage:
    uv run --no-sync python benchmarks/e2e/bench_async.py [--steps 20] [--out benchmarks/results/e2e_async_cpu.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import grpo_train  # noqa: E402
from bench_demo import ROOT, git_commit, machine  # noqa: E402

QUIET = [
    "logger.wandb_enabled=false",
    "logger.tensorboard_enabled=false",
    "logger.plot_enabled=false",
    "checkpointing.enabled=false",
    "grpo.val_period=0",
]
ASYNC = ["--config", "grpo_arith_tiny_async.yaml"]
IS = ["loss_fn.use_importance_sampling_correction=true"]  # the same loss in every variant
VARIANTS = {
    "sync": IS,
    "async, max age 1": [*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=1"],
    "async, max age 2": [*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=2"],
    "async, max age 1, in-flight updates": [
        *ASYNC,
        "grpo.async_grpo.max_trajectory_age_steps=1",
        "grpo.async_grpo.in_flight_weight_updates=true",
    ],
}


def run(name: str, overrides: list[str], steps: int) -> dict:
    res = grpo_train(name, [*overrides, *QUIET, f"grpo.max_num_steps={steps}"], prefix="grpo-bench-async-")
    wall, train, val = res.wall, res.train[1:], res.val
    step_s = [r["timing/step_s"] for r in train]
    gen_s = sum(r.get("timing/generate_s", 0.0) + r.get("timing/reward_s", 0.0) for r in train)

    def mean(key: str) -> float:
        values = [r[key] for r in train if key in r]
        return statistics.mean(values) if values else float("nan")

    return {
        "name": name,
        "wall": wall,
        "step_median": statistics.median(step_s),
        "step_mean": statistics.mean(step_s),
        "utilisation": gen_s / sum(step_s),
        "starvation": mean("async/trainer_starvation_s"),
        "exposed": mean("async/exposed_generation_s"),
        "idle": mean("async/generation_idle_s"),
        "age": mean("async/trajectory_age_mean"),
        "val": f"{val[0]['accuracy']:.3f} -> {val[-1]['accuracy']:.3f}" if len(val) > 1 else "n/a",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "e2e_async_cpu.md")
    args = parser.parse_args()
    load_before = os.getloadavg()[1]
    results = [run(name, overrides, args.steps) for name, overrides in VARIANTS.items()]
    load_after = os.getloadavg()[1]
    lines = [
        "# Sync vs async GRPO on the offline demo (CPU)",
        "",
        f"- machine: {machine()}",
        f"- commit: {git_commit()}; `grpo train` on the demo config, {args.steps} steps, validation at start and end "
        f"(256 prompts), IS correction on in every variant; figures over steps 2..{args.steps}",
        "- generation utilisation: generation + reward seconds / step seconds (async: the collector's seconds "
        "in the same interval)",
        f"- 5-minute load average {load_before:.1f} before, {load_after:.1f} after (the machine is shared: "
        "figures above ~2 mean other work competed for the 2 cores)",
        "",
        "| variant | s/step (median) | s/step (mean) | gen. utilisation | starvation s/step | exposed gen. s/step "
        "| gen. idle s/step | mean age | held-out acc. | process wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['step_median']:.3f} | {r['step_mean']:.3f} | {r['utilisation']:.0%} | "
            f"{r['starvation']:.3f} | {r['exposed']:.3f} | {r['idle']:.3f} | {r['age']:.2f} | {r['val']} | "
            f"{r['wall']:.0f} |"
        )
    lines += ["", "GPU figures: pending (no GPU in this session)."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
