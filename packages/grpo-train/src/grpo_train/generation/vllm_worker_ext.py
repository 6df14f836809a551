"""Receiver side of the weight push, running inside vLLM's worker.

Job: methods mixed into vLLM's worker through `worker_extension_cls` (this class is named by its
dotted path, so it must stay importable without side effects) and called with
`LLM.collective_rpc("<method>", args=...)`:
  - `grpo_set_logprob_temperature`: make the engine's logits, and so its logprobs, be
    `logits / T`;
  - `grpo_reseed`: restart the sampler's random streams (per-step seeding for exact resume);
  - the receivers of the weight transports, each a thin call into its transport's module of
    `grpo_train.refit`: `grpo_receive_object_store` (object_store), `grpo_open_collective` +
    `grpo_receive_collective` (collective: streamed buckets from trainer rank 0),
    `grpo_receive_ipc` (ipc, GPU-only).
Boundary: knows vLLM internals of one version (0.32) and nothing about training; the trainer
side (`VllmGenerator.update_weights`, `grpo_train.refit`) decides what to send and when.

How a reload works, and what vLLM leaves stale after one, is `grpo_train.refit.reload`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class GrpoWorkerExtension:
    """Mixed into vLLM's Worker; `self` is the worker (has `model_runner`, `vllm_config`)."""

    def grpo_receive_object_store(self, named_tensors: dict[str, torch.Tensor] | bytes) -> int:
        """`object_store`: `grpo_train.refit.object_store.receive_object_store`."""
        # vLLM imports this class by dotted path: each transport's module loads on its first use
        from grpo_train.refit.object_store import receive_object_store

        return receive_object_store(self, named_tensors)

    def grpo_set_logprob_temperature(self, temperature: float) -> float:
        """Scale the engine's logits by 1/temperature (sampling and prompt logprobs then are
        log_softmax(logits / temperature)); requests must sample at temperature 1 to keep their
        effective temperature. Returns the scale set."""
        if temperature <= 0:
            raise ValueError(f"logprob temperature must be > 0, got {temperature}")
        logits_processor = getattr(self.model_runner.get_model(), "logits_processor", None)
        if logits_processor is None or not hasattr(logits_processor, "scale"):
            raise RuntimeError(
                "this vLLM model has no logits_processor.scale; cannot report temperature-scaled logprobs"
            )
        # Some models carry their own logit scale; keep it and divide on top of it.
        if not hasattr(logits_processor, "_grpo_base_scale"):
            logits_processor._grpo_base_scale = float(logits_processor.scale)
        logits_processor.scale = logits_processor._grpo_base_scale / temperature
        return logits_processor.scale

    def grpo_reseed(self, seed: int) -> None:
        """Re-seed the sampler's random streams (Python, numpy, torch on every device) the way
        vLLM seeds them at start; requests themselves stay unseeded."""
        from vllm.utils.torch_utils import set_random_seed

        set_random_seed(int(seed))

    def grpo_logit_scale(self) -> float:
        return float(self.model_runner.get_model().logits_processor.scale)

    # -- transports (grpo_train.refit): each receiver is named after its transport --------------

    def grpo_open_collective(
        self, host: str, port: int, rank_offset: int, world_size: int, backend: str, metas: list, bucket_bytes: int
    ) -> int:
        """`collective`: `grpo_train.refit.collective.open_collective_receiver`."""
        # vLLM imports this class by dotted path: each transport's module loads on its first use
        from grpo_train.refit.collective import open_collective_receiver

        return open_collective_receiver(self, host, port, rank_offset, world_size, backend, metas, bucket_bytes)

    def grpo_receive_collective(self) -> int:
        """`collective`: `grpo_train.refit.collective.receive_collective`."""
        # vLLM imports this class by dotted path: each transport's module loads on its first use
        from grpo_train.refit.collective import receive_collective

        return receive_collective(self)

    def grpo_receive_ipc(self, handles_by_device: dict[str, list]) -> int:
        """`ipc` (GPU-only): `grpo_train.refit.ipc.receive_ipc`."""
        # vLLM imports this class by dotted path: each transport's module loads on its first use
        from grpo_train.refit.ipc import receive_ipc

        return receive_ipc(self, handles_by_device)


__all__ = ["GrpoWorkerExtension"]
