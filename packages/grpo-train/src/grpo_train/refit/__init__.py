"""Refit: the trained weights into the generation engines after every step, and the check.

One module per transport, each holding its orchestration (a driver-side class: `connect` once,
`push` after every step), its trainer-side sender and its engine-side receiver:

  - `object_store` (`object_store.py`): rank 0's state dict through Ray's object store;
  - `collective` (`collective.py`): rank 0 broadcasts into every vLLM worker, in buckets;
  - `ipc` (`ipc.py`): colocated on GPUs, vLLM workers map the trainer's tensors (GPU-only).

Shared pieces: `tensors` (what a push carries: checkpoint names, LoRA merged, FSDP2 gathered),
`metas` (tensor metadata), `buckets` (bucket plan, broadcast and its process group), `reload`
(the engine-side in-place reload every receiver ends in), `check` (the refit check's statistics
and gate). `push_weights` is the one push the loops, resume and engine restarts call.
Adding a transport: one module with its class, sender and receiver, and one line in `TRANSPORTS`.
Boundary: no vLLM import (the receivers run inside vLLM's worker, called by
`grpo_train.generation.vllm_worker_ext`); Ray only inside the transports' calls.
"""

from __future__ import annotations

import time
from typing import Any

from grpo_train.refit.collective import CollectiveTransport
from grpo_train.refit.ipc import IpcTransport
from grpo_train.refit.object_store import ObjectStoreTransport

GIB = 1 << 30

TRANSPORTS: dict[str, type] = {
    ObjectStoreTransport.name: ObjectStoreTransport,
    CollectiveTransport.name: CollectiveTransport,
    IpcTransport.name: IpcTransport,
}


def choose_transport(name: str, colocated: bool, on_gpus: bool, lora_refit: str | None = None) -> str:
    """`auto` resolved by placement: ipc when colocated on GPUs, object_store when colocated on
    CPU (one machine's memory either way), collective when generation has its own resources.
    `lora_refit` is `policy.dtensor_cfg.lora_cfg.refit` of a LoRA run (None without LoRA): `adapter`
    pushes only the adapters (a few MiB), always through the object store (the config refuses
    naming another transport with it)."""
    if lora_refit == "adapter":
        return ObjectStoreTransport.name
    if name != "auto":
        return name
    if colocated:
        return IpcTransport.name if on_gpus else ObjectStoreTransport.name
    return CollectiveTransport.name


def make_transport(name: str, refit_buffer_size_gb: float) -> Any:
    if name not in TRANSPORTS:
        raise ValueError(
            f"policy.generation.weight_transport: unknown transport {name!r}; expected one of {sorted(TRANSPORTS)}"
        )
    return TRANSPORTS[name](max(1, int(refit_buffer_size_gb * GIB)))


def push_weights(policy, version: int, **options) -> float:
    """The one weight push: the policy's trained weights into every engine over the transport
    attached to the policy group in setup (`PolicyGroup.attach`: the transport and the engines);
    `options` go to each engine's receiving call (the async engine's pause options). Seconds
    taken."""
    if policy.transport is None:
        raise RuntimeError("push_weights before PolicyGroup.attach: no weight transport is connected to the engines")
    start = time.perf_counter()
    policy.transport.push(policy, policy.generators, version, **options)
    return time.perf_counter() - start


__all__ = ["GIB", "TRANSPORTS", "choose_transport", "make_transport", "push_weights"]
