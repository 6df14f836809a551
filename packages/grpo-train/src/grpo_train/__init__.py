"""grpo-train."""
