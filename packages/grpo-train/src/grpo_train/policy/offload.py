"""A rank's training state between its device and the host, by part (colocated memory choreography).

Parts (`grpo_train.colocation` decides which, when):
  weights     the module's parameters (the compute copy, or FSDP2's fp32 shards), its buffers and,
              in mixed precision, the fp32 masters beside them
  gradients   the fp32 gradients (masters' or module's): freed, not moved (torch keeps a gradient on
              its parameter's device, and each optimizer step starts from zeroed gradients)
  optimizer   the optimizer's per-parameter state tensors (AdamW's moments); the scalar `step`
              counters stay where torch keeps them
  reference   the frozen reference model
Modules move with `Module.to`, which FSDP2 modules support (they re-register their shards);
loose tensors (masters, gradients, optimizer state) are swapped in place (`.data` / dict entries),
so the optimizer keeps the same Parameter objects.
Boundary: no Ray, no knowledge of engines or phases; no CUDA call (the worker empties the cache).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

PARTS = ("weights", "gradients", "optimizer", "reference")


@torch.no_grad()
def move_parts(
    parts: Iterable[str],
    device: torch.device | str,
    model: torch.nn.Module,
    masters: list,
    optimizer: torch.optim.Optimizer,
    reference: torch.nn.Module | None,
    offloading: bool = True,
) -> None:
    """Move `parts` of the state to `device` (gradients: freed when `offloading`, nothing to bring back);
    `masters` are the optimizer's parameters (the module's own when they are not separate fp32 copies)."""
    for part in parts:
        if part == "weights":
            model.to(device)  # parameters, their gradients and buffers
            for m in masters:  # separate fp32 masters (else already moved with the module)
                if m.device != torch.device(device):
                    _swap_device(m, device)
        elif part == "gradients":
            if offloading:  # reloading: the next step makes new ones
                for p in [*model.parameters(), *masters]:
                    p.grad = None
        elif part == "optimizer":
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        state[key] = value.to(device)
        elif part == "reference":
            if reference is not None:
                reference.to(device)
        else:
            raise ValueError(f"unknown state part {part!r}; expected one of {PARTS}")


def _swap_device(p: torch.nn.Parameter, device: torch.device | str) -> None:
    """`p` (and its gradient) on `device`, the same Python object (the optimizer keys its state by it)."""
    grad = p.grad
    p.grad = None
    moved = torch.nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, moved)
    if grad is not None:
        p.grad = grad.to(device)


def state_tensors(
    model: torch.nn.Module, masters: list, optimizer: torch.optim.Optimizer, reference: torch.nn.Module | None
) -> dict[str, list[torch.Tensor]]:
    """Every tensor of each part (what `move_parts` is responsible for), for tests and accounting."""
    params = [*model.parameters(), *masters]
    return {
        "weights": [*params, *model.buffers()],
        "gradients": [p.grad for p in params if p.grad is not None],
        "optimizer": [
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
        ],
        "reference": [*reference.parameters(), *reference.buffers()] if reference is not None else [],
    }
