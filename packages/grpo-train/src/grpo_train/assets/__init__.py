"""Model folders shipped inside the grpo-train wheel, resolvable by bare name.

The job: map a built-in model name (what `grpo train` with no config uses) to the folder that
HF `from_pretrained` and vLLM `LLM(model=...)` load. The boundary: this module only resolves
paths; it imports no torch and knows nothing about training. The folders themselves are built
by `scripts/build_tiny_model.py`; each has a README.md saying how.
"""

from __future__ import annotations

from pathlib import Path

_ASSETS_DIR = Path(__file__).resolve().parent

BUILTIN_MODELS: dict[str, str] = {
    "arith-tiny": (
        "Qwen2-style, ~1M parameters, character tokenizer; SFT-warmed to about half greedy accuracy "
        'on 2-digit addition (prompt "37+5=", answer "42" + <eos>, no BOS, no chat template)'
    ),
    "arith-tool-tiny": (
        "Qwen2-style, ~1M parameters, with a chat template that renders tools; SFT-warmed on 4-digit "
        "addition to call the `calculator` tool (Hermes format) in a minority of samples, answering "
        "directly (mostly wrong) otherwise; the model of grpo_tool_arith_tiny.yaml"
    ),
}
"""Built-in model names and a one-line description of each."""


def builtin_model_path(name: str) -> Path:
    """The folder of the built-in model `name`, ready for `from_pretrained` or vLLM.

    Raises ValueError for an unknown name (listing the known ones) and FileNotFoundError when the
    package was installed without its asset files.
    """
    if name not in BUILTIN_MODELS:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ValueError(f"unknown built-in model {name!r}; known built-in models: {known}")
    path = _ASSETS_DIR / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"built-in model {name!r} is missing its files at {path}; reinstall grpo-train from a wheel "
            "or rebuild it with scripts/build_tiny_model.py"
        )
    return path
