"""Tensor (and sequence) parallelism of a policy model on torch.distributed.tensor.parallel.

Job: pick a plan by architecture (Llama-style decoders: Llama, Mistral, Qwen2, Qwen3) or load a
user's (`dtensor_cfg.custom_parallel_plan`, `module:object`), check that the TP size divides the
heads, KV heads and vocabulary, and apply it with `parallelize_module` on a 1-D TP mesh (the tp
dimension of a dp x tp mesh).

The plan, Megatron's layout in DTensor terms: q/k/v and gate/up projections are column-parallel
(each rank holds whole heads / a slice of the MLP), o_proj and down_proj row-parallel (one
all-reduce, or a reduce-scatter under SP, per block); the embedding is row-parallel over the
vocabulary and the lm_head column-parallel, so logits stay vocab-sharded and
`grpo_kernels.vocab_parallel` scores them (a tied head keeps sharing the embedding's sharded
weight). Sequence parallelism additionally shards the residual stream and the RMSNorms over
the sequence: layer 0 takes its slice of the (replicated) embeddings, every block gathers the
sequence before attention / MLP and reduce-scatters after, and the final norm's output is
gathered back before the head. Sequences are padded to a multiple of the TP size for that.
Boundary: torch and the model's module tree; no Ray, configs or losses.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from grpo_train.plan import tp_size_problem as tp_size_problem  # torch-free: `grpo plan` checks the same sizes

# transformers model types whose decoder is Llama-shaped (names of the plan below).
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")
# Attribute under which an applied plan's facts travel with the model (read by policy.logprobs).
TP_ATTR = "_grpo_tensor_parallel"


@dataclass(frozen=True)
class TPState:
    """What the logprob path needs to know about a tensor-parallel model."""

    mesh: Any  # the 1-D TP DeviceMesh
    size: int
    sequence_parallel: bool

    @property
    def group(self):
        return self.mesh.get_group()

    def pad_to(self, n: int) -> int:
        """Tokens of padding that make a length-n sequence dimension split evenly (SP only)."""
        return -n % self.size if self.sequence_parallel else 0

    def gather_sequence(self, hidden: torch.Tensor, dim: int) -> torch.Tensor:
        """The full sequence of a sequence-parallel output (this rank's slice along `dim`);
        differentiable: backward hands each rank its slice of the gradient."""
        if not self.sequence_parallel:
            return hidden
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(hidden, self.mesh, [Shard(dim)], run_check=False).full_tensor()


def tp_state(model: torch.nn.Module) -> TPState | None:
    return getattr(model, TP_ATTR, None)


def llama_style_plan(model: torch.nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """The plan of a Llama-shaped HF causal LM (`model.model.layers[i].self_attn.q_proj`, ...)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    block_out = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True),
    }
    for i in range(len(list(model.get_submodule("model.layers").children()))):
        prefix = f"model.layers.{i}"
        plan.update(
            {
                f"{prefix}.self_attn.q_proj": ColwiseParallel(),
                f"{prefix}.self_attn.k_proj": ColwiseParallel(),
                f"{prefix}.self_attn.v_proj": ColwiseParallel(),
                f"{prefix}.self_attn.o_proj": RowwiseParallel(output_layouts=block_out),
                f"{prefix}.mlp.gate_proj": ColwiseParallel(),
                f"{prefix}.mlp.up_proj": ColwiseParallel(),
                f"{prefix}.mlp.down_proj": RowwiseParallel(output_layouts=block_out),
            }
        )
        if sequence_parallel:
            plan.update(
                {
                    f"{prefix}.input_layernorm": SequenceParallel(use_local_output=True),
                    f"{prefix}.post_attention_layernorm": SequenceParallel(use_local_output=True),
                    f"{prefix}.self_attn": PrepareModuleInput(
                        input_kwarg_layouts={"hidden_states": Shard(1)},
                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                        use_local_output=True,
                    ),
                    f"{prefix}.mlp": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                    ),
                }
            )
    if sequence_parallel:
        plan["model.layers.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        plan["model.norm"] = SequenceParallel(use_local_output=True)
    return plan


def load_custom_plan(spec: str) -> Any:
    """`module:object` -> the object: a dict plan, or a callable (model, sequence_parallel) -> dict."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{spec!r}: expected 'module:object'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{spec!r}: cannot load it ({err})") from err
    if not (isinstance(obj, dict) or callable(obj)):
        raise ValueError(f"{spec!r}: expected a dict of module name -> ParallelStyle, or a callable returning one")
    return obj


def choose_plan(model: torch.nn.Module, sequence_parallel: bool, custom_plan: str | None = None) -> dict[str, Any]:
    """The custom plan when given, else the plan of the model's architecture; an unknown
    architecture without a custom plan is an error naming the key to set."""
    if custom_plan is not None:
        obj = load_custom_plan(custom_plan)
        return dict(obj) if isinstance(obj, dict) else dict(obj(model, sequence_parallel))
    model_type = str(getattr(model.config, "model_type", "?"))
    if model_type not in LLAMA_STYLE:
        raise ValueError(
            f"no tensor-parallel plan for model type {model_type!r} (built in: {', '.join(LLAMA_STYLE)}); "
            "set policy.dtensor_cfg.custom_parallel_plan to 'module:object'"
        )
    return llama_style_plan(model, sequence_parallel)


def apply_tensor_parallel(
    model: torch.nn.Module, tp_mesh, sequence_parallel: bool = False, custom_plan: str | None = None
) -> torch.nn.Module:
    """Parallelize `model` in place over the 1-D `tp_mesh` and return it. A tied lm_head is
    re-tied to the (identically sharded) embedding weight afterwards, so the two stay one
    parameter whose gradient sums both uses."""
    from torch.distributed.tensor.parallel import parallelize_module

    hf: Any = model  # an HF PreTrainedModel (embeddings accessors)
    size = tp_mesh.size()
    if (problem := tp_size_problem(model.config, size)) is not None:
        raise ValueError(f"policy.dtensor_cfg.tensor_parallel_size={size}: {problem}")
    tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    parallelize_module(model, tp_mesh, choose_plan(model, sequence_parallel, custom_plan))
    if tied:
        hf.get_output_embeddings().weight = hf.get_input_embeddings().weight
    setattr(model, TP_ATTR, TPState(tp_mesh, size, sequence_parallel))
    return model
