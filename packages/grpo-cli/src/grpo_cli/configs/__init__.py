"""Built-in configs, resolvable by bare name (`grpo train --config grpo_math_1B.yaml`)."""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = "grpo_arith_tiny.yaml"
