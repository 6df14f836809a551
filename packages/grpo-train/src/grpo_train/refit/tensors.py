"""What a refit pushes: the trainer model's weights as the engine's checkpoint loader expects them.

Job: turn a training model (plain, FSDP2-sharded or with peft's LoRA layers) into (checkpoint
name, full tensor) pairs (`iter_refit_tensors`), LoRA adapters merged into new tensors
(`merged_lora_weight`); every transport sends these, and the HF generator loads them.
Boundary: no Ray, no vLLM; how the tensors travel is the transports' (`grpo_train.refit`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def iter_refit_tensors(model: torch.nn.Module, gather: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full detached tensor) of every weight a generator loads, in state-dict
    order, on the model's device and without copies (the transports decide where tensors go).

    Names and layouts are the checkpoint's, as the engine's loader expects them: the model's
    family rule (`grpo_train.model_families`) reverts transformers' load-time conversions (e.g.
    Qwen3-MoE's fused experts become per-expert tensors, views of the fused ones).
    Tied weights are sent once, under the first name (`model.embed_tokens.weight`, not
    `lm_head.weight`): vLLM's loaders skip `lm_head.weight` for tied models and the worker
    extension re-processes the tied lm_head itself. Non-persistent buffers (rotary tables) are
    not part of the state dict and are never sent. DTensor (FSDP2) shards are gathered into
    full tensors, a collective call: every rank of the model must iterate together.
    `gather=False` yields meta tensors with the full weights' shapes and dtypes instead, which is
    enough for metadata and needs no other rank.
    """
    import torch

    # with torch above: the refit package stays importable without torch
    from grpo_train.model_families import family_of

    family = family_of(model.config) if hasattr(model, "config") else None
    modules = dict(model.named_modules())
    seen: set[int] = set()
    # keep_vars=True yields the Parameter objects themselves, so tied weights are one object.
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen or _LORA_TENSOR in name:  # adapter tensors: merged into their base weight below
            continue
        seen.add(id(tensor))
        tensor = tensor.detach()
        owner, _, leaf = name.rpartition(".")
        lora_layer = None
        if owner.endswith(_LORA_BASE):  # peft's wrapper: X.base_layer.weight is X.weight to the engine
            owner = owner[: -len(_LORA_BASE)]
            name, lora_layer = f"{owner}.{leaf}", modules[owner]
        if not gather:
            tensor = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        else:
            tensor = _full(tensor)  # DTensor (FSDP2 shard): gather the full weight
            if lora_layer is not None and leaf == "weight":
                tensor = merged_lora_weight(tensor, lora_layer)
        if family is None:
            yield name, tensor
        else:
            yield from family.checkpoint_tensors(name, tensor)


_LORA_TENSOR = ".lora_"  # peft's adapter parameters: X.lora_A.<adapter>.weight, X.lora_B.<adapter>.weight
_LORA_BASE = ".base_layer"  # peft's wrapped original layer


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def merged_lora_weight(weight, layer):
    """W + sum over active adapters of (B @ A) * scaling, computed in fp32 from full tensors and
    returned in W's dtype as a new tensor: the trainer's module is left unmerged (its weights
    bitwise unchanged). A layer whose adapters are disabled (the reference's context) gives W."""
    if getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return weight
    merged = weight.float()
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        a, b = _full(layer.lora_A[adapter].weight.detach()), _full(layer.lora_B[adapter].weight.detach())
        merged = merged + (b.float() @ a.float()).to(merged.device) * layer.scaling[adapter]  # [out, r] @ [r, in]
    return merged.to(weight.dtype)


def iter_adapter_tensors(model: torch.nn.Module, adapter: str = "default") -> Iterator[tuple[str, torch.Tensor]]:
    """`lora_cfg.refit: adapter`: (peft's saved name, full detached tensor) of each LoRA A/B weight of `adapter`,
    in state-dict order: `X.lora_A.<adapter>.weight` becomes `base_model.model.X.lora_A.weight`, the names of
    `PeftModel.save_pretrained` (what vLLM loads from a PEFT folder). `model` is the model peft injected the
    adapters into (the PolicyWorker's `self.model`). Only adapters travel: the engine keeps the checkpoint's
    base weights. DTensor (FSDP2) shards are gathered: every rank of the model must iterate together."""
    marker = f".{adapter}."
    for name, tensor in model.state_dict(keep_vars=True).items():
        if _LORA_TENSOR not in name or marker not in name or not name.endswith(".weight"):
            continue
        owner, kind = name.split(_LORA_TENSOR, 1)  # "lora_A.default.weight" / "lora_B.default.weight"
        kind = kind.replace(marker, ".", 1)
        yield f"base_model.model.{owner}.lora_{kind}", _full(tensor.detach())


def state_dict_for_refit(model: torch.nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights as a generator loads them (see `iter_refit_tensors`): HF parameter
    names, contiguous CPU tensors, optionally cast to `dtype`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in iter_refit_tensors(model):
        if dtype is not None:
            tensor = tensor.to(dtype)
        out[name] = tensor.to("cpu").contiguous()
    return out


__all__ = ["iter_adapter_tensors", "iter_refit_tensors", "merged_lora_weight", "state_dict_for_refit"]
