"""LoRA vs full fine-tuning on the offline demo task: held-out accuracy at the same steps and seed.

Runs the real CLI twice, one run after the other (`grpo_arith_tiny.yaml`, then
`grpo_arith_tiny_lora.yaml`, same overrides), reads each run's metrics.jsonl and writes a
markdown report with the machine, its load average and the commit. Usage:
    uv run --no-sync python benchmarks/e2e/bench_lora.py [--steps 10] [--out benchmarks/results/lora_cpu.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import grpo_train  # noqa: E402
from bench_demo import ROOT, git_commit, machine  # noqa: E402

CONFIGS = {
    "full fine-tuning": "grpo_arith_tiny.yaml",
    "LoRA (dim 8, alpha 32, merged refit)": "grpo_arith_tiny_lora.yaml",
}


def run(config: str, steps: int) -> dict:
    overrides = [
        f"grpo.max_num_steps={steps}",
        f"grpo.val_period={steps}",
        "grpo.max_val_samples=128",
        "checkpointing.enabled=false",
        "logger.wandb_enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.plot_enabled=false",
    ]
    load_before = os.getloadavg()[0]
    res = grpo_train(config, ["-c", config, *overrides], prefix="grpo-lora-bench-")
    return {
        "val": res.val,
        "wall": res.wall,
        "load": (load_before, os.getloadavg()[0]),
        "train_s": sum(r.get("timing/train", 0.0) for r in res.train) / max(len(res.train), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lora_cpu.md")
    args = parser.parse_args()
    results = {label: run(config, args.steps) for label, config in CONFIGS.items()}
    lines = [
        f"# LoRA vs full fine-tuning on the offline task, {args.steps} GRPO steps, seed 42",
        "",
        f"- machine: {machine()}",
        f"- commit: `{git_commit()}`; script: `benchmarks/e2e/bench_lora.py --steps {args.steps}`",
        "- held-out greedy accuracy on 128 held-out prompts (validation at step 0 and at the last step);",
        "  whole-process wall time, 1-minute load average before/after each run (a shared machine: times are inflated)",
        "",
        "| run | config | step 0 | last step | wall | load before/after |",
        "|---|---|---|---|---|---|",
    ]
    for (label, config), res in zip(CONFIGS.items(), results.values()):
        val = res["val"]
        lines.append(
            f"| {label} | `{config}` | {val[0]['accuracy']:.3f} | {val[-1]['accuracy']:.3f} (step {val[-1]['step']}) "
            f"| {res['wall']:.0f} s | {res['load'][0]:.1f} / {res['load'][1]:.1f} |"
        )
    lines += ["", "Single runs, one seed each."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
