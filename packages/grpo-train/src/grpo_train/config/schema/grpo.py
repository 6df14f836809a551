"""`grpo`: the algorithm's section (batch shape, advantages, reward shaping/scaling, async, refit check)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from grpo_train.config.schema.base import Section


class RewardShapingConfig(Section):
    enabled: bool = False
    """DAPO overlong shaping: penalise responses longer than max_response_length - buffer."""
    overlong_buffer_length: int = Field(default=128, ge=1)
    """Tokens before max_response_length where the linear penalty starts."""
    overlong_buffer_penalty: float = Field(default=1.0, ge=0)
    """Penalty reached at max_response_length."""
    max_response_length: int = Field(default=512, ge=1)
    """Length the penalty is measured against (usually policy.generation.max_new_tokens)."""
    stop_properly_penalty_coef: float | None = Field(default=None, ge=0, le=1)
    """"Stop properly" shaping, used *instead of* the DAPO overlong penalty when set: the (scaled)
    reward of a truncated response is multiplied by this coefficient in [0, 1]; the overlong_buffer_*
    keys then do nothing to the reward. null: DAPO overlong shaping."""

    @model_validator(mode="after")
    def _coef_needs_enabled(self) -> RewardShapingConfig:
        if self.stop_properly_penalty_coef is not None and not self.enabled:
            raise ValueError(
                "stop_properly_penalty_coef is set but reward_shaping.enabled is false; "
                "set enabled: true or remove the coefficient"
            )
        return self


class RewardScalingConfig(Section):
    enabled: bool = False
    """Linearly map clamp(r, source_min, source_max) onto [target_min, target_max]."""
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0

    @model_validator(mode="after")
    def _range(self) -> RewardScalingConfig:
        if self.enabled and self.source_max <= self.source_min:
            raise ValueError(f"source_max ({self.source_max}) must be greater than source_min ({self.source_min})")
        return self


class AsyncGRPOConfig(Section):
    enabled: bool = False
    """Generate ahead of training into a replay buffer (requires importance-sampling correction)."""
    max_trajectory_age_steps: int = Field(default=1, ge=0)
    """Train at weight version v only on groups generated at versions >= v - this."""
    in_flight_weight_updates: bool = False
    """Requests still decoding continue under the new weights after a refit."""
    recompute_kv_cache_after_weight_updates: bool = False
    """Reset the KV/prefix cache after each refit."""


class RefitCheckConfig(Section):
    enabled: bool = True
    """After each weight push, score a probe batch in trainer and generator and compare."""
    num_probe_sequences: int | None = Field(default=None, ge=1)
    """Sequences in the probe batch (the step's first rollouts). null: the default of the pair's coarser
    precision (refit.check.DEFAULT_PROBE_SEQUENCES): 4 in float32, 64 in bfloat16/float16, whose
    statistics need more tokens (4 sequences would stop a healthy bf16 demo run in up to 25% of checks)."""
    max_abs_logprob_diff: float | None = Field(default=None, gt=0)
    """Stop the run when one probe token's |trainer - generator| logprob difference exceeds this.
    null: the default of the pair's coarser precision (policy.precision vs vllm_cfg.precision;
    refit.check.DEFAULT_LIMITS): 1e-3 in float32, where a healthy pair's worst token differs by
    ~1e-5 (demo model, measured); not gated in bfloat16/float16, where a healthy pair's worst
    token differs by up to ~0.26 (benchmarks/results/refit_gate_bf16.md)."""
    max_mean_abs_logprob_diff: float | None = Field(default=None, gt=0)
    """Stop the run when the mean over the probe's tokens of |trainer - generator| logprob exceeds
    this. null: the precision's default (refit.check.DEFAULT_LIMITS): 1e-4 in float32 (healthy
    ~1e-6 on the demo model), 0.05 in bfloat16/float16 (healthy 6.5e-3..1.6e-2 on the demo model,
    measured; NeMo RL's healthy token_mult_prob_error ~1.05 is a mean of ~0.05)."""
    max_seq_logratio_rms: float | None = Field(default=None, gt=0)
    """Stop the run when sqrt(sum over probe sequences of (sum of the sequence's trainer - generator
    logprobs)^2 / probe tokens) exceeds this (refit.check.RefitStats.seq_logratio_rms): a broken refit
    shifts a sequence's tokens alike, rounding noise cancels. null: the precision's default: not
    gated in float32 (the max catches it), 0.05 in bfloat16/float16 (demo model, 3 seeds: healthy
    <= 0.038, one tensor skipped for 10 steps >= 0.069; benchmarks/results/refit_gate_bf16.md)."""
    period: int = Field(default=1, ge=1)
    """Check every this many refits."""


GroupEstimatorName = Literal["grpo", "gdpo", "reinforce_plus_plus"]
ESTIMATOR_KEYS = {
    "grpo": {"normalize_rewards", "use_leave_one_out_baseline"},
    "gdpo": {"normalize_rewards", "use_leave_one_out_baseline", "reward_weights"},
    "reinforce_plus_plus": {"minus_baseline"},
}
"""The adv_estimator keys each estimator reads; the others are refused."""


class GroupAdvEstimatorConfig(Section):
    """`grpo.adv_estimator`: how rewards become advantages (NeMo RL's keys; grpo_train.group_estimators).
    A key that the chosen estimator does not use is refused."""

    name: GroupEstimatorName = "grpo"
    """grpo: group baseline (and std); gdpo: group-normalise each reward component, sum, then
    normalise over the batch; reinforce_plus_plus: REINFORCE++ global whitening over the batch's tokens."""
    normalize_rewards: bool | None = None
    """grpo / gdpo: divide by the group std; null: grpo.normalize_rewards."""
    use_leave_one_out_baseline: bool | None = None
    """grpo / gdpo: RLOO baseline and std; null: grpo.use_leave_one_out_baseline."""
    minus_baseline: bool | None = None
    """reinforce_plus_plus: subtract the group mean first (REINFORCE++-baseline); null: true."""
    reward_weights: list[float] | None = None
    """gdpo: weight per reward component, in the sorted order of component names; null: all 1."""

    @field_validator("normalize_rewards", "use_leave_one_out_baseline", "minus_baseline", "reward_weights")
    @classmethod
    def _keys_of_the_estimator(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.data.get("name")  # absent when the name itself was refused
        used = ESTIMATOR_KEYS.get(name, set()) if name is not None else set()
        if value is not None and name is not None and info.field_name not in used:
            raise ValueError(f"does not apply to adv_estimator.name {name!r} (it uses {sorted(used)}); remove it")
        return value


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(default=32, ge=1)
    """Prompts drawn per GRPO step."""
    num_generations_per_prompt: int = Field(default=16, ge=1)
    """Samples per prompt: the group size of the group-relative baseline."""
    max_rollout_turns: int = Field(default=1, ge=1)
    """Turns of generation/environment interaction per sample (multi-turn when > 1)."""
    per_sample_turns: bool = False
    """Multi-turn only: each conversation starts its next turn as soon as its own environment has
    answered (a slow tool call holds back only its sample) instead of all turns in lockstep; the
    generation batches then depend on timing, so runs are not bitwise reproducible."""
    invalid_tool_call_advantage: float | None = None
    """Multi-turn tool environments (NeMo RL's key of the same name): every generated token of a
    turn whose tool calls the environment found written wrong (its metadata's `invalid_tool_calls`
    > 0: invalid JSON, unknown tool, bad arguments, too many calls) gets this advantage in place of
    the estimator's (after clipping); the sample's other turns keep theirs. null: off. The
    environment's `invalid_call_penalty` (a reward, shared by the whole sample) is separate."""
    max_num_epochs: int = Field(default=1, ge=1)
    """Passes over the training data."""
    max_num_steps: int = Field(default=1_000_000, ge=1)
    """GRPO steps; training stops at whichever of epochs and steps comes first."""
    normalize_rewards: bool = True
    """Divide advantages by the group's std (+1e-6) where it is positive."""
    use_leave_one_out_baseline: bool = True
    """RLOO: baseline and std of the other N-1 samples of the group."""
    advantage_clip_low: float | None = None
    """Optional lower clamp of advantages."""
    advantage_clip_high: float | None = None
    """Optional upper clamp of advantages."""
    overlong_filtering: bool = False
    """Truncated samples get sample_mask 0 (no gradient) after the advantages are computed: they
    stay in their group's baseline and std."""
    seq_logprob_error_threshold: float | None = Field(default=None, ge=1.0)
    """Drop (sample_mask 0, after the advantages) sequences whose masked mean of
    exp(|prev - gen|) over their response tokens exceeds this (NeMo RL's seq_mult_prob_error;
    1.0 = trainer and generator agree exactly); counted in num_masked_seqs_by_logprob_error."""
    use_dynamic_sampling: bool = False
    """DAPO: drop zero-spread groups and sample more prompts until the batch has signal."""
    dynamic_sampling_max_gen_batches: int = Field(default=10, ge=1)
    """Most generation rounds per step with dynamic sampling."""
    batch_multiplier: int = Field(default=1, ge=1)
    """Prompts drawn per round with dynamic sampling = batch_multiplier * num_prompts_per_step."""
    val_period: int = Field(default=10, ge=0)
    """Validate every this many steps (0: never, except val_at_start/val_at_end)."""
    val_at_start: bool = False
    """Validate before the first step."""
    val_at_end: bool = True
    """Validate after the last step."""
    max_val_samples: int = Field(default=256, ge=1)
    """Validation prompts used."""
    val_batch_size: int = Field(default=256, ge=1)
    """Validation prompts per generation call."""
    val_num_generations: int = Field(default=1, ge=1)
    """Samples per validation prompt for pass@k (sampled at the training temperature when > 1)."""
    seed: int = 42
    """Seed of data order, sampling and initialisation."""
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    reward_scaling: RewardScalingConfig = RewardScalingConfig()
    async_grpo: AsyncGRPOConfig = AsyncGRPOConfig()
    refit_check: RefitCheckConfig = RefitCheckConfig()
    adv_estimator: GroupAdvEstimatorConfig = GroupAdvEstimatorConfig()

    @model_validator(mode="after")
    def _per_sample_turns(self) -> GRPOConfig:
        if self.per_sample_turns and self.max_rollout_turns == 1:
            raise ValueError(
                "grpo.per_sample_turns: true needs grpo.max_rollout_turns > 1 (one turn has no later "
                "turns to schedule); remove it or raise max_rollout_turns"
            )
        return self

    @model_validator(mode="after")
    def _invalid_tool_call_advantage(self) -> GRPOConfig:
        if self.invalid_tool_call_advantage is not None and self.max_rollout_turns == 1:
            raise ValueError(
                "grpo.invalid_tool_call_advantage needs grpo.max_rollout_turns > 1 (tool calls are run "
                "and judged only between turns); remove it or raise max_rollout_turns"
            )
        return self

    @model_validator(mode="after")
    def _clips(self) -> GRPOConfig:
        lo, hi = self.advantage_clip_low, self.advantage_clip_high
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"advantage_clip_low ({lo}) must not exceed advantage_clip_high ({hi})")
        est = self.adv_estimator
        if est.name == "gdpo" and (self.reward_scaling.enabled or self.reward_shaping.enabled):
            raise ValueError(
                "grpo.adv_estimator.name 'gdpo' normalises the environment's reward components, which "
                "grpo.reward_scaling / grpo.reward_shaping do not touch; disable them"
            )
        for key in ("normalize_rewards", "use_leave_one_out_baseline"):
            mine = getattr(est, key)
            if mine is not None and key in self.model_fields_set and mine != getattr(self, key):
                raise ValueError(
                    f"grpo.{key} ({getattr(self, key)}) and grpo.adv_estimator.{key} ({mine}) disagree; set one of them"
                )
            # A parent config may spell out the default (grpo_math_1B.yaml does); a changed value would do nothing.
            changed = getattr(self, key) != type(self).model_fields[key].default
            if est.name == "reinforce_plus_plus" and key in self.model_fields_set and changed:
                raise ValueError(
                    f"grpo.{key}: {getattr(self, key)} does not apply to grpo.adv_estimator.name "
                    f"'reinforce_plus_plus' (it whitens over the batch); remove it"
                )
        return self

    @property
    def normalize_group_rewards(self) -> bool:
        """normalize_rewards in effect (adv_estimator's value, else the top-level key)."""
        est = self.adv_estimator.normalize_rewards
        return self.normalize_rewards if est is None else est

    @property
    def leave_one_out(self) -> bool:
        """use_leave_one_out_baseline in effect (adv_estimator's value, else the top-level key)."""
        est = self.adv_estimator.use_leave_one_out_baseline
        return self.use_leave_one_out_baseline if est is None else est
