"""Mixed precision: one definition for the policy, the reference and the value model.

`policy.precision` (`value.precision`) is the compute dtype. Whatever it is, the weights the
optimizer updates and its state stay fp32 (master weights), forward and backward run on a copy
of the parameters in the compute dtype, and gradients are summed over ranks in fp32. At a
bf16 run's usual lr (5e-6) an AdamW update is ~5e-6 of a weight, far below bf16's resolution
(2^-8 relative): applied to bf16 parameters most updates round to nothing.

Two carriers of the same arithmetic:
- FSDP2 ranks: `fsdp_policy` is `MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32)`:
  the sharded parameters are the fp32 masters; each unit's all-gather casts them to the compute
  dtype, backward yields compute-dtype gradients that are cast to fp32 and reduce-scattered
  into fp32 sharded gradients (accumulated in fp32 over micro-batches).
- Unsharded workers: `MasterWeights`. The module's parameters are the compute copy; fp32
  masters sit beside them. After each micro-batch's backward the compute-dtype gradients are
  cast to fp32 and added into the masters' gradients (`accumulate`), ranks sum the fp32
  gradients, the optimizer steps the masters, and `refresh` re-casts them into the compute copy.
  Buffers (rotary tables) stay as loaded, as under FSDP2, which casts parameters only.
So a CPU worker runs the matmuls in bf16 exactly as a GPU rank does (no autocast, whose
fp32 norms and softmax the GPU path does not have). With fp32 compute both are identities.

Boundary: knows nothing of losses, batches, checkpoints' files or Ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fsdp_policy(dtype: torch.dtype):
    """FSDP2's mixed-precision policy for a compute dtype (None for fp32: nothing to cast)."""
    if dtype == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """The module's parameters (tied ones stay tied) in `dtype`, in place; buffers untouched."""
    with torch.no_grad():
        for p in module.parameters():
            p.data = p.data.to(dtype)


class MasterWeights:
    """fp32 master copies of an unsharded module's parameters; the module computes in `dtype`.

    Build it on the module loaded in fp32: the masters take the loaded values and the module's
    parameters are cast to `dtype`. With `dtype` fp32 the masters are the module's parameters.
    Only trainable parameters (requires_grad) get masters: frozen ones (a LoRA run's base
    weights) are only cast to the compute dtype, so they cost no fp32 copy and no optimizer state.
    """

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.module, self.dtype = module, dtype
        # a tied parameter once, under its first name
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.compute = [p for _, p in named]
        if self.mixed:
            self.masters = [
                torch.nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad) for p in self.compute
            ]
            cast_parameters(module, dtype)
        else:
            self.masters = self.compute

    @property
    def mixed(self) -> bool:
        return self.dtype != torch.float32

    def parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps and the gradients are reduced and clipped over."""
        return self.masters

    def accumulate(self) -> None:
        """After a backward: the compute-dtype gradients, cast to fp32, added into the masters'."""
        if not self.mixed:
            return
        for master, p in zip(self.masters, self.compute):
            if p.grad is None:
                continue
            grad = p.grad.float()
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            p.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """After an optimizer step (or a load): the compute copy from the masters."""
        if self.mixed:
            for master, p in zip(self.masters, self.compute):
                p.copy_(master)

    def state(self) -> dict[str, torch.Tensor]:
        """The fp32 masters by parameter name, on CPU (what a checkpoint keeps)."""
        return {name: m.detach().to("cpu", copy=True) for name, m in zip(self.names, self.masters)}

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor]) -> str | None:
        """Masters from a state dict (fp32 masters, or a model's weights in any dtype), then the
        compute copy; a tied alias the state leaves out is the same parameter. Returns what
        does not match (and loads nothing then)."""
        missing = [name for name in self.names if name not in state]
        if missing:
            return f"missing {missing}"
        for name, master in zip(self.names, self.masters):
            master.copy_(state[name])
        self.refresh()
        return None

    def release(self) -> torch.nn.Module:
        """The module with its parameters back in fp32 (the masters' values), for FSDP2 to shard
        with `fsdp_policy`; this object is then an identity."""
        if self.mixed:
            with torch.no_grad():
                for master, p in zip(self.masters, self.compute):
                    p.data = master.data
            cast_parameters(self.module, torch.float32)  # frozen parameters too: FSDP2 shards one dtype
            self.dtype, self.masters = torch.float32, self.compute
        return self.module


def compute_tensors(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) with floating tensors in the compute dtype: what a refit pushes and an HF
    export writes (FSDP2's full tensors are the fp32 masters)."""
    for name, tensor in named:
        yield name, tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor
