"""FSDP2 sharding of a policy model over its data-parallel ranks, and the full state of a
sharded model and optimizer for checkpoints.

Job: decide whether the ranks shard (`uses_fsdp`); shard an HF causal LM the same way on GPUs
(NCCL) and on CPUs (a gloo device mesh, which is how CI runs the sharded path): one FSDP unit
per decoder layer plus the root, gradients summed across ranks; and move state between the
sharded layout and the full tensors one unsharded worker holds. A sharded checkpoint is
therefore written in the unsharded format (HF safetensors, `optimizer.state_dict()` keyed by
parameter index) and loads on either side.
Every function that gathers, broadcasts or scatters (`full*`, `clip_grad_norm`, `broadcast_object`,
`scatter_*`) is a collective: all ranks call it, in the same order. Boundary: knows nothing of
losses, batches, files or Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from grpo_train.config.schema import DTensorConfig
from grpo_train.policy.precision import fsdp_policy


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


def shard(
    model: torch.nn.Module, mesh, cpu_offload: bool = False, compute_dtype: torch.dtype = torch.float32
) -> ForwardRoot:
    """fully_shard every decoder layer, then the root (a `ForwardRoot`, which holds the rest).

    The loss of each rank is already divided by the global token (or sequence) count, so the
    ranks' gradients are summed: divide factor 1 with plain SUM collectives (gloo has no
    PREMUL_SUM, and a SUM with factor 1 needs no scaling pass on NCCL either). Every unit,
    the root too, frees its gathered parameters after forward: between calls each rank holds
    only its shards, which is what the checkpoint and refit gathers expect. A compute dtype
    other than fp32 shards with `precision.fsdp_policy` (fp32 shards, compute-dtype gathers,
    fp32 reduce-scatter)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": True}
    if (mp := fsdp_policy(compute_dtype)) is not None:
        kwargs["mp_policy"] = mp
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
    gradient as a float (for DTensors the norm is reduced over the shards: a collective).
    Gradients of mixed kinds (under TP: DTensors on the tp or dp x tp mesh beside plain or
    dp-sharded ones), which torch's foreach norm cannot stack, go through `_mixed_clip`."""
    from torch.distributed.tensor import DTensor

    max_norm = max_norm if max_norm is not None else math.inf
    grads = [p.grad for p in params if p.grad is not None]
    kinds = {(g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None for g in grads}
    if len(kinds) > 1:
        return _mixed_clip(grads, max_norm)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(full(total))


@torch.no_grad()
def _mixed_clip(grads: list[torch.Tensor], max_norm: float) -> float:
    """clip_grad_norm_'s arithmetic (total 2-norm; scale by max_norm / (total + 1e-6) when
    below 1) with each gradient's full norm taken on its own (a reduction per DTensor)."""
    squares = torch.stack([full(torch.linalg.vector_norm(g, 2)).float() ** 2 for g in grads])
    total = float(squares.sum().sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


@torch.no_grad()
def sum_local_gradients(params: list[torch.nn.Parameter], group) -> None:
    """All-reduce SUM of each parameter's local gradient (a DTensor's local shard, or a plain
    tensor) over `group` (the dp ranks of a TP run without FSDP2), as one flat buffer, in place."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    from torch.distributed.tensor import DTensor

    local: list[torch.Tensor] = []
    for p in params:
        if not p.requires_grad:
            continue
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        p.grad = grad
        local.append(grad.to_local() if isinstance(grad, DTensor) else grad)
    flat = _flatten_dense_tensors(local)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    with torch.no_grad():
        for dst, src in zip(local, _unflatten_dense_tensors(flat, local)):
            dst.copy_(src)


# ------------------------------------------------------------------ full (unsharded) state
def broadcast_object(obj: Any) -> Any:
    """Rank 0's picklable `obj` on every rank."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def tied_names(model: torch.nn.Module) -> list[list[str]]:
    """State-dict names that share one parameter (e.g. the embedding and a tied lm_head), first name first."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict on CPU, on rank 0 (other ranks get {}). Tied parameters
    (lm_head and the embedding) come out as one tensor under both names, as in the model, so
    save_pretrained drops the tied copy exactly as it does for an unsharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for first, *others in tied_names(model) if state else []:
        state.update({name: state[first] for name in others})
    return state


def model_state_mismatch(
    model: torch.nn.Module, state: dict[str, torch.Tensor], trainable_only: bool = False
) -> str | None:
    """Fill the tied names a checkpoint leaves out (in place); what else does not match the model.
    `trainable_only`: the checkpoint holds the trainable parameters only (a LoRA run's adapters)."""
    for names in tied_names(model):
        present = [name for name in names if name in state]
        state.update({name: state[present[0]] for name in names if present and name not in state})
    everything = model.state_dict().keys()
    expected = {n for n, p in model.named_parameters() if p.requires_grad} if trainable_only else everything
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - everything)
    return f"missing {missing}, unexpected {unexpected}" if missing or unexpected else None


def scatter_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Rank 0's full state dict (complete unless not `strict`: see `model_state_mismatch`; {} on
    other ranks) into every rank's shards, one tensor broadcast at a time."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(
        model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    )


