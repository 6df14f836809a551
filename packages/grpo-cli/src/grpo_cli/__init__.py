"""grpo-cli: the `grpo` command. Parses arguments before importing anything heavy."""

__version__ = "0.1.0"
