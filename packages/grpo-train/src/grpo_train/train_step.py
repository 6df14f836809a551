"""The GRPO step's components between rollout and optimizer: advantages, batch, logprobs, refit.

The batch components of the step (`step.py` strings them into phases), shared by the loops.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from grpo_train.advantages import groups_with_signal, scale_rewards, shape_rewards
from grpo_train.batch import Rollout, build_train_batch, invalid_call_token_mask, seq_mult_prob_error
from grpo_train.config.schema import GRPOConfig, GRPOMasterConfig, LossConfig, PolicyConfig
from grpo_train.group_estimators import GroupBatch, estimate_advantages, kl_in_reward
from grpo_train.refit import check as refit_check


def prepare_batch(
    grpo: GRPOConfig, policy: PolicyConfig, rollouts: list[Rollout], pad_id: int
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Rewards -> (scaled, shaped) -> [B, S] tensors, plus reward metrics; advantages come in
    `add_advantages`, after the logprobs (the in-reward KL and the logprob-error mask need them).

    `sample_mask` already has overlong filtering applied; the baseline of `add_advantages` still
    counts the truncated samples (shared/GRPO-MATH.md, 6).
    """
    n = grpo.num_generations_per_prompt
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    lengths = torch.tensor([len(r.response_ids) for r in rollouts])
    truncated = torch.tensor([r.truncated for r in rollouts])
    shaped = shape_rewards(scale_rewards(rewards, grpo.reward_scaling), lengths, truncated, grpo.reward_shaping)
    sample_mask = torch.tensor([r.loss_multiplier for r in rollouts], dtype=torch.float32)
    if grpo.overlong_filtering:
        sample_mask = sample_mask * (~truncated).float()
    batch = build_train_batch(
        rollouts, torch.zeros(len(rollouts)), sample_mask, pad_id, policy.make_sequence_length_divisible_by
    )
    batch["scores"] = shaped  # [B] reward after scaling and shaping
    signal = groups_with_signal(shaped, n)
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rollouts) > 1 else 0.0,
        "accuracy": float((rewards > 0).float().mean()),
        "shaped_reward_mean": float(shaped.mean()),
        "response_length": float(lengths.float().mean()),
        "truncated_fraction": float(truncated.float().mean()),
        "groups_with_signal": signal.num_kept / max(signal.keep.numel(), 1),
        "num_samples": float(len(rollouts)),
    }
    return batch, metrics


def reward_components(rollouts: list[Rollout]) -> torch.Tensor:
    """[B, K] the environments' per-sample reward components (metadata 'reward_components', a
    name -> value dict), columns in sorted-name order; every sample must name the same components."""
    names = sorted((rollouts[0].env_metadata.get("reward_components") or {}).keys())
    rows = []
    for i, r in enumerate(rollouts):
        comp = r.env_metadata.get("reward_components") or {}
        if sorted(comp) != names:
            raise ValueError(
                f"sample {i}: reward_components {sorted(comp)} differ from sample 0's {names} "
                f"(grpo.adv_estimator.name 'gdpo' needs the same components on every sample)"
            )
        rows.append([float(comp[k]) for k in names])
    return torch.tensor(rows, dtype=torch.float32).view(len(rollouts), len(names))


def add_advantages(
    grpo: GRPOConfig, loss: LossConfig, rollouts: list[Rollout], batch: dict[str, torch.Tensor]
) -> dict[str, float]:
    """The estimator's [B, S] advantages into `batch` (after `add_logprobs`), then the logprob-error
    mask; returns their metrics. Masks set after the advantages (overlong filtering, logprob error)
    keep a sample in its group's baseline and only zero its loss."""
    baseline_mask = torch.tensor([r.loss_multiplier for r in rollouts], dtype=torch.float32)  # [B]
    components = reward_components(rollouts) if grpo.adv_estimator.name == "gdpo" else None  # [B, K]
    kl = None
    if loss.use_kl_in_reward:
        kl = kl_in_reward(
            batch["prev_logprobs"],
            batch["ref_logprobs"],
            batch["token_mask"],
            loss.reference_policy_kl_penalty,
            loss.reference_policy_kl_type,
            loss.kl_input_clamp_value,
            loss.kl_output_clamp_value,
        )
    x = GroupBatch(
        rewards=batch["scores"],
        valid=baseline_mask > 0,
        token_mask=batch["token_mask"],
        group_size=grpo.num_generations_per_prompt,
        components=components,
        kl_penalty=kl,
    )
    batch["advantages"] = estimate_advantages(grpo, x)
    mask = batch["token_mask"]
    metrics: dict[str, float] = {}
    if grpo.invalid_tool_call_advantage is not None:
        metrics["invalid_tool_call_tokens"] = replace_invalid_call_advantages(
            batch, rollouts, grpo.invalid_tool_call_advantage
        )
    metrics["advantage_abs_mean"] = float((batch["advantages"].abs() * mask).sum() / mask.sum().clamp(min=1))
    if kl is not None:
        metrics["reward_kl_penalty"] = float(kl.sum() / mask.sum().clamp(min=1))
    metrics |= mask_by_logprob_error(grpo, batch)
    metrics["masked_samples"] = float((batch["sample_mask"] == 0).sum())
    return metrics


def replace_invalid_call_advantages(batch: dict[str, torch.Tensor], rollouts: list[Rollout], value: float) -> float:
    """grpo.invalid_tool_call_advantage: the generated tokens of turns with invalid tool calls
    (`Rollout.invalid_call_mask`) take `value` as their advantage; returns how many tokens did."""
    adv = batch["advantages"]
    invalid = invalid_call_token_mask(rollouts, (adv.shape[0], adv.shape[1])) & (batch["token_mask"] > 0)
    batch["advantages"] = torch.where(invalid, torch.full_like(adv, value), adv)
    return float(invalid.sum())


def mask_by_logprob_error(grpo: GRPOConfig, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """grpo.seq_logprob_error_threshold: sample_mask 0 for sequences whose seq_mult_prob_error
    exceeds it (NeMo RL's definition); the max error is logged either way (by the policy's train
    call when prev comes from the training forward: `reuses_prev_logprobs`, threshold null)."""
    if "prev_logprobs" not in batch:
        return {}
    err = seq_mult_prob_error(batch)
    metrics = {"max_seq_mult_prob_error": float(err.max()) if err.numel() else 1.0}
    threshold = grpo.seq_logprob_error_threshold
    if threshold is None:
        return metrics
    was = batch["sample_mask"] > 0
    drop = was & (err > threshold)
    batch["sample_mask"] = torch.where(drop, torch.zeros_like(batch["sample_mask"]), batch["sample_mask"])
    metrics["num_masked_seqs_by_logprob_error"] = float(drop.sum())
    return metrics


def reuses_prev_logprobs(cfg: GRPOMasterConfig) -> bool:
    """Whether the policy may take prev from the training forward (PolicyWorker.reuses_prev, which
    also checks the batch: one optimizer step, same micro-batches): sync GRPO on one worker, and
    nothing reads prev before training (the in-reward KL, the logprob-error mask). Async and PPO
    keep their own pass (their prev must be the weights the samples came from, or several steps' start)."""
    return (
        cfg.algorithm == "grpo"
        and not cfg.grpo.async_grpo.enabled
        and cfg.policy.num_workers == 1
        and not cfg.loss_fn.use_kl_in_reward
        and cfg.grpo.seq_logprob_error_threshold is None
    )


@dataclass(frozen=True)
class LogprobPlan:
    """The logprob passes a step runs before training, from the config (`logprob_plan`)."""

    reuse_prev: bool
    """prev comes from the policy's train call (`reuses_prev_logprobs`)."""
    reference: bool
    """ref logprobs are needed: loss_fn.reference_policy_kl_penalty > 0."""


def logprob_plan(cfg: GRPOMasterConfig) -> LogprobPlan:
    return LogprobPlan(reuse_prev=reuses_prev_logprobs(cfg), reference=cfg.loss_fn.reference_policy_kl_penalty > 0)


def add_logprobs(plan: LogprobPlan, policy, batch: dict[str, torch.Tensor]) -> None:
    """prev (and, with `plan.reference`, ref) logprobs of the batch under the start-of-step
    weights; both in one call to the policy (one round trip, the batch sent once). With
    `plan.reuse_prev`, both are left to the policy's train call: prev from its training forward,
    ref from the reference forward it runs beside training (policy.reference_beside_training) or
    before it; no round trip here, and the batch travels once."""
    if plan.reuse_prev:
        return
    if plan.reference:
        both = policy.logprobs_and_reference(batch)  # [2, B, S]
        batch["prev_logprobs"], batch["ref_logprobs"] = both[0].clone(), both[1].clone()  # own storage each
    else:
        batch["prev_logprobs"] = policy.logprobs(batch)


def refit_limits(cfg: GRPOMasterConfig) -> refit_check.RefitLimits:
    """grpo.refit_check's thresholds, a null one taking the default of the trainer/engine pair's
    coarser precision (the HF generator runs in policy.precision)."""
    default = refit_check.DEFAULT_LIMITS[gate_precision_of(cfg)]
    check = cfg.grpo.refit_check
    return refit_check.RefitLimits(
        max_abs_diff=check.max_abs_logprob_diff if check.max_abs_logprob_diff is not None else default.max_abs_diff,
        mean_abs_diff=(
            check.max_mean_abs_logprob_diff if check.max_mean_abs_logprob_diff is not None else default.mean_abs_diff
        ),
        seq_logratio_rms=(
            check.max_seq_logratio_rms if check.max_seq_logratio_rms is not None else default.seq_logratio_rms
        ),
    )


def probe_size(cfg: GRPOMasterConfig) -> int:
    """grpo.refit_check.num_probe_sequences, or the default of the pair's coarser precision
    (refit_check.DEFAULT_PROBE_SEQUENCES)."""
    n = cfg.grpo.refit_check.num_probe_sequences
    return n if n is not None else refit_check.DEFAULT_PROBE_SEQUENCES[gate_precision_of(cfg)]


def gate_precision_of(cfg: GRPOMasterConfig) -> str:
    """The coarser of the trainer's and the engine's precision (the HF generator runs in policy.precision)."""
    engine = (
        cfg.policy.generation.vllm_cfg.precision if cfg.policy.generation.backend == "vllm" else cfg.policy.precision
    )
    return refit_check.gate_precision(cfg.policy.precision, engine)


def check_refit(cfg: GRPOMasterConfig, policy, generator, rollouts: list[Rollout]) -> dict[str, float]:
    """Score the first `probe_size` rollouts in trainer and generator; raise above the configured
    thresholds (`refit_limits`). Returns the refit/* metrics. Both scoring calls are sent before
    either is waited for: the two actors score at the same time (one round trip, not two)."""
    probe = rollouts[: probe_size(cfg)]
    sequences = [r.prompt_ids + r.response_ids for r in probe if r.response_ids]
    prompt_lens = [len(r.prompt_ids) for r in probe if r.response_ids]
    if not sequences:
        return {}
    with ThreadPoolExecutor(1) as pool:  # the trainer and the engines score the probe at the same time
        on_engines = pool.submit(generator.score, sequences, prompt_lens)
        trainer = policy.score(sequences, prompt_lens)
        generated = on_engines.result()
    return refit_check.gate_refit(trainer, generated, refit_limits(cfg)).metrics()
