"""`ipc` transport (GPU-only): colocated vLLM workers map the trainer's tensors on their own GPU.

Orchestration (`IpcTransport`): every trainer rank hands out CUDA IPC handles of its full
weights, keyed by its device's UUID, and every engine loads from the handles of its own GPU: no
copy of the weights in flight. For colocated placement on GPUs.
Trainer side: `send_ipc` (`PolicyWorker.send_ipc`). Engine side: `receive_ipc` (the vLLM
worker extension's `grpo_receive_ipc`).
Boundary: Ray only inside `connect`/`push`; no vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from grpo_train.refit.reload import reload_weights

if TYPE_CHECKING:
    import torch


class IpcTransport:
    """Colocated on GPUs: each vLLM worker maps the trainer's tensors on its own device
    (CUDA IPC handles through the object store, no copy of the weights)."""

    name: ClassVar[str] = "ipc"

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes

    def connect(self, policy, generators: list) -> None:
        # Asked of the policy's rank, not the driver: a CPU-only head node drives GPU workers.
        if policy.collective_backend() != "nccl":
            raise RuntimeError(
                "policy.generation.weight_transport: 'ipc' needs GPUs; use 'object_store' or 'collective' on CPU"
            )

    def push(self, policy, generators: list, version: int, **options) -> None:
        import ray

        handles = ray.put(policy.send_ipc())  # one copy in the object store for every engine
        ray.get([g.receive_ipc.remote(handles, version, **options) for g in generators])


def send_ipc(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list, dict[str, list]]:
    """The trainer's side: (the contiguous tensors, which the caller keeps alive while engines map
    them; their CUDA IPC handles keyed by this rank's device UUID, so the vLLM worker on the same
    GPU picks them)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    kept = [(name, t.contiguous()) for name, t in named_tensors]
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return kept, {uuid: [(name, reduce_tensor(t)) for name, t in kept]}


def receive_ipc(worker, handles_by_device: dict[str, list]) -> int:
    """The engine's side, inside a vLLM worker: map the trainer's tensors on this worker's GPU
    through CUDA IPC handles (keyed by device UUID) and reload from them, no copy in flight."""
    import torch

    uuid = str(torch.cuda.get_device_properties(worker.device).uuid)
    if uuid not in handles_by_device:
        raise RuntimeError(f"no trainer weights on this GPU ({uuid}); ipc needs colocated placement")
    items = []
    for name, (rebuild, args) in handles_by_device[uuid]:
        args = list(args)
        args[6] = worker.device.index  # the handle names the sender's device ordinal
        items.append((name, rebuild(*args)))
    reload_weights(worker, iter(items))
    return len(items)


__all__ = ["IpcTransport", "receive_ipc", "send_ipc"]
