"""`policy`: the trained model, its parallelism (dtensor_cfg, LoRA), micro-batching and optimizer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from grpo_train.config.schema.base import Section
from grpo_train.config.schema.generation import VLLM_MAX_LORA_RANKS, GenerationConfig


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
    in (the trainer's module is never merged in place). "adapter" pushes only the adapter tensors (through
    Ray's object store); the vLLM engine starts with LoRA enabled on the checkpoint's base weights and runs
    every request after a refit with the pushed adapter (generation/lora_adapter.py). Needs the vLLM backend,
    the sync loop (not grpo.async_grpo) and weight_transport auto or object_store."""

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

    @model_validator(mode="after")
    def _one_selection(self) -> LoRAConfig:
        if self.target_modules and self.match_all_linear:
            raise ValueError(
                "target_modules is set but match_all_linear: true adapts every linear layer; "
                "set match_all_linear: false to adapt only target_modules"
            )
        if not self.target_modules and not self.match_all_linear:
            raise ValueError(
                "match_all_linear: false and no target_modules: no layer would get an adapter; "
                "set target_modules or match_all_linear: true"
            )
        return self


class DTensorConfig(Section):
    enabled: bool | None = None
    """FSDP2: shard the policy (and reference) over the data-parallel ranks. null: on GPUs only
    (CPU ranks hold full replicas and all-reduce gradients over gloo); true: also on CPU ranks,
    over a gloo device mesh (the sharded path CI tests; needs policy.num_workers > 1); false: never."""
    cpu_offload: bool = False
    """FSDP2 keeps parameters, gradients and optimizer state in CPU memory between uses (GPUs)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Tensor-parallel ranks per model replica (torch.distributed.tensor.parallel plan by architecture, or
    custom_parallel_plan): policy.num_workers ranks form a (num_workers / tp) x tp mesh; rows split over the dp
    groups, FSDP2 (when on) shards over dp. Must divide policy.num_workers and the model's attention heads,
    KV heads and vocabulary."""
    sequence_parallel: bool = False
    """With tensor_parallel_size > 1: also shard the residual stream and RMSNorms over the sequence
    (grpo_train.policy.tensor_parallel); refused with tensor_parallel_size 1, where it would do nothing."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them (any device)."""
    context_parallel_size: int = Field(default=1, ge=1)
    """Context-parallel ranks per model replica (grpo_train.policy.context_parallel): policy.num_workers ranks
    form a (num_workers / cp) x cp mesh; a dp group's cp ranks take the same rows and shard each row's tokens
    (torch's context_parallel, head-tail load-balanced causal chunks), the model's SDPA attention runs as torch's
    ring attention (on CPU through the CPU flash kernel), logprobs are gathered and gradients summed over cp.
    Supported: right-padded rows, causal SDPA attention (no sliding window or soft-cap), fp32/bf16 replicas.
    Refused: with tensor_parallel_size > 1, FSDP2 (needs enabled: false), sequence packing, LoRA,
    activation_checkpointing, moe_aux_loss_coeff > 0 (each untested or unsupported under CP)."""
    custom_parallel_plan: str | None = None
    """A `module:object` tensor-parallel plan (a dict of module name -> ParallelStyle, or a callable
    (model, sequence_parallel) -> dict) used instead of the built-in one; needs tensor_parallel_size > 1."""
    lora_cfg: LoRAConfig = LoRAConfig()
    """LoRA adapters on the policy (peft); see LoRAConfig."""

    @field_validator("context_parallel_size")
    @classmethod
    def _context_parallel_alone(cls, value: int, info: ValidationInfo) -> int:
        if value == 1:
            return value
        if info.data.get("tensor_parallel_size", 1) > 1:
            raise ValueError(
                "context parallelism with tensor_parallel_size > 1 is not supported (untested); set one of them to 1"
            )
        if info.data.get("enabled") is not False:
            raise ValueError(
                "context parallelism with FSDP2 is not supported (untested): set "
                "policy.dtensor_cfg.enabled: false (full replicas, gradients summed over cp and dp)"
            )
        if info.data.get("activation_checkpointing"):
            raise ValueError(
                "context parallelism with activation_checkpointing: the recomputed forward would run "
                "outside the ring; set activation_checkpointing: false"
            )
        return value

    @model_validator(mode="after")
    def _context_parallel_without_lora(self) -> DTensorConfig:
        if self.context_parallel_size > 1 and self.lora_cfg.enabled:
            raise ValueError(
                "policy.dtensor_cfg.context_parallel_size > 1 with lora_cfg.enabled is not supported "
                "(untested); set context_parallel_size 1"
            )
        return self

    @field_validator("sequence_parallel")
    @classmethod
    def _sequence_parallel_needs_tp(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("tensor_parallel_size", 1) == 1:
            raise ValueError(
                "sequence parallelism shards over the tensor-parallel ranks: it needs "
                "policy.dtensor_cfg.tensor_parallel_size > 1; set false"
            )
        return value

    @field_validator("custom_parallel_plan")
    @classmethod
    def _custom_plan_needs_tp(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        if info.data.get("tensor_parallel_size", 1) == 1:
            raise ValueError(
                "a custom tensor-parallel plan needs policy.dtensor_cfg.tensor_parallel_size > 1; set null"
            )
        module, _, attr = value.partition(":")
        if not module or not attr:
            raise ValueError(f"{value!r}: expected 'module:object'")
        return value


class MicroBatchingConfig(Section):
    """Dynamic batching: rows sorted by length, grouped while rows x padded width <= the budget
    (grpo_train.policy.microbatch). Same loss and gradients as fixed-size micro-batches."""

    enabled: bool = False
    """Micro-batches by token budget instead of train_micro_batch_size / logprob_batch_size rows."""
    train_mb_tokens: int = Field(default=2048, ge=1)
    """Token budget of a training micro-batch, padding included; a longer sequence is an error."""
    logprob_mb_tokens: int = Field(default=2048, ge=1)
    """Token budget of a logprob micro-batch, padding included; a longer sequence is an error."""
    sequence_length_round: int = Field(default=64, ge=1)
    """Round micro-batch lengths up to a multiple of this (the padded width; with packing, the
    packed stream), never past the budget."""


class SequencePackingConfig(MicroBatchingConfig):
    """Sequence packing: rows bin-packed into streams of at most the budget, attention kept
    within each sequence (grpo_train.policy.microbatch and policy.logprobs)."""

    algorithm: Literal["modified_first_fit_decreasing", "first_fit_decreasing", "best_fit_decreasing"] = (
        "modified_first_fit_decreasing"
    )
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


class PolicyConfig(Section):
    model_name: str = "Qwen/Qwen2.5-1.5B"
    """HF hub name, local path, or `builtin:<name>` for a model bundled with grpo."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    train_global_batch_size: int = Field(default=512, ge=1)
    """Samples per optimizer step."""
    train_micro_batch_size: int = Field(default=4, ge=1)
    """Samples per forward/backward."""
    generation_batch_size: int = Field(default=32, ge=1)
    """Prompts per generation call of the training rollout: a step's prompts are submitted in chunks of
    this many (each expanded to grpo.num_generations_per_prompt samples; later turns of a multi-turn
    rollout: this many conversations), one chunk after the other. Bounds what an engine holds at once."""
    logprob_batch_size: int = Field(default=4, ge=1)
    """Samples per forward when computing prev/ref logprobs."""
    reference_beside_training: bool = False
    """Where the sync loop leaves the reference logprobs to the train call (one worker, on-policy, one
    optimizer step; train_step.add_logprobs), compute them in a second thread beside the training
    micro-batches (policy/reference_ahead.py) instead of before them: bitwise the same values, run
    on a core the training forward/backward leaves idle, if it leaves one. It needs a reference
    model of its own (not LoRA) and logprob micro-batches equal to the training ones; elsewhere
    the forward runs first. It costs 3-5% more CPU seconds; on 2 quiet CPU cores it saved 4-8% of
    the tiny demo's reference + train time and lost 3% at 34M, where training keeps both cores busy
    (benchmarks/results/perf_profile_cpu.md, round 5): off by default, on in the tiny demo."""
    max_total_sequence_length: int = Field(default=512, ge=8)
    precision: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    logprob_chunk_size: int | None = None
    """Rows per chunk in the logprob op (bounded memory); null: the op's default."""
    use_fused_kernels: bool = True
    """Use grpo_kernels' dispatch (Triton/CUDA where supported, reference otherwise)."""
    num_workers: int = Field(default=1, ge=1)
    """Data-parallel policy workers (Ray actors)."""
    dtensor_cfg: DTensorConfig = DTensorConfig()
    dynamic_batching: MicroBatchingConfig = MicroBatchingConfig()
    sequence_packing: SequencePackingConfig = SequencePackingConfig()
    make_sequence_length_divisible_by: int = Field(default=1, ge=1)
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    moe_aux_loss_coeff: float = Field(default=0.0, ge=0)
    """Weight of the MoE load-balancing auxiliary loss (the model's own `aux_loss`, Switch
    Transformer's) added to the training loss; 0: off (NeMo RL's default). MoE models only."""
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: list[SchedulerEntry] = []
    generation: GenerationConfig = GenerationConfig()

    @model_validator(mode="after")
    def _lora_adapter_refit(self) -> PolicyConfig:
        """lora_cfg.refit: adapter runs on vLLM's offline engine fed through the object store."""
        lora = self.dtensor_cfg.lora_cfg
        if not (lora.enabled and lora.refit == "adapter"):
            return self
        if self.generation.backend != "vllm":
            raise ValueError(
                f"policy.dtensor_cfg.lora_cfg.refit: adapter needs policy.generation.backend: vllm (the "
                f"{self.generation.backend!r} generator loads full weights only); set refit: merged"
            )
        if self.generation.weight_transport in ("collective", "ipc"):
            raise ValueError(
                f"policy.generation.weight_transport: {self.generation.weight_transport!r} with "
                "lora_cfg.refit: adapter; the adapters (a few MiB) go through Ray's object store: set "
                "auto or object_store"
            )
        if lora.dim > VLLM_MAX_LORA_RANKS[-1]:
            raise ValueError(
                f"policy.dtensor_cfg.lora_cfg.dim: {lora.dim} with refit: adapter exceeds vLLM's largest "
                f"max_lora_rank ({VLLM_MAX_LORA_RANKS[-1]}); set a smaller dim or refit: merged"
            )
        return self

    @model_validator(mode="after")
    def _batching(self) -> PolicyConfig:
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError("dynamic_batching and sequence_packing are mutually exclusive: enable at most one")
        if (cp := self.dtensor_cfg.context_parallel_size) > 1:
            self._check_context_parallel(cp)
        tp = self.dtensor_cfg.tensor_parallel_size
        if self.num_workers % tp:
            raise ValueError(
                f"policy.dtensor_cfg.tensor_parallel_size ({tp}) must divide policy.num_workers "
                f"({self.num_workers}): the ranks form a (num_workers / tp) x tp mesh"
            )
        if tp > 1 and self.dtensor_cfg.lora_cfg.enabled:
            raise ValueError(
                "policy.dtensor_cfg.tensor_parallel_size > 1 with lora_cfg.enabled: LoRA adapters on "
                "tensor-parallel layers are not supported; set tensor_parallel_size 1"
            )
        if tp > 1 and self.train_global_batch_size % (self.num_workers // tp):
            raise ValueError(
                f"policy.train_global_batch_size ({self.train_global_batch_size}) must be a multiple of the "
                f"data-parallel size policy.num_workers / tensor_parallel_size ({self.num_workers // tp}): each "
                f"optimizer step splits evenly over the data-parallel groups"
            )
        if self.train_global_batch_size % self.num_workers and tp == 1 and cp == 1:
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

    def _check_context_parallel(self, cp: int) -> None:
        if self.num_workers % cp:
            raise ValueError(
                f"policy.dtensor_cfg.context_parallel_size ({cp}) must divide policy.num_workers "
                f"({self.num_workers}): the ranks form a (num_workers / cp) x cp mesh"
            )
        if self.train_global_batch_size % (self.num_workers // cp):
            raise ValueError(
                f"policy.train_global_batch_size ({self.train_global_batch_size}) must be a multiple of "
                f"the data-parallel size policy.num_workers / context_parallel_size "
                f"({self.num_workers // cp})"
            )
        if self.sequence_packing.enabled:
            raise ValueError(
                "policy.sequence_packing with policy.dtensor_cfg.context_parallel_size > 1: packed "
                "(varlen) attention is not ring-sharded; disable sequence_packing or set "
                "context_parallel_size 1"
            )
        if self.moe_aux_loss_coeff > 0:
            raise ValueError(
                "policy.moe_aux_loss_coeff > 0 with policy.dtensor_cfg.context_parallel_size > 1 is not "
                "supported (the router loss would see one cp shard's tokens); set one of them to 0 / 1"
            )
