"""grpo-kernels."""
