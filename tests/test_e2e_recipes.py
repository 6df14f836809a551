"""Built-in method recipes end to end: `grpo train` on the offline demo task, as a user runs them.

REINFORCE++-baseline (a new advantage estimator, whitening over the batch, the KL in the reward
instead of the loss) runs six steps; held-out accuracy must rise from the start-of-run
validation. One run only: CI time is tight (344 s on the 2-core machine at load 8.4), and the
other recipes' parts have their own hand-computed tests; add a name to RECIPES to run another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = ("reinforce_pp_arith_tiny.yaml",)
SHORT = [
    "grpo.max_num_steps=6",
    "grpo.num_prompts_per_step=8",
    "policy.train_global_batch_size=64",
    "policy.train_micro_batch_size=32",
    "grpo.max_val_samples=128",
    "grpo.val_at_start=true",
    "grpo.val_period=0",
    "grpo.val_at_end=true",
    "checkpointing.enabled=false",
    "logger.wandb_enabled=false",
    "logger.tensorboard_enabled=false",
    "logger.plot_enabled=false",
]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_method_recipe_raises_held_out_accuracy(name, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo_cli.main", "train", "--config", name, "--run-dir", str(run_dir), *SHORT]
    result = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = read_metrics(run_dir)
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in val] == [0, 6]
    assert val[-1]["accuracy"] > val[0]["accuracy"], (val[0]["accuracy"], val[-1]["accuracy"])
    if name.startswith("reinforce_pp"):
        assert all(r["kl_penalty"] == 0.0 for r in train)  # the KL is in the reward, not the loss
        assert all("reward_kl_penalty" in r for r in train)