def full_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool) -> dict | None:
    """`optimizer.state_dict()` with every DTensor state gathered to a full CPU tensor: what an
    unsharded optimizer over the same parameters returns. Ranks with `keep=False` take part
    in the gathers and get None."""
    state_dict = optimizer.state_dict()
    state = {
        index: {key: _gathered(value, keep) for key, value in per_param.items()}
        for index, per_param in state_dict["state"].items()
    }
    return {"state": state, "param_groups": state_dict["param_groups"]} if keep else None


@dataclass(frozen=True)
class Scattered:
    """Stands in the broadcast optimizer skeleton for a per-element tensor that is scattered."""

    dtype: torch.dtype


def optimizer_skeleton(optimizer: torch.optim.Optimizer, full_state: dict) -> dict | str:
    """Rank 0: the full optimizer state with its per-element tensors (Adam's moments, SGD's
    momentum) replaced by `Scattered`, small enough to broadcast; or why it does not fit."""
    params = _params(optimizer)
    count = sum(len(group["params"]) for group in full_state["param_groups"])
    if count != len(params):
        return f"optimizer state has {count} parameters; the model has {len(params)}"
    state = {
        index: {
            key: Scattered(value.dtype) if _per_element(params[index], value) else value
            for key, value in per_param.items()
        }
        for index, per_param in full_state["state"].items()
    }
    return {"state": state, "param_groups": full_state["param_groups"]}


def scatter_optimizer_state(optimizer: torch.optim.Optimizer, skeleton: dict, full_state: dict | None) -> dict:
    """The skeleton (on every rank) filled with this rank's shards of rank 0's full tensors
    (`full_state`, None on other ranks), scattered one at a time: a state dict ready for
    `optimizer.load_state_dict`."""
    from torch.distributed.tensor import distribute_tensor

    params = _params(optimizer)
    state: dict[int, dict[str, Any]] = {}
    for index, per_param in skeleton["state"].items():
        state[index] = {}
        for key, value in per_param.items():
            if isinstance(value, Scattered):
                param = params[index]
                source = (
                    full_state["state"][index][key]
                    if full_state is not None
                    else torch.empty(param.shape, dtype=value.dtype)
                )
                value = distribute_tensor(
                    source.to(param.device_mesh.device_type), param.device_mesh, param.placements, src_data_rank=0
                )
            state[index][key] = value
    return {"state": state, "param_groups": skeleton["param_groups"]}


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _gathered(value: Any, keep: bool) -> Any:
    if not torch.is_tensor(value):
        return value
    value = full(value)
    return value.detach().to("cpu", copy=True) if keep else None


def _per_element(param: torch.Tensor, value: Any) -> bool:
    """A full per-element state of a DTensor parameter (scalars such as Adam's step are not)."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.shape
