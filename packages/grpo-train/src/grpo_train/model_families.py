"""Model families: the one registry of what differs between causal-LM architectures for grpo.

Job: per family (a transformers `model_type`), two things the generic code cannot know:
  - weight names: how the trainer's in-memory state dict maps to the checkpoint-format tensors
    the engine's loader (vLLM's `load_weights`) expects. transformers 5 converts some layouts at
    load time (Qwen3-MoE's experts become two fused tensors per layer) and reverts them on
    `save_pretrained`; a push must send the checkpoint layout, so the family reverts them too;
  - logits: what the causal-LM head does after the lm_head matmul that the trainer's own
    logprob path (`policy.logprobs`, which runs the backbone and the lm_head itself) must repeat:
    Gemma 2's final tanh soft-capping, Granite's division by `logits_scaling`.
Everything else is the same for every family here (Llama-style names, tied heads sent once as
the embedding, GPT-2's Conv1D transpose done by vLLM's own GPT-2 loader).

`family_of(config)` picks the rule; an unknown model type gets the plain rule, and a push whose
names then do not match the checkpoint fails with `UnsupportedFamilyError` naming the model
type and the tensors (`generation.base.check_weight_names`).
Boundary: torch only (no transformers or vLLM import); configs are read by attribute.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from grpo_train.errors import UnsupportedFamilyError  # re-exported: its old home

if TYPE_CHECKING:
    import torch


class Family:
    """The plain rule: checkpoint names are the state-dict names, the head is a plain matmul."""

    name: ClassVar[str] = "plain"
    # transformers model types this rule is tested for (see tests/test_model_families.py).
    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gpt2")

    def __init__(self, config: Any) -> None:
        self.config = config
        self.model_type = str(getattr(config, "model_type", "?"))

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint-format (name, tensor) pairs that one state-dict entry stands for
        (views where possible: no copies)."""
        yield name, tensor

    def logit_scale(self) -> float:
        """The head divides its logits by this (before any soft-capping)."""
        return 1.0

    def logit_softcap(self) -> float | None:
        """The head maps logits to cap * tanh(logits / cap) when set."""
        return None

    def attention_softcap(self) -> float | None:
        """Attention scores are soft-capped the same way when set (transformers' SDPA path
        ignores it; the trainer then runs `policy.logprobs.varlen_sdpa_attention`, which applies it)."""
        return None


class Qwen3MoeFamily(Family):
    """transformers 5 fuses each layer's experts into `mlp.experts.gate_up_proj` [E, 2I, H]
    (gate rows first, then up) and `mlp.experts.down_proj` [E, H, I]; the checkpoint (and vLLM's
    expert loader) has per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` ([I, H], [I, H],
    [H, I]: the same orientation, no transpose)."""

    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    _FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        match = self._FUSED.match(name)
        if match is None:
            yield name, tensor
            return
        prefix, kind = match["prefix"], match["kind"]
        if tensor.dim() != 3:
            raise UnsupportedFamilyError(
                f"model type {self.model_type!r}: fused expert tensor {name} has shape "
                f"{tuple(tensor.shape)}; expected [experts, out, in]"
            )
        for e in range(tensor.shape[0]):
            if kind == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up


class SoftcapFamily(Family):
    """Gemma 2 (and Gemma 3 when `final_logit_softcapping` is set): logits -> cap * tanh(logits / cap)."""

    name = "gemma"
    model_types = ("gemma2", "gemma3_text")

    def logit_softcap(self) -> float | None:
        cap = getattr(self.config, "final_logit_softcapping", None)
        return float(cap) if cap else None

    def attention_softcap(self) -> float | None:
        cap = getattr(self.config, "attn_logit_softcapping", None)
        return float(cap) if cap else None


class GraniteFamily(Family):
    """Granite divides its logits by `logits_scaling`."""

    name = "granite"
    model_types = ("granite",)

    def logit_scale(self) -> float:
        return float(getattr(self.config, "logits_scaling", 1.0) or 1.0)


FAMILIES: tuple[type[Family], ...] = (Family, Qwen3MoeFamily, SoftcapFamily, GraniteFamily)
BY_MODEL_TYPE: dict[str, type[Family]] = {t: cls for cls in FAMILIES for t in cls.model_types}


def supported_model_types() -> list[str]:
    return sorted(BY_MODEL_TYPE)


def family_of(config: Any) -> Family:
    """The rule for a transformers config (its text config for multimodal wrappers); the plain
    rule for a model type not in the registry."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return BY_MODEL_TYPE.get(str(getattr(text, "model_type", "")), Family)(text)


def checkpoint_named_tensors(
    config: Any, named: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """State-dict (name, tensor) pairs -> the checkpoint-format pairs the engine loads."""
    family = family_of(config)
    for name, tensor in named:
        yield from family.checkpoint_tensors(name, tensor)


def unsupported_names_message(config: Any, missing: list[str], extra: list[str], expected: int) -> str:
    """The one-line refusal of a push whose names do not match the engine's checkpoint."""
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    model_type = str(getattr(text, "model_type", "?"))
    known = (
        ""
        if model_type in BY_MODEL_TYPE
        else (
            f" (model type {model_type!r} is not in grpo's family registry, grpo_train.model_families; "
            f"supported: {', '.join(supported_model_types())})"
        )
    )
    return (
        f"weight push for model type {model_type!r}{known}: the engine's checkpoint has {expected} tensors; "
        f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
        f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}"
    )


__all__ = [
    "BY_MODEL_TYPE",
    "FAMILIES",
    "Family",
    "UnsupportedFamilyError",
    "checkpoint_named_tensors",
    "family_of",
    "supported_model_types",
    "unsupported_names_message",
]
