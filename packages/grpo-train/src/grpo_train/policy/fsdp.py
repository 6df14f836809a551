"""FSDP2 sharding of a policy model over its data-parallel ranks, and the full state of a
sharded model and optimizer for checkpoints.

Job: decide whether the ranks shard (`uses_fsdp`); shard an HF causal LM the same way on GPUs
(NCCL) and on CPUs (a gloo device mesh, which is how CI runs the sharded path): one FSDP unit
per decoder layer plus the root, gradients summed across ranks; and move state between the
sharded layout and the full tensors one unsharded worker holds. A sharded checkpoint is
therefore written in the unsharded format (HF safetensors, `optimizer.state_dict()` keyed by
parameter index) and loads on either side.
Every function that gathers (`full_*`, `total_grad_norm`) is a collective: all ranks call it,
in the same order. Boundary: knows nothing of losses, batches, files or Ray.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from grpo_train.config.schema import DTensorConfig


def uses_fsdp(cfg: DTensorConfig, on_gpu: bool, world_size: int) -> bool:
    """`dtensor_cfg.enabled`: null shards on GPUs only; true also shards CPU ranks (over gloo)
    when there is more than one; false never shards."""
    if cfg.enabled is None:
        return on_gpu
    return cfg.enabled and (on_gpu or world_size > 1)


class ForwardRoot(torch.nn.Module):
    """The root FSDP2 unit around an HF causal LM: its forward is `fn(model, *args)`.

    Logprobs call the backbone and read `lm_head.weight` directly (the fused logprob op), so
    the causal LM's own forward never runs; FSDP2 gathers a unit's parameters (embeddings,
    final norm, tied lm_head) and reduces their gradients only around a unit's forward. The
    whole logprob computation is therefore this module's forward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def shard(model: torch.nn.Module, mesh, cpu_offload: bool = False) -> ForwardRoot:
    """fully_shard every decoder layer, then the root (a `ForwardRoot`, which holds the rest).

    The loss of each rank is already divided by the global token (or sequence) count, so the
    ranks' gradients are summed: divide factor 1 with plain SUM collectives (gloo has no
    PREMUL_SUM, and a SUM with factor 1 needs no scaling pass on NCCL either). Every unit,
    the root too, frees its gathered parameters after forward: between calls each rank holds
    only its shards, which is what the checkpoint and refit gathers expect."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": True}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    root = fully_shard(ForwardRoot(model), **kwargs)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (a gather: every rank calls it); other tensors as they are."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """torch's clip_grad_norm_ for plain or DTensor gradients; the total norm of the full
    gradient as a float (for DTensors the norm is reduced over the shards: a collective)."""
    total = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    return float(full(total))


# ------------------------------------------------------------------ full (unsharded) state
def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict on CPU, on rank 0 (other ranks get {}). Tied parameters
    (lm_head and the embedding) come out as one tensor under both names, as in the model, so
    save_pretrained drops the tied copy exactly as it does for an unsharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first and name in state:
            state[name] = state[first[id(tensor)]]
        first.setdefault(id(tensor), name)
    return state


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]):
    """Load a full state dict (every rank passes the same one) into the sharded model; each
    rank keeps its shard. Returns torch's (missing, unexpected) keys; strictness is the caller's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    return set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def full_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool) -> dict | None:
    """`optimizer.state_dict()` with every DTensor state gathered to a full CPU tensor: what an
    unsharded optimizer over the same parameters returns. Ranks with `keep=False` take part
    in the gathers and get None."""
    state_dict = optimizer.state_dict()
    state = {index: {key: _gathered(value, keep) for key, value in per_param.items()}
             for index, per_param in state_dict["state"].items()}
    return {"state": state, "param_groups": state_dict["param_groups"]} if keep else None


def shard_optimizer_state(optimizer: torch.optim.Optimizer, full_state: dict) -> dict:
    """A full (unsharded-format) optimizer state dict cut to this rank's shards, ready for
    `optimizer.load_state_dict`. Every rank holds the same full state, so each cuts its own
    shard locally (no communication)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != sum(len(g["params"]) for g in full_state["param_groups"]):
        raise ValueError(f"optimizer state has {sum(len(g['params']) for g in full_state['param_groups'])} "
                         f"parameters; the model has {len(params)}")
    state = {index: {key: _sharded_like(params[index], value) for key, value in per_param.items()}
             for index, per_param in full_state["state"].items()}
    return {"state": state, "param_groups": full_state["param_groups"]}


def _gathered(value: Any, keep: bool) -> Any:
    if not torch.is_tensor(value):
        return value
    value = full(value)
    return value.detach().to("cpu", copy=True) if keep else None


def _sharded_like(param: torch.Tensor, value: Any) -> Any:
    """`value` laid out like `param` when it is a full per-element state of a DTensor parameter
    (Adam's moments, SGD's momentum); scalars such as Adam's step stay as they are."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not (isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.shape):
        return value
    value = value.to(param.device_mesh.device_type)
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
