"""The precision-aware refit gate: its statistics against hand-computed numbers, its defaults per
precision, and a real vLLM engine (CPU build) fed a healthy push and three broken ones (stale
weights, one tensor skipped, a wrong dtype cast) after real optimizer steps of the bundled demo
model, in fp32 and in bf16 (trainer and engine both bf16). The healthy push must pass the default
limits; every broken one must trip them, naming the worst token, in fp32 and in bf16 (where the
skipped tensor is caught by the per-sequence log-ratio RMS, not by the mean: benchmarks/results/
refit_gate_bf16.md)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from grpo_train.config.schema import GRPOMasterConfig, LossConfig, PolicyConfig
from grpo_train.refit.check import (
    DEFAULT_LIMITS,
    RefitLimits,
    RefitMismatchError,
    gate_precision,
    gate_refit,
    refit_stats,
)
from grpo_train.train_step import probe_size, refit_limits

# The tied embedding / lm_head: the tensor whose miss is the classic refit bug.
SKIPPED = "model.embed_tokens.weight"


def bad_cast(t: torch.Tensor) -> torch.Tensor:
    """A wrong dtype on the way: fp32 weights rounded to bf16; bf16 weights' bytes read as fp16
    (same size, so a byte-bucket transport would take them)."""
    return t.to(torch.bfloat16).float() if t.dtype == torch.float32 else t.view(torch.float16).to(t.dtype)


# Optimizer steps at the demo's lr (3e-5) before the broken pushes: "stale" and "skipped" leave
# the engine at the weights of before them. One step moves a weight by ~3e-5, below bf16's
# resolution for most weights: in bf16 a refit one step stale is the same model (measured in
# benchmarks/results/refit_gate_bf16.md), so the gate can only see staleness that matters.
STEPS = 10


def test_statistics_are_the_hand_computed_ones():
    trainer, generator = [[-1.0, -2.0], [-0.5]], [[-1.1, -2.0], [-0.2]]
    d = [0.1, 0.0, -0.3]  # trainer - generator
    stats = refit_stats(trainer, generator)
    assert stats.tokens == 3
    assert stats.max_abs_diff == pytest.approx(0.3)
    assert stats.mean_abs_diff == pytest.approx(0.4 / 3)
    assert stats.token_mult_prob_error == pytest.approx(sum(math.exp(abs(x)) for x in d) / 3)
    assert stats.gen_kl_error == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    assert stats.worst == (1, 0, -0.5, -0.2)
    assert stats.seq_logratio_rms == pytest.approx(math.sqrt((0.1**2 + 0.3**2) / 3))  # sequence sums 0.1, -0.3
    with pytest.raises(
        RefitMismatchError,
        match=r"seq_logratio_rms .* 0\.183 > threshold 0\.15 "
        r"\(grpo\.refit_check\.max_seq_logratio_rms\); worst token: sequence 1, token 0",
    ):
        gate_refit(trainer, generator, RefitLimits(None, None, seq_logratio_rms=0.15))
    # the same |d| with alternating signs inside one sequence cancels: rounding noise, not a broken refit
    assert refit_stats([[0.1, 0.1]], [[0.0, 0.2]]).seq_logratio_rms == 0.0
    with pytest.raises(
        RefitMismatchError,
        match=r"mean_abs_diff .* 0\.133 > threshold 0\.1 "
        r"\(grpo\.refit_check\.max_mean_abs_logprob_diff\); worst token: sequence 1, token 0",
    ):
        gate_refit(trainer, generator, RefitLimits(max_abs_diff=None, mean_abs_diff=0.1))
    assert gate_refit(trainer, generator, RefitLimits(None, 0.2)).mean_abs_diff == pytest.approx(0.4 / 3)
    with pytest.raises(RefitMismatchError):
        gate_refit([[0.0]], [[float("nan")]], RefitLimits(None, 1.0))


def test_defaults_follow_the_coarser_precision_and_keys_override_them():
    assert gate_precision("float32", "float32") == "float32"
    assert gate_precision("bfloat16", "float32") == gate_precision("float32", "bfloat16") == "bfloat16"

    def cfg(policy: str, engine: str, **check) -> GRPOMasterConfig:
        return GRPOMasterConfig(
            policy={"precision": policy, "generation": {"vllm_cfg": {"precision": engine}}}, grpo={"refit_check": check}
        )

    assert refit_limits(cfg("float32", "float32")) == DEFAULT_LIMITS["float32"]
    assert refit_limits(cfg("bfloat16", "float32")) == DEFAULT_LIMITS["bfloat16"]
    assert refit_limits(cfg("bfloat16", "bfloat16", max_abs_logprob_diff=0.5)) == RefitLimits(
        0.5, DEFAULT_LIMITS["bfloat16"].mean_abs_diff, DEFAULT_LIMITS["bfloat16"].seq_logratio_rms
    )
    assert refit_limits(cfg("bfloat16", "bfloat16", max_seq_logratio_rms=0.2)).seq_logratio_rms == 0.2
    assert (probe_size(cfg("float32", "float32")), probe_size(cfg("bfloat16", "float32"))) == (4, 64)
    assert probe_size(cfg("bfloat16", "bfloat16", num_probe_sequences=8)) == 8
    assert DEFAULT_LIMITS["float32"].seq_logratio_rms is None and DEFAULT_LIMITS["bfloat16"].seq_logratio_rms == 0.05


# ------------------------------------------------------------------ a real engine, healthy and broken
def demo_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tokenizer.encode(f"{rng.randrange(100)}+{rng.randrange(100)}=", add_special_tokens=False) for _ in range(n)]


def rollout_batch(rollouts) -> dict[str, torch.Tensor]:
    """A GRPO-shaped batch of the engine's samples (random advantages: any real step will do)."""
    seqs = [r.prompt_ids + r.response_ids for r in rollouts]
    B, S = len(seqs), max(len(s) for s in seqs)
    batch = {
        "input_ids": torch.zeros(B, S, dtype=torch.long),
        "attention_mask": torch.zeros(B, S, dtype=torch.long),
        "token_mask": torch.zeros(B, S),
        "gen_logprobs": torch.zeros(B, S),
        "sample_mask": torch.ones(B),
    }
    for i, (r, s) in enumerate(zip(rollouts, seqs)):
        p = len(r.prompt_ids)
        batch["input_ids"][i, : len(s)] = torch.tensor(s)
        batch["attention_mask"][i, : len(s)] = 1
        batch["token_mask"][i, p : len(s)] = 1
        batch["gen_logprobs"][i, p : len(s)] = torch.tensor(r.response_logprobs)
    batch["advantages"] = torch.randn(B, generator=torch.Generator().manual_seed(0))[:, None] * batch["token_mask"]
    return batch


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_healthy_refit_passes_and_broken_ones_stop_the_run(precision):
    from transformers import AutoTokenizer

    from grpo_train.assets import builtin_model_path
    from grpo_train.generation import SamplingSpec, VllmGenerator
    from grpo_train.policy.worker import PolicyWorker

    path = str(builtin_model_path("arith-tiny"))
    tok = AutoTokenizer.from_pretrained(path)
    cfg = PolicyConfig(
        precision=precision,
        train_global_batch_size=32,
        train_micro_batch_size=32,
        logprob_batch_size=32,
        use_fused_kernels=False,
        max_grad_norm=1.0,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 3e-5, "weight_decay": 0.0}},
        generation={"temperature": 1.0},
    )
    worker = PolicyWorker(path, cfg, LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    engine = VllmGenerator(path, dtype=precision, max_model_len=32, seed=0, kv_cache_space_gb=0.25)
    try:
        before = {k: v.clone() for k, v in worker.weights().items()}  # in-process: not aliases of the live weights
        assert {t.dtype for t in before.values()} == {getattr(torch, precision)}
        engine.update_weights(before, 1)
        sampled = engine.generate(demo_prompts(tok, 8, 0), SamplingSpec(temperature=1.0, max_new_tokens=8, n=4))
        batch = rollout_batch([r for r in sampled if r.response_ids])
        for _ in range(STEPS):
            batch["prev_logprobs"] = worker.logprobs(batch)
            worker.train(batch)
        after = {k: v.clone() for k, v in worker.weights().items()}
        probe = [
            r
            for r in engine.generate(demo_prompts(tok, 8, 1), SamplingSpec(temperature=1.0, max_new_tokens=8, n=4))
            if r.response_ids
        ]
        seqs, plens = [r.prompt_ids + r.response_ids for r in probe], [len(r.prompt_ids) for r in probe]
        trainer = worker.score(seqs, plens)
        limits = DEFAULT_LIMITS[precision]

        engine.update_weights(after, 2)
        healthy = gate_refit(trainer, engine.score(seqs, plens), limits)
        print(f"[measure] {precision} healthy: {healthy}")
        assert healthy.tokens > 20
        broken = {
            "stale": before,
            "skipped": {**after, SKIPPED: before[SKIPPED]},
            "bad_cast": {k: bad_cast(v) for k, v in after.items()},
        }
        for version, (case, weights) in enumerate(broken.items(), start=3):
            engine.update_weights(weights, version)
            generated = engine.score(seqs, plens)
            print(f"[measure] {precision} {case}: {refit_stats(trainer, generated)}")
            with pytest.raises(RefitMismatchError, match=r"worst token: sequence \d+, token \d+") as info:
                gate_refit(trainer, generated, limits)
            assert info.value.stats.seq_logratio_rms > 1.5 * healthy.seq_logratio_rms, case
    finally:
        engine.shutdown()
