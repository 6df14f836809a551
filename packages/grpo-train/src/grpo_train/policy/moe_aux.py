"""MoE load-balancing auxiliary loss (`policy.moe_aux_loss_coeff`, off by default as in NeMo RL,
whose Megatron path names it the same way).

Job: during a training forward, record the router logits of every MoE layer and turn them into
the model's own load-balancing loss: the `load_balancing_loss_func` of the model's transformers
module (Switch Transformer's loss), with the model's `num_experts` and `num_experts_per_tok` and
the micro-batch's attention mask: the `aux_loss` that the HF forward returns with
`output_router_logits=True`. Which modules produce router logits is the model's own declaration
(`_can_record_outputs["router_logits"]`), so every transformers MoE family that declares it works
without a per-family rule; a model without it is refused.
Boundary: knows transformers' MoE conventions, nothing about the policy loss; the worker adds
`coeff * aux_loss * rows / train_global_batch_size` per micro-batch, so one micro-batch holding the
whole step adds exactly `coeff * aux_loss`.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from grpo_train.errors import NotMoEError  # re-exported: its old home


def _router_recorder(model_cls: type):
    recorders = getattr(model_cls, "_can_record_outputs", None) or {}
    return recorders.get("router_logits")


def _loss_func(model_cls: type):
    return getattr(sys.modules.get(model_cls.__module__), "load_balancing_loss_func", None)


def check_moe_model_class(model_cls: type, model_type: str) -> None:
    """Raise NotMoEError unless `model_cls` declares router logits and its module has the loss."""
    if _router_recorder(model_cls) is None or _loss_func(model_cls) is None:
        raise NotMoEError(
            f"model type {model_type!r} ({model_cls.__name__}) has no MoE router logits "
            "(load-balancing loss needs a mixture-of-experts model); set it to 0"
        )


def check_moe_config(config) -> None:
    """The startup twin of `check_moe_model_class`, from the HF config alone (no weights)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise NotMoEError(f"model type {config.model_type!r} has no transformers causal-LM class") from None
    check_moe_model_class(model_cls, config.model_type)


class RouterLogits:
    """Records router logits of `model` while `capture()` is active (forward hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        check_moe_model_class(type(model), model.config.model_type)
        recorder = _router_recorder(type(model))
        self._target, self._index = recorder.target_class, recorder.index
        self._loss = _loss_func(type(model))
        self._model = model
        self.logits: list[torch.Tensor] = []

    @contextmanager
    def capture(self):
        self.logits = []

        def hook(_module, _inputs, output):
            self.logits.append(output[self._index] if isinstance(output, tuple) else output)

        handles = [m.register_forward_hook(hook) for m in self._model.modules() if isinstance(m, self._target)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def aux_loss(self, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The model's load-balancing loss over the recorded layers; `attention_mask` [B, S] of the
        forward's input (None: every token counts, as for a packed stream)."""
        if not self.logits:
            raise RuntimeError("no router logits were recorded during the forward")
        model = self._model
        return self._loss(tuple(self.logits), model.num_experts, model.num_experts_per_tok, attention_mask)


__all__ = ["NotMoEError", "RouterLogits", "check_moe_config", "check_moe_model_class"]
