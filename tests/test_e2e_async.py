"""Async GRPO end to end on real parts (vLLM's async engine on CPU, Ray actors, HF policy).

`grpo train --config grpo_arith_tiny_async.yaml`, shortened with overrides as in
test_e2e_grpo.py. The replay buffer's records (every group handed to a step, with the weight
version that generated it) are saved in each checkpoint and read back here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_train.state_io import load_state

SHORT = [
    "grpo.num_prompts_per_step=8",
    "policy.train_global_batch_size=64",
    "policy.train_micro_batch_size=32",
    "grpo.max_val_samples=32",
    "grpo.val_at_start=false",
    "logger.wandb_enabled=false",
    "logger.tensorboard_enabled=false",
    "logger.plot_enabled=false",
]
ASYNC = ["--config", "grpo_arith_tiny_async.yaml"]
# Wall-clock figures differ between runs (and so does the buffer's size when a step takes it);
# everything else must match exactly.
TIMING = (
    "timing/",
    "tokens_per_s",
    "async/generation_idle_s",
    "async/trainer_starvation_s",
    "async/exposed_generation_s",
    "async/buffer_size",
)


def grpo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "grpo_cli.main", "train", *args]


def start_grpo(*args: str, cwd: Path) -> subprocess.Popen:
    """A run in the background: start-up (Ray, vLLM) is mostly waiting, so two runs side by side
    take far less wall time than one after the other; their results do not depend on timing."""
    return subprocess.Popen(
        grpo_cmd(*args),
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )


def finish(proc: subprocess.Popen) -> str:
    """Wait for a background run; its stderr."""
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return err


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


def buffer_records(checkpoint: Path) -> list[dict]:
    from grpo_data.records import DatumSpec
    from grpo_train.batch import Rollout
    from grpo_train.replay_buffer import GroupEntry

    return load_state(checkpoint, "replay_buffer", types=(GroupEntry, Rollout, DatumSpec))["records"]


@pytest.mark.slow
def test_zero_age_async_reproduces_the_sync_loop(tmp_path):
    """max_trajectory_age_steps 0: the batch of step t comes from weights t-1, as in the sync loop,
    with the same per-step seeds and the whole batch submitted at once, so every metric matches
    exactly (the async engine samples what the offline engine samples). The async run pushes its
    weights over the collective transport (buckets broadcast into the engine's worker), the sync
    run over the object store: the refit check and every later step match all the same."""
    common = [
        *SHORT,
        "grpo.max_num_steps=3",
        "grpo.val_period=0",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        "loss_fn.use_importance_sampling_correction=true",
    ]
    sync = start_grpo("--run-dir", str(tmp_path / "sync"), *common, cwd=tmp_path)
    run = start_grpo(
        *ASYNC,
        "--run-dir",
        str(tmp_path / "async"),
        *common,
        "grpo.async_grpo.max_trajectory_age_steps=0",
        "policy.generation.weight_transport=collective",
        "policy.generation.refit_buffer_size_gb=0.0005",
        cwd=tmp_path,
    )
    finish(sync)
    finish(run)
    rows_sync = metrics(tmp_path / "sync")
    rows_async = metrics(tmp_path / "async")
    assert [r["step"] for r in rows_async] == [1, 2, 3]
    for a, s in zip(rows_async, rows_sync):
        assert a["async/trajectory_age_max"] == 0
        assert {k: a[k] for k in s} == s


@pytest.mark.slow
def test_kill_and_resume_trains_every_prompt_once_within_the_age_bound(tmp_path):
    from safetensors.torch import load_file

    common = [
        *ASYNC,
        *SHORT,
        "grpo.max_num_steps=6",
        "grpo.val_period=0",
        "grpo.val_at_start=true",
        "checkpointing.save_period=3",
        "checkpointing.keep_top_k=null",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    uninterrupted = start_grpo("--run-dir", str(straight), *common, cwd=tmp_path)
    # Killed as soon as the step-3 checkpoint exists: the collector is then generating step 5's
    # batch (its weights, version 3, were pushed before the save), so generation is in flight.
    proc = subprocess.Popen(
        grpo_cmd("--run-dir", str(resumed), *common),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while not (resumed / "checkpoints" / "step_3" / "trainer_state.json").exists():
        assert proc.poll() is None, "the run ended before its step-3 checkpoint"
        assert time.time() < deadline
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert load_state(resumed / "checkpoints" / "step_3", "collector")["next_target"] == 5
    # The resumed run starts up while the uninterrupted one finishes its last steps.
    resume = start_grpo("--run-dir", str(resumed), *common, cwd=tmp_path)
    try:
        finish(uninterrupted)
        records = buffer_records(straight / "checkpoints" / "step_6")
        # One step behind: step s trains on groups from weights s-2 (s-1 at the first step), never older.
        assert [r["step"] for r in records] == [s for s in range(1, 7) for _ in range(8)]
        assert all(0 <= r["age"] <= 1 and not r["dropped"] for r in records)
        assert [r["age"] for r in records if r["step"] > 1] == [1] * 40
        val = [r for r in metrics(straight) if r["split"] == "val"]
        assert [r["step"] for r in val] == [0, 6]
        assert val[1]["accuracy"] > val[0]["accuracy"]  # async training raises held-out accuracy
        assert "resumed from" in finish(resume)
    finally:
        if resume.poll() is None:
            os.killpg(resume.pid, signal.SIGKILL)

    # Every prompt was trained on exactly once, at the same step and from the same weights.
    assert buffer_records(resumed / "checkpoints" / "step_6") == records
    a = load_file(next((straight / "checkpoints" / "step_6" / "policy" / "model").glob("*.safetensors")))
    b = load_file(next((resumed / "checkpoints" / "step_6" / "policy" / "model").glob("*.safetensors")))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert metrics(straight) == metrics(resumed)
