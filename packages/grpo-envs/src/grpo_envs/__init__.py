"""grpo-envs."""
