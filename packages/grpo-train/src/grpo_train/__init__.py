"""grpo-train: GRPO loops, policy workers, vLLM generation with weight refit.

Importing this package is cheap: no torch, no Ray, no vLLM until a component is built.
"""

__version__ = "0.1.0"
