"""grpo-cli."""
