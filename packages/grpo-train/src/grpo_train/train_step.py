"""The GRPO step's components between rollout and optimizer: advantages, batch, logprobs, refit.

Each function is one phase of the loop, shared by the sync and async loops.
"""

from __future__ import annotations

import contextlib
import time

import ray
import torch

from grpo_train import weight_sync
from grpo_train.advantages import compute_advantages, groups_with_signal, scale_rewards, shape_rewards
from grpo_train.batch import Rollout, build_train_batch
from grpo_train.config.schema import GRPOMasterConfig


def prepare_batch(cfg: GRPOMasterConfig, rollouts: list[Rollout], pad_id: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Rewards -> (scaled, shaped) -> advantages -> [B, S] tensors, plus reward metrics."""
    n = cfg.grpo.num_generations_per_prompt
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    lengths = torch.tensor([len(r.response_ids) for r in rollouts])
    truncated = torch.tensor([r.truncated for r in rollouts])
    shaped = shape_rewards(scale_rewards(rewards, cfg.grpo.reward_scaling), lengths, truncated, cfg.grpo.reward_shaping)
    sample_mask = torch.tensor([r.loss_multiplier for r in rollouts], dtype=torch.float32)
    if cfg.grpo.overlong_filtering:
        sample_mask = sample_mask * (~truncated).float()
    advantages = compute_advantages(shaped, sample_mask > 0, n, cfg.grpo)
    batch = build_train_batch(rollouts, advantages, sample_mask, pad_id, cfg.policy.make_sequence_length_divisible_by)
    signal = groups_with_signal(shaped, n)
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rollouts) > 1 else 0.0,
        "accuracy": float((rewards > 0).float().mean()),
        "shaped_reward_mean": float(shaped.mean()),
        "advantage_abs_mean": float(advantages.abs().mean()),
        "response_length": float(lengths.float().mean()),
        "truncated_fraction": float(truncated.float().mean()),
        "groups_with_signal": signal.num_kept / max(signal.keep.numel(), 1),
        "num_samples": float(len(rollouts)),
        "masked_samples": float((sample_mask == 0).sum()),
    }
    return batch, metrics


def add_logprobs(cfg: GRPOMasterConfig, policy, batch: dict[str, torch.Tensor]) -> None:
    """prev (and, when beta > 0, ref) logprobs of the batch under the start-of-step weights."""
    batch["prev_logprobs"] = ray.get(policy.logprobs.remote(batch))
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        batch["ref_logprobs"] = ray.get(policy.logprobs.remote(batch, reference=True))


def push_weights(policy, generator, version: int) -> float:
    """Send the policy's weights to the generator over the run's weight transport
    (`grpo_train.weight_transport`, attached in setup); seconds taken. A bare actor pair
    (tests) goes through the object store (the ObjectRef travels, not a driver copy)."""
    if not hasattr(policy, "push_weights"):
        return ray.get(generator.update_weights.remote(policy.weights.remote(), version))
    start = time.perf_counter()
    policy.push_weights(version)
    return time.perf_counter() - start


def refit_limits(cfg: GRPOMasterConfig) -> weight_sync.RefitLimits:
    """grpo.refit_check's thresholds, a null one taking the default of the trainer/engine pair's
    coarser precision (the HF generator runs in policy.precision)."""
    engine = cfg.policy.generation.vllm_cfg.precision if cfg.policy.generation.backend == "vllm" else cfg.policy.precision
    default = weight_sync.DEFAULT_LIMITS[weight_sync.gate_precision(cfg.policy.precision, engine)]
    check = cfg.grpo.refit_check
    return weight_sync.RefitLimits(
        max_abs_diff=check.max_abs_logprob_diff if check.max_abs_logprob_diff is not None else default.max_abs_diff,
        mean_abs_diff=(check.max_mean_abs_logprob_diff if check.max_mean_abs_logprob_diff is not None
                       else default.mean_abs_diff))


def check_refit(cfg: GRPOMasterConfig, policy, generator, probe: list[Rollout]) -> dict[str, float]:
    """Score the probe rollouts in trainer and generator; raise above the configured thresholds
    (`refit_limits`). Returns the refit/* metrics."""
    sequences = [r.prompt_ids + r.response_ids for r in probe if r.response_ids]
    prompt_lens = [len(r.prompt_ids) for r in probe if r.response_ids]
    if not sequences:
        return {}
    trainer = ray.get(policy.score.remote(sequences, prompt_lens))
    generated = ray.get(generator.score.remote(sequences, prompt_lens))
    return weight_sync.gate_refit(trainer, generated, refit_limits(cfg)).metrics()


class PhaseTimer:
    """Wall time per named phase of a step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def metrics(self) -> dict[str, float]:
        out = {f"timing/{k}_s": v for k, v in self.seconds.items()}
        out["timing/step_s"] = time.perf_counter() - self._start
        return out

