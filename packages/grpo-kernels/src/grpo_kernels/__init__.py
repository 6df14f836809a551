"""grpo-kernels."""

# Logprob and policy-gradient-loss ops; dispatch.py defers torch/triton to the first call.
from grpo_kernels.dispatch import clipped_pg_loss, linear_token_logprobs, token_logprobs  # noqa: E402
from grpo_kernels.loss_config import PGLossConfig  # noqa: E402
