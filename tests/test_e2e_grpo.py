"""`grpo train` end to end on real parts (vLLM CPU build, Ray, HF policy), as a user runs it.

The demo config is shortened with command-line overrides so each run takes well under a
minute of training; Ray and vLLM start-up dominate (about 55 CPU-seconds of imports per run on
2 cores), so one run carries the checks of several features where they do not interfere: the
short run samples dynamically, the kill-and-resume runs are the multi-turn runs.
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

SHORT = [
    "grpo.num_prompts_per_step=8",
    "policy.train_global_batch_size=64",
    "policy.train_micro_batch_size=32",
    "grpo.max_val_samples=32",
    "grpo.val_at_start=false",
]
# Multi-turn: arithmetic prompts routed to the number-guessing environment, up to 3 turns.
MULTI_TURN = [
    "grpo.max_rollout_turns=3",
    "data.train.env_name=number_guess",
    "+env.number_guess.num_workers=1",
    "+env.number_guess.max_turns=3",
]
# Wall-clock measurements differ between runs; everything else must match exactly.
NONDETERMINISTIC = ("timing/", "tokens_per_s")


def grpo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "grpo_cli.main", *args]


def run_grpo(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(grpo_cmd(*args), capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def deterministic(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(NONDETERMINISTIC)} for row in rows]


@pytest.mark.slow
def test_short_run_with_dynamic_sampling_writes_metrics_plot_logs_and_checkpoints(tmp_path):
    """Four steps with validation, checkpoints, plot, TensorBoard and wandb; DAPO dynamic sampling
    is on (it changes which groups a step keeps, none of what this run writes): every step keeps
    num_prompts_per_step groups, each with reward spread unless the rounds ran out."""
    run_dir = tmp_path / "run"
    args = [
        "train",
        "--run-dir",
        str(run_dir),
        *SHORT,
        "grpo.max_num_steps=4",
        "grpo.val_period=2",
        "checkpointing.save_period=2",
        "grpo.use_dynamic_sampling=true",
        "grpo.dynamic_sampling_max_gen_batches=4",
    ]
    result = run_grpo(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = read_metrics(run_dir)
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in val] == [2, 4]
    for key in (
        "reward_mean",
        "accuracy",
        "loss",
        "kl_penalty",
        "grad_norm",
        "lr",
        "token_mult_prob_error",
        "gen_kl_error",
        "policy_kl_error",
        "js_divergence_error",
        "sampling_importance_ratio",
        "approx_entropy",
        "clip_fraction",
        "response_length",
        "tokens_per_s",
        "timing/generate_s",
        "timing/reward_s",
        "timing/logprob_s",
        "timing/train_s",
        "timing/refit_s",
        "refit/max_abs_logprob_diff",
    ):
        assert key in train[0], key
    # The refit check passed every step: trainer and vLLM agree on the new weights.
    assert all(r["refit/max_abs_logprob_diff"] < 1e-3 for r in train)
    # On-policy: the generator's and trainer's logprobs of the sampled tokens agree.
    assert all(abs(r["token_mult_prob_error"] - 1.0) < 1e-3 for r in train)
    assert 0.0 <= val[-1]["accuracy"] <= 1.0
    for r in train:
        assert r["num_samples"] == 8 * 8  # the batch keeps num_prompts_per_step groups
        assert 1 <= r["dynamic_sampling/rounds"] <= 4
        if r["dynamic_sampling/groups_short"] == 0:
            assert r["groups_with_signal"] == 1.0  # every kept group has reward spread
    assert (run_dir / "plots" / "training.png").stat().st_size > 10_000
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        "step_2",
        "step_4",
    ]
    assert list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert list((run_dir / "wandb").rglob("*.wandb"))
    for word in ("plot:", "metrics:", "checkpoints:"):
        assert word in result.stderr
    # Running again finds the run complete from its newest checkpoint and says so, before Ray and
    # vLLM start ("run folder" is said just before Ray starts).
    again = run_grpo(*args, cwd=tmp_path)
    assert again.returncode == 0 and "already finished 4 steps" in again.stderr, again.stderr[-4000:]
    assert "run folder" not in again.stderr


@pytest.mark.slow
def test_kill_and_resume_gives_bitwise_equal_weights_and_metrics(tmp_path):
    """In LoRA mode (policy.dtensor_cfg.lora_cfg, merged refit), bf16 mixed precision (trainer and
    engine bf16; fp32 masters and AdamW state of the adapters) and a multi-turn rollout, the
    strictest case: the resumed run must restore the adapters' fp32 masters, not re-widen a bf16
    export, to stay bitwise, and the PEFT adapters, the merged bf16 export and every metric must
    match the uninterrupted run's. (Full-weight bf16 resume is the same MasterWeights code over every
    parameter: test_precision.py; fp32 resume, the masters being the model: test_checkpoint.py;
    full-weight single-turn kill-and-resume through `grpo train`: test_e2e_ppo.py and test_e2e_async.py.)
    Four steps, killed after the step-2 checkpoint: the resumed process runs steps 3 and 4.

    Multi-turn (#21): the rollout is the lockstep multi-turn one (number guessing, up to 3 turns),
    so the kill lands inside a step's conversations; the resumed step restarts them from the
    checkpoint's step boundary. Conversation state lives in the driver's rollout, never in the env
    actors (packages/grpo-envs/tests/test_tool_env.py::test_env_actors_carry_no_episode_state shows the
    envs are stateless), so a fresh process repeats the turns exactly: the same env metrics, turns
    and rewards per step. Both runs are also the multi-turn training runs of this file: every step
    of each has wrong first guesses that got further turns (1 < turns_mean <= 3), env metrics, and
    a refit check that passed (a failing check stops the run)."""
    from safetensors.torch import load_file

    common = [
        *SHORT,
        "grpo.max_num_steps=4",
        "grpo.val_period=0",
        "grpo.val_at_end=false",
        "checkpointing.save_period=2",
        "checkpointing.keep_top_k=null",
        "logger.wandb_enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.plot_enabled=false",
        "policy.precision=bfloat16",
        "policy.generation.vllm_cfg.precision=bfloat16",
        "policy.dtensor_cfg.lora_cfg.enabled=true",
        "policy.optimizer.kwargs.lr=1e-4",
        *MULTI_TURN,
    ]
    # The uninterrupted run and the one to be killed start side by side (start-up is mostly waiting).
    straight = tmp_path / "straight"
    uninterrupted = subprocess.Popen(
        grpo_cmd("train", "--run-dir", str(straight), *common),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    # Same run, killed with SIGKILL once the step-2 checkpoint exists, then restarted.
    resumed = tmp_path / "resumed"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            grpo_cmd("train", "--run-dir", str(resumed), *common),
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.time() + 600
    while not (resumed / "checkpoints" / "step_2" / "trainer_state.json").exists():
        assert proc.poll() is None, (
            "the run ended before its step-2 checkpoint",
            (tmp_path / "killed.log").read_text()[-4000:],
        )
        assert time.time() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (resumed / "checkpoints" / "step_4").exists()
    # The resumed run starts up while the uninterrupted one finishes its last steps.
    resume = subprocess.Popen(
        grpo_cmd("train", "--run-dir", str(resumed), *common),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        _, err = uninterrupted.communicate(timeout=600)
        assert uninterrupted.returncode == 0, err[-4000:]
        _, err = resume.communicate(timeout=600)
        assert resume.returncode == 0, err[-4000:]
        assert "resumed from" in err
    finally:
        for run in (uninterrupted, resume):
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()

    # The merged bf16 export, the adapters' fp32 masters and the PEFT adapters (saved in fp32).
    for weights, dtype in (
        ("model/*.safetensors", "bfloat16"),
        ("master_weights.safetensors", "float32"),
        ("adapter/*.safetensors", "float32"),
    ):
        a = load_file(next((straight / "checkpoints" / "step_4" / "policy").glob(weights)))
        b = load_file(next((resumed / "checkpoints" / "step_4" / "policy").glob(weights)))
        assert a.keys() == b.keys() and a
        assert {t.dtype for t in a.values()} == {torch_dtype(dtype)}, weights
        if weights != "model/*.safetensors":  # only adapters train and are kept as masters
            assert all("lora_" in key for key in a), weights
            assert all(a[k].abs().sum() > 0 for k in a if "lora_B" in k), weights  # trained away from B = 0
        for key in a:
            assert a[key].equal(b[key]), (weights, key)
    rows_a, rows_b = deterministic(read_metrics(straight)), deterministic(read_metrics(resumed))
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    assert rows_a == rows_b
    # The runs were multi-turn: wrong first guesses got further turns, scored by the env.
    assert all(1.0 < r["turns_mean"] <= 3.0 for r in rows_b)
    assert all("env/number_guess/solved" in r and "refit/max_abs_logprob_diff" in r for r in rows_b)


def test_missing_local_model_fails_at_startup_with_one_line(tmp_path):
    result = run_grpo("train", "policy.model_name=/nonexistent/model", cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "policy.model_name: local model folder '/nonexistent/model' does not exist" in result.stderr


def test_hub_model_without_network_says_what_to_set(tmp_path):
    env_cmd = ["train", "policy.model_name=someone/not-a-cached-model"]
    result = subprocess.run(
        grpo_cmd(*env_cmd),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "set policy.model_name=/path/to/local/copy" in result.stderr


@pytest.mark.parametrize(
    "override, words",
    [
        ("grpo.async_grpo.enabled=true", "grpo.async_grpo requires loss_fn.use_importance_sampling_correction: true"),
        (
            "grpo.async_grpo.enabled=true policy.generation.backend=hf",
            "grpo.async_grpo needs policy.generation.backend: vllm",
        ),
        ("policy.generation.weight_transport=ipc", "policy.generation.weight_transport: 'ipc' needs GPUs"),
        ("policy.num_workers=3", "must be a multiple of policy.num_workers (3)"),
    ],
)
def test_unavailable_features_are_refused_at_startup(tmp_path, override, words):
    extra = ["loss_fn.use_importance_sampling_correction=true"] if "backend=hf" in override else []
    result = run_grpo("train", *override.split(), *extra, cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert words in result.stderr


@pytest.mark.slow
def test_bf16_mixed_precision_demo_learns_as_fp32(tmp_path):
    """The demo with policy.precision=bfloat16 and a bf16 vLLM engine (vLLM's CPU build runs
    bf16, slowly on AVX2) against the same run in fp32, same seeds, side by side: held-out
    accuracy rises in both and ends within a few points; the bf16 refit gate (its precision's
    default limits) passes every step; the checkpoint exports bf16 and keeps fp32 masters."""
    from safetensors.torch import load_file

    common = [
        *SHORT,
        "grpo.max_num_steps=10",
        "grpo.val_period=10",
        "grpo.val_at_start=true",
        "grpo.max_val_samples=128",
        "checkpointing.save_period=10",
        "logger.wandb_enabled=false",
        "logger.tensorboard_enabled=false",
        "logger.plot_enabled=false",
    ]
    bf16 = ["policy.precision=bfloat16", "policy.generation.vllm_cfg.precision=bfloat16"]
    runs = {name: tmp_path / name for name in ("fp32", "bf16")}
    procs = {
        name: subprocess.Popen(
            grpo_cmd("train", "--run-dir", str(run), *common, *(bf16 if name == "bf16" else [])),
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, run in runs.items()
    }
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, (name, err[-4000:])
    acc = {}
    for name, run in runs.items():
        rows = read_metrics(run)
        val = [r["accuracy"] for r in rows if r["split"] == "val"]
        assert len(val) == 2, name
        acc[name] = val
        train = [r for r in rows if r["split"] == "train"]
        assert all("refit/mean_abs_logprob_diff" in r for r in train), name
    assert acc["fp32"][1] - acc["fp32"][0] > 0.1, acc
    assert acc["bf16"][1] - acc["bf16"][0] > 0.1, acc
    assert abs(acc["bf16"][1] - acc["fp32"][1]) <= 0.06, acc
    ckpt = runs["bf16"] / "checkpoints" / "step_10" / "policy"
    assert {t.dtype for t in load_file(next((ckpt / "model").glob("*.safetensors"))).values()} == {
        torch_dtype("bfloat16")
    }
    assert (ckpt / "master_weights.safetensors").is_file()


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)
