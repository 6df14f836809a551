"""grpo-kernels."""

# Logprob and policy-gradient-loss ops; dispatch.py defers torch/triton to the first call.
from grpo_kernels.dispatch import (  # noqa: E402
    clipped_pg_loss,
    linear_token_logprobs,
    token_logprobs,
    vocab_parallel_token_logprobs,
)
from grpo_kernels.loss_config import PGLossConfig  # noqa: E402

# Sequence packing, imported on first access: packing.py needs numpy and the C++ extension,
# pack_tensors.py needs torch, and `import grpo_kernels` should pay for neither.
_PACKING_EXPORTS = {
    "PACKERS": "grpo_kernels.packing",
    "assign_bins": "grpo_kernels.packing",
    "pack_lengths": "grpo_kernels.packing",
    "split_bins_for_ranks": "grpo_kernels.packing",
    "PackedBatch": "grpo_kernels.pack_tensors",
    "pack_sequences": "grpo_kernels.pack_tensors",
    "unpack_sequences": "grpo_kernels.pack_tensors",
    "pack_padded": "grpo_kernels.pack_tensors",
    "unpack_padded": "grpo_kernels.pack_tensors",
}

__all__ = [
    "PGLossConfig",
    "clipped_pg_loss",
    "linear_token_logprobs",
    "token_logprobs",
    "vocab_parallel_token_logprobs",
    *_PACKING_EXPORTS,
]


def __getattr__(name: str):
    if name in _PACKING_EXPORTS:
        import importlib

        return getattr(importlib.import_module(_PACKING_EXPORTS[name]), name)
    raise AttributeError(f"module 'grpo_kernels' has no attribute {name!r}")
