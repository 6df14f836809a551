"""`grpo train --config ppo_arith_tiny.yaml` end to end on real parts (vLLM CPU build, Ray, HF
policy and value model): the critic learns, held-out accuracy rises, kill-and-resume is exact.

One uninterrupted run serves both tests (Ray and vLLM start-up dominate the wall time).
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

COMMON = [
    "--config",
    "ppo_arith_tiny.yaml",
    "grpo.max_num_steps=6",
    "grpo.val_period=0",
    "grpo.val_at_start=true",
    "grpo.val_at_end=true",
    "grpo.max_val_samples=64",
    "checkpointing.save_period=3",
    "checkpointing.keep_top_k=null",
    "logger.wandb_enabled=false",
    "logger.tensorboard_enabled=false",
    "logger.plot_enabled=false",
]
NONDETERMINISTIC = ("timing/", "tokens_per_s")


def grpo_cmd(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "grpo_cli.main", "train", "--run-dir", str(run_dir), *COMMON, *args]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def kill_after_checkpoint(proc: subprocess.Popen, run_dir: Path, step: int, deadline: float) -> None:
    while not (run_dir / "checkpoints" / f"step_{step}" / "trainer_state.json").exists():
        assert proc.poll() is None, f"the run ended before its step-{step} checkpoint"
        assert time.time() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, tuple[int, str]]:
    """(an uninterrupted run, the same run SIGKILLed after its step-3 checkpoint and then resumed,
    (the resumed process's exit code, its stderr)). The first two start together and the resumed
    one starts while the uninterrupted run finishes its last steps: start-up is mostly waiting, so
    overlapping them saves start-ups. Their Ray heads take turns (grpo_train.setup.start_local_head):
    two heads started in the same second once made the victim's raylet abort before its first step
    (tests/test_setup_ray.py)."""
    root = tmp_path_factory.mktemp("ppo")
    straight, killed = root / "straight", root / "killed"
    killed.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start_victim() -> subprocess.Popen:
        with open(root / "killed.log", "w") as log:
            return subprocess.Popen(
                grpo_cmd(killed), cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )

    victim = start_victim()
    resume = None
    try:
        with open(root / "straight.log", "w") as log:
            full = subprocess.Popen(grpo_cmd(straight), cwd=root, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                kill_after_checkpoint(victim, killed, 3, time.time() + 600)
            except AssertionError as exc:
                raise AssertionError((root / "killed.log").read_text()[-4000:]) from exc
            assert not (killed / "checkpoints" / "step_6").exists()
            resume = subprocess.Popen(
                grpo_cmd(killed),
                cwd=root,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                env=env,
            )
            assert full.wait(timeout=600) == 0, (root / "straight.log").read_text()[-4000:]
            _, err = resume.communicate(timeout=600)
    finally:
        for proc in (victim, resume):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return straight, killed, (resume.returncode, err)


@pytest.fixture(scope="module")
def straight_run(runs) -> Path:
    return runs[0]


@pytest.mark.slow
def test_ppo_value_loss_falls_and_held_out_accuracy_rises(straight_run):
    rows = read_metrics(straight_run)
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in val] == [0, 6]
    for key in (
        "value_loss",
        "value_clip_fraction",
        "value_grad_norm",
        "value_explained_variance",
        "returns_mean",
        "values_mean",
        "advantage_abs_mean",
        "reward_mean",
        "timing/values_s",
    ):
        assert key in train[0], key
    # Step 1 trains the critic alone (policy_training_start_step: 2): no policy loss, no refit.
    assert [r["policy_trained"] for r in train] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert "loss" not in train[0] and all("loss" in r for r in train[1:])
    assert all(r["refit/max_abs_logprob_diff"] < 1e-3 for r in train[1:])
    # Each step's value loss is measured on a fresh rollout before the critic trains on it.
    losses = [r["value_loss"] for r in train]
    # With a zero-initialised head the first loss is 1/2 E[R^2]; once the critic has learnt the
    # mean reward it is near 1/2 Var[R] (seeds 42 and 7: 0.25 -> <= 0.12).
    assert max(losses[3:]) < 0.6 * losses[0], losses
    assert val[-1]["accuracy"] > val[0]["accuracy"] + 0.05, [v["accuracy"] for v in val]
    value_dir = straight_run / "checkpoints" / "step_6" / "value"
    assert (value_dir / "model" / "value_head.safetensors").is_file() and (
        value_dir / "optimizer.safetensors"
    ).is_file()


@pytest.mark.slow
def test_ppo_kill_and_resume_gives_bitwise_equal_policy_value_and_metrics(runs):
    from safetensors.torch import load_file

    straight_run, resumed, (returncode, stderr) = runs
    assert returncode == 0, stderr[-4000:]
    assert "resumed from" in stderr

    for part in ("policy/model", "value/model"):
        for shard in sorted((straight_run / "checkpoints" / "step_6" / part).glob("*.safetensors")):
            a, b = load_file(shard), load_file(resumed / "checkpoints" / "step_6" / part / shard.name)
            assert a.keys() == b.keys()
            for key in a:
                assert a[key].equal(b[key]), f"{part}/{shard.name}: {key}"

    def deterministic(run_dir: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC)} for r in read_metrics(run_dir)]

    assert deterministic(straight_run) == deterministic(resumed)


def grpo_config(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grpo_cli.main", "config", *args], capture_output=True, text=True, timeout=120
    )


def test_builtin_ppo_configs_are_listed_and_valid():
    listed = grpo_config("list").stdout.split()
    assert {"ppo_math_1B.yaml", "ppo_arith_tiny.yaml"} <= set(listed)
    for name in ("ppo_math_1B.yaml", "ppo_arith_tiny.yaml"):
        result = grpo_config("validate", name)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("config", "override", "message"),
    [
        (
            "ppo_math_1B.yaml",
            "ppo.adv_estimator.name=rloo",
            "ppo.adv_estimator.name: 'rloo' is group-relative; use GRPO",
        ),
        ("grpo_math_1B.yaml", "+value.precision=float32", "value: only PPO has a value model; add a `ppo:` section"),
        (
            "ppo_arith_tiny.yaml",
            "value.train_global_batch_size=96",
            "must be a multiple of value.train_global_batch_size (96)",
        ),
        (
            "ppo_math_1B.yaml",
            "loss_fn.use_kl_in_reward=true",
            "loss_fn.use_kl_in_reward: the in-reward KL coefficient is loss_fn.reference_policy_kl_penalty, which is 0",
        ),
        (
            "ppo_arith_tiny.yaml",
            "grpo.use_dynamic_sampling=true grpo.num_generations_per_prompt=1",
            "needs grpo.num_generations_per_prompt >= 2",
        ),
    ],
)
def test_bad_ppo_configs_name_the_key(config, override, message):
    result = grpo_config("validate", config, *override.split())
    assert result.returncode == 2 and message in result.stderr, result.stderr
