"""Bucketed broadcast: a push as consecutive same-dtype buckets over a process group.

Job: the bucket plan both ends compute from the same metadata (`plan_buckets`), the sender's
broadcast (`send_buckets`) and the receiver's lazy stream (`receive_buckets`), so the extra
memory on either side is one bucket, not a model copy; and the stand-alone process group they
broadcast over (`open_group`), built from a TCPStore directly, never as torch.distributed's
default group, because both the trainer (data parallelism) and vLLM (its own workers) already
own theirs. Used by the `collective` transport (`refit/collective.py`).
Boundary: torch only inside functions; no Ray, no vLLM.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

from grpo_train.refit.metas import TensorMeta

if TYPE_CHECKING:
    import torch

# A broadcast waits this long for the other end before failing (a dead engine must not hang a run).
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Consecutive runs of same-dtype tensors of at most `bucket_bytes` each (a larger tensor
    gets a bucket of its own). Sender and receiver compute the same plan from the same inputs."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, meta in enumerate(metas):
        nbytes = meta.nbytes()
        if not buckets or meta.dtype != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, meta.dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


def free_address() -> tuple[str, int]:
    """This machine's address as other nodes see it, and a free TCP port on it."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind(("", 0))
        return host, sock.getsockname()[1]


def open_group(host: str, port: int, rank: int, world_size: int, backend: str):
    """A process group of `world_size` ranks that rendezvous at host:port (rank 0 hosts the
    store), independent of torch.distributed's default group."""
    import torch.distributed as dist

    # torch exports TCPStore and takes NCCL's options as optional at run time; its stubs say neither.
    tcp_store = dist.TCPStore  # pyright: ignore[reportPrivateImportUsage]
    store = tcp_store(host, port, world_size, is_master=rank == 0, timeout=GROUP_TIMEOUT)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)  # pyright: ignore[reportCallIssue]
    raise ValueError(f"unknown collective backend {backend!r}; expected 'gloo' or 'nccl'")


def _broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def send_buckets(
    group, tensors: Iterator[torch.Tensor], metas: list[TensorMeta], bucket_bytes: int, device: torch.device
) -> int:
    """Rank 0: broadcast `tensors` (in `metas` order) bucket by bucket; returns the bucket count.
    Only one flattened bucket exists at a time."""
    import torch

    buckets = plan_buckets(metas, bucket_bytes)
    for bucket in buckets:
        flat = torch.cat([next(tensors).detach().reshape(-1).to(device) for _ in bucket])
        _broadcast(group, flat)
        del flat
    return len(buckets)


def receive_buckets(
    group, metas: list[TensorMeta], bucket_bytes: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Other ranks: yield (name, tensor) as each bucket arrives; lazy, so a consumer that loads
    tensors as they come holds one bucket at a time."""
    import torch

    for bucket in plan_buckets(metas, bucket_bytes):
        dtype = getattr(torch, metas[bucket[0]].dtype)
        flat = torch.empty(sum(metas[i].numel for i in bucket), dtype=dtype, device=device)
        _broadcast(group, flat)
        offset = 0
        for i in bucket:
            meta = metas[i]
            yield meta.name, flat[offset : offset + meta.numel].view(meta.shape)
            offset += meta.numel


__all__ = ["GROUP_TIMEOUT", "free_address", "open_group", "plan_buckets", "receive_buckets", "send_buckets"]
