"""`object_store` transport: trainer rank 0's full state dict through Ray's object store.

Orchestration (`ObjectStoreTransport`): rank 0 puts its weights in the object store and every
engine loads them (the ObjectRef travels, not a driver copy). Any placement, any backend; one
full CPU copy in flight.
Trainer side: `send_object_store` (`PolicyWorker.weights`): contiguous CPU tensors.
Engine side: `receive_object_store` (the vLLM worker extension's `grpo_receive_object_store`): the
name->tensor dict, or the same dict as safetensors bytes (`serialize_weights`) for an engine in
another process; the HF generator loads the dict in its `update_weights`.
Boundary: Ray only inside `push`; no vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from grpo_train.refit.reload import reload_weights

if TYPE_CHECKING:
    import torch


class ObjectStoreTransport:
    """Rank 0's state dict through Ray's object store (the ObjectRef travels, not a driver copy)."""

    name: ClassVar[str] = "object_store"

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes

    def connect(self, policy, generators: list) -> None:
        return None

    def push(self, policy, generators: list, version: int, **options) -> None:
        import ray

        ref = policy.submit_weights()
        ray.get([g.update_weights.remote(ref, version, **options) for g in generators])


def send_object_store(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The trainer's side: HF-named contiguous CPU tensors, in the order given."""
    return {name: t.to("cpu").contiguous() for name, t in named_tensors}


def serialize_weights(named_tensors: dict[str, torch.Tensor]) -> bytes:
    """Sender twin of the bytes path of `grpo_receive_object_store`."""
    from safetensors.torch import save as save_safetensors

    return save_safetensors({k: v.detach().cpu().contiguous() for k, v in named_tensors.items()})


def receive_object_store(worker, named_tensors: dict[str, torch.Tensor] | bytes) -> int:
    """The engine's side, inside a vLLM worker: reload weights in place; `named_tensors` is a
    name->tensor dict, or the same dict serialised with `safetensors.torch.save` (for engines in
    another process, where tensors cannot travel as RPC arguments). Returns the number of tensors
    loaded."""
    if isinstance(named_tensors, (bytes, bytearray, memoryview)):
        from safetensors.torch import load as load_safetensors

        named_tensors = load_safetensors(bytes(named_tensors))
    items = list(named_tensors.items())
    if not items:
        raise ValueError("grpo_receive_object_store got no tensors")
    reload_weights(worker, iter(items))
    return len(items)


__all__ = ["ObjectStoreTransport", "receive_object_store", "send_object_store", "serialize_weights"]
