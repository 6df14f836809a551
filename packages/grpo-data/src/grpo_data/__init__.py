"""grpo-data."""
