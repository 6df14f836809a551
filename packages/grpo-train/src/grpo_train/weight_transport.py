"""How new weights travel from the trainer to the generation engines: one class per transport.

Job: a registry of weight-sync transports chosen by `policy.generation.weight_transport`, each
with a driver-side `connect` (once) and `push` (after every training step), plus the pieces the
`collective` transport's two ends share: tensor metadata, the bucket plan and a stand-alone
process group. The receiving end of each transport lives in the vLLM worker extension
(`grpo_train.generation.vllm_worker_ext`) under the same name:

  - `object_store`: trainer rank 0 puts the full state dict in Ray's object store; each engine
    loads it (`grpo_load_weights`). Any placement, any backend; one full CPU copy in flight.
  - `collective`: trainer rank 0 and every vLLM worker join one process group (gloo on CPU,
    NCCL on GPUs) and rank 0 broadcasts the weights in buckets of at most
    `refit_buffer_size_gb` (`grpo_receive_weights`), so the extra memory on either side is one
    bucket, not a model copy. For separate placement.
  - `ipc`: colocated on GPUs, each vLLM worker opens CUDA IPC handles to the trainer's tensors on
    the same device (`grpo_load_ipc_weights`); GPU-only.

`push(..., **options)` hands `options` to every engine's receiving call: the async engine
(`generation.async_vllm`) takes `in_flight` and `reset_running_kv` there, the offline one none.

Boundary: no vLLM import; Ray only inside `connect`/`push`. The group's process group is
built from a TCPStore directly, never as torch.distributed's default group, because both the
trainer (data parallelism) and vLLM (its own workers) already own theirs.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

GIB = 1 << 30
# A broadcast waits this long for the other end before failing (a dead engine must not hang a run).
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to rebuild one tensor from a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self) -> int:
        import torch

        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_row(self) -> list:
        """Plain [name, shape, dtype]: what crosses vLLM's msgpack RPC into an engine process."""
        return [self.name, list(self.shape), self.dtype]

    @classmethod
    def from_row(cls, row: TensorMeta | list | tuple) -> TensorMeta:
        if isinstance(row, TensorMeta):
            return row
        name, shape, dtype = row
        return cls(str(name), tuple(int(d) for d in shape), str(dtype))


def tensor_metadata(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named_tensors]


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

    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=GROUP_TIMEOUT)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"unknown collective backend {backend!r}; expected 'gloo' or 'nccl'")


def _broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def send_buckets(group, tensors: Iterator[torch.Tensor], metas: list[TensorMeta], bucket_bytes: int,
                 device: torch.device) -> int:
    """Rank 0: broadcast `tensors` (in `metas` order) bucket by bucket; returns the bucket count.
    Only one flattened bucket exists at a time."""
    import torch

    buckets = plan_buckets(metas, bucket_bytes)
    for bucket in buckets:
        flat = torch.cat([next(tensors).detach().reshape(-1).to(device) for _ in bucket])
        _broadcast(group, flat)
        del flat
    return len(buckets)


def receive_buckets(group, metas: list[TensorMeta], bucket_bytes: int,
                    device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
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


# ------------------------------------------------------------------------ driver-side transports
class ObjectStoreTransport:
    """Rank 0's state dict through Ray's object store (the ObjectRef travels, not a driver copy)."""

    name: ClassVar[str] = "object_store"

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes

    def connect(self, policy, generators: list) -> None:
        return None

    def push(self, policy, generators: list, version: int, **options) -> None:
        import ray

        ref = policy.weights.remote()
        ray.get([g.update_weights.remote(ref, version, **options) for g in generators])


class CollectiveTransport:
    """Broadcast from trainer rank 0 into every vLLM worker of every engine, in buckets."""

    name: ClassVar[str] = "collective"

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes

    def connect(self, policy, generators: list) -> None:
        import ray

        host, port = ray.get(policy.free_address.remote())
        backend = ray.get(policy.collective_backend.remote())
        metas = ray.get(policy.weight_metadata.remote())
        sizes = ray.get([g.weight_group_size.remote() for g in generators])
        world_size = 1 + sum(sizes)
        calls = [policy.open_weight_group.remote(host, port, world_size, backend)]
        offset = 1
        for generator, size in zip(generators, sizes):
            calls.append(generator.open_weight_group.remote(host, port, offset, world_size, backend,
                                                            metas, self.bucket_bytes))
            offset += size
        ray.get(calls)

    def push(self, policy, generators: list, version: int, **options) -> None:
        import ray

        ray.get([policy.send_weights.remote(self.bucket_bytes),
                 *[g.receive_weights.remote(version, **options) for g in generators]])


class IpcTransport:
    """Colocated on GPUs: each vLLM worker maps the trainer's tensors on its own device
    (CUDA IPC handles through the object store, no copy of the weights)."""

    name: ClassVar[str] = "ipc"

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes

    def connect(self, policy, generators: list) -> None:
        import ray

        # Asked of the policy's rank, not the driver: a CPU-only head node drives GPU workers.
        if ray.get(policy.collective_backend.remote()) != "nccl":
            raise RuntimeError("policy.generation.weight_transport: 'ipc' needs GPUs; use 'object_store' or 'collective' on CPU")

    def push(self, policy, generators: list, version: int, **options) -> None:
        import ray

        handles = policy.ipc_handles.remote()
        ray.get([g.update_weights_ipc.remote(handles, version, **options) for g in generators])


TRANSPORTS: dict[str, type] = {cls.name: cls for cls in (ObjectStoreTransport, CollectiveTransport, IpcTransport)}


def choose_transport(name: str, colocated: bool, on_gpus: bool) -> str:
    """`auto` resolved by placement: ipc when colocated on GPUs, object_store when colocated on
    CPU (one machine's memory either way), collective when generation has its own resources."""
    if name != "auto":
        return name
    if colocated:
        return "ipc" if on_gpus else "object_store"
    return "collective"


def make_transport(name: str, refit_buffer_size_gb: float) -> Any:
    if name not in TRANSPORTS:
        raise ValueError(f"policy.generation.weight_transport: unknown transport {name!r}; expected one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name](max(1, int(refit_buffer_size_gb * GIB)))


__all__ = ["TRANSPORTS", "TensorMeta", "choose_transport", "free_address", "make_transport", "open_group", "plan_buckets",
           "receive_buckets", "send_buckets", "tensor_metadata"]
