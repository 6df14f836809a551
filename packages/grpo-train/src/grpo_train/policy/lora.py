"""LoRA adapters on the policy model, built with peft (`policy.dtensor_cfg.lora_cfg`).

Job: turn a `LoRAConfig` into peft's `LoraConfig`, inject the adapters into an HF causal LM in
place (the module tree keeps its names, so logprobs, FSDP2's per-layer units and the refit's
name rules still find `model.model.layers`), initialise lora_A the same on every data-parallel
rank, and check the config against a model before anything trains. The merged refit lives in
`grpo_train.refit.tensors` (it needs no peft); the worker decides what trains and what is saved.
Boundary: knows nothing of losses, batches, files or Ray.
"""

from __future__ import annotations

from typing import cast

import torch

from grpo_train.config.schema import LoRAConfig

KEY = "policy.dtensor_cfg.lora_cfg"
ADAPTER = "default"  # peft's adapter name; the only adapter a policy carries
# Keys of HF model configs that mark a mixture-of-experts model: its expert weights are fused
# parameters in current transformers (not nn.Linear), which peft's LoRA layers do not adapt.
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


class LoRAConfigError(ValueError):
    """A lora_cfg the model cannot honour; `key` is the config path to name."""

    def __init__(self, detail: str, key: str = KEY):
        super().__init__(f"{key}: {detail}")
        self.key = key


def peft_config(cfg: LoRAConfig, task_type: str | None = "CAUSAL_LM"):
    """peft's LoraConfig for our names (dim -> r, alpha -> lora_alpha, match_all_linear -> "all-linear").
    `task_type` None: a plain backbone (the value model's), wrapped by peft's generic PeftModel."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.dim,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        bias="none",
        task_type=task_type,
        target_modules="all-linear" if cfg.match_all_linear else list(cfg.target_modules),
        exclude_modules=list(cfg.exclude_modules) or None,
    )


def _matches(module_name: str, pattern: str) -> bool:
    """peft's rule for a list entry: the full module name or its dotted suffix."""
    return module_name == pattern or module_name.endswith("." + pattern)


def check_lora(model: torch.nn.Module, cfg: LoRAConfig, key: str = KEY) -> None:
    """Refuse, at its key, a lora_cfg this model cannot take: a MoE model, a target_modules
    entry that names no linear module, a selection left empty by exclude_modules, or an adapter
    on a tied output head (the refit sends tied weights once, so a merged head would be lost).
    `model` may be on the meta device (start-up checks build it without weights). `key`: the
    lora_cfg's path (the policy's, or value.lora_cfg)."""
    config = getattr(model, "config", None)
    if any(getattr(config, k, None) for k in MOE_CONFIG_KEYS):
        raise LoRAConfigError(
            "LoRA on mixture-of-experts models is not supported (their expert weights are fused "
            "parameters, not linear layers peft adapts); set enabled: false",
            key=f"{key}.enabled",
        )
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for pattern in cfg.target_modules:
        if not any(_matches(n, pattern) for n in linears):
            raise LoRAConfigError(
                f"{pattern!r} matches no linear module of the model (e.g. {linears[0]!r}); "
                "set module names or suffixes such as q_proj",
                key=f"{key}.target_modules",
            )
    head = "lm_head"
    if cfg.match_all_linear:  # peft's "all-linear" leaves the output head out
        chosen = [n for n in linears if n != head]
    else:
        chosen = [n for n in linears if any(_matches(n, p) for p in cfg.target_modules)]
    chosen = [n for n in chosen if not any(_matches(n, p) for p in cfg.exclude_modules)]
    if not chosen:
        raise LoRAConfigError(
            "excludes every module the selection chose: no layer gets an adapter; set fewer exclude_modules",
            key=f"{key}.exclude_modules",
        )
    if head in chosen and getattr(config, "tie_word_embeddings", False):
        raise LoRAConfigError(
            "an adapter on lm_head of a model with tied embeddings is not supported; "
            "set target_modules without lm_head",
            key=f"{key}.target_modules",
        )


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig, seed: int, task_type: str | None = "CAUSAL_LM", key: str = KEY):
    """Inject adapters into `model` in place and return the PeftModel around it (for
    `disable_adapter` and `save_pretrained`). Only adapter parameters require grad. lora_A is
    drawn from a generator seeded by `seed` alone, so every data-parallel rank starts from the
    same adapters; lora_B starts at zero (the adapted model equals the base model at step 0).
    `task_type` and `key`: as in `peft_config` and `check_lora` (the value model passes None
    and value.lora_cfg)."""
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    check_lora(model, cfg, key)
    peft_model = get_peft_model(model, peft_config(cfg, task_type))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in sorted((n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)):
            weight = cast(torch.Tensor, layer.lora_A[ADAPTER].weight)
            if cfg.lora_A_init == "xavier":
                torch.nn.init.xavier_uniform_(weight, generator=gen)
            else:  # peft's own default: kaiming-uniform with a = sqrt(5)
                torch.nn.init.kaiming_uniform_(weight, a=5**0.5, generator=gen)
            torch.nn.init.zeros_(cast(torch.Tensor, layer.lora_B[ADAPTER].weight))
    return peft_model


def check_lora_for_model_path(model_path: str, cfg: LoRAConfig, key: str = KEY, backbone: bool = False) -> None:
    """`check_lora` on the real model's module tree, built on the meta device (no weights read).
    `backbone`: the model without its LM head (AutoModel), as the value model builds it."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = (AutoModel if backbone else AutoModelForCausalLM).from_config(config)
    check_lora(model, cfg, key)
