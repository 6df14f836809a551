"""`collective` transport: trainer rank 0 broadcasts the weights into every vLLM worker, in buckets.

Orchestration (`CollectiveTransport`): `connect` once joins rank 0 and every vLLM worker of every
engine in one process group (gloo on CPU, NCCL on GPUs) and hands the receivers the tensor
metadata; `push` after every step runs both halves at once. For separate placement: the extra
memory on either side is one bucket of at most `refit_buffer_size_gb` (`refit/buckets.py`).
Trainer side: `open_collective_sender` and `send_collective` (`PolicyWorker.open_collective`,
`PolicyWorker.send_collective`); under FSDP2 every rank iterates the weights, to gather.
Engine side: `open_collective_receiver` and `receive_collective` (the vLLM worker extension's
`grpo_open_collective`, `grpo_receive_collective`): the push is loaded as it streams in.
Boundary: Ray only inside `connect`/`push`; no vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, ClassVar

from grpo_train.refit.buckets import open_group, receive_buckets, send_buckets
from grpo_train.refit.metas import TensorMeta, tensor_metadata
from grpo_train.refit.reload import reload_weights

if TYPE_CHECKING:
    import torch


class CollectiveTransport:
    """Broadcast from trainer rank 0 into every vLLM worker of every engine, in buckets."""

    name: ClassVar[str] = "collective"

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes

    def connect(self, policy, generators: list) -> None:
        import ray

        host, port = policy.free_address()
        backend = policy.collective_backend()
        metas = policy.weight_metadata()
        sizes = ray.get([g.weight_group_size.remote() for g in generators])
        world_size = 1 + sum(sizes)
        calls = policy.submit_open_collective(host, port, world_size, backend)  # rank 0 and the engines join at once
        offset = 1
        for generator, size in zip(generators, sizes):
            calls.append(
                generator.open_collective.remote(host, port, offset, world_size, backend, metas, self.bucket_bytes)
            )
            offset += size
        ray.get(calls)

    def push(self, policy, generators: list, version: int, **options) -> None:
        import ray

        ray.get(
            [
                *policy.submit_send_collective(self.bucket_bytes),  # sent and received at once
                *[g.receive_collective.remote(version, **options) for g in generators],
            ]
        )


def open_collective_sender(host: str, port: int, world_size: int, backend: str):
    """The trainer's side, rank 0 only: join the weight group as its source (rank 0)."""
    return open_group(host, port, 0, world_size, backend)


def send_collective(
    group, refit_tensors: Callable[[bool], Iterator[tuple[str, torch.Tensor]]], bucket_bytes: int, device: torch.device
) -> int:
    """The trainer's side: broadcast `refit_tensors(True)` in buckets over `group` (rank 0);
    `refit_tensors(False)` gives their metadata. A rank without the group (under FSDP2) still
    iterates the weights, to take part in gathering each full tensor. Returns the buckets sent."""
    if group is None:
        for _ in refit_tensors(True):
            pass
        return 0
    metas = tensor_metadata(refit_tensors(False))
    tensors = (t for _, t in refit_tensors(True))
    return send_buckets(group, tensors, metas, bucket_bytes, device)


def open_collective_receiver(
    worker, host: str, port: int, rank_offset: int, world_size: int, backend: str, metas: list, bucket_bytes: int
) -> int:
    """The engine's side, inside a vLLM worker: join the trainer's weight group as rank
    `rank_offset` + this worker's rank and remember what every push carries (`metas`:
    `TensorMeta`s, or their plain rows when the call crossed vLLM's msgpack RPC from an
    `AsyncLLM`). Returns this worker's rank in the group."""
    rank = rank_offset + int(getattr(worker, "rank", 0))
    worker._grpo_group = open_group(host, port, rank, world_size, backend)
    worker._grpo_metas = [TensorMeta.from_row(m) for m in metas]
    worker._grpo_bucket_bytes, worker._grpo_backend = int(bucket_bytes), backend
    return rank


def receive_collective(worker) -> int:
    """The engine's side: load a push as it streams in, one bucket at a time. Returns the number
    of tensors loaded."""
    import torch

    if getattr(worker, "_grpo_group", None) is None:
        raise RuntimeError("grpo_receive_collective before grpo_open_collective")
    device = worker.device if worker._grpo_backend == "nccl" else torch.device("cpu")
    stream = receive_buckets(worker._grpo_group, worker._grpo_metas, worker._grpo_bucket_bytes, device)
    reload_weights(worker, stream, drain=stream)
    return len(worker._grpo_metas)


__all__ = [
    "CollectiveTransport",
    "open_collective_receiver",
    "open_collective_sender",
    "receive_collective",
    "send_collective",
]
