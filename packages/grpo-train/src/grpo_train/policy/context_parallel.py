"""Context parallelism (CP) of the policy on PyTorch's own ring attention, CPU kernel included.

`torch.distributed.tensor.experimental.context_parallel` shards a sequence's tokens over a CP mesh
(head-tail load balancing: rank r of c holds chunks r and 2c-1-r of 2c, so causal work is even),
turns `F.scaled_dot_product_attention`'s q/k/v into DTensors sharded on the sequence dim, and hands
the fused SDPA op to a ring loop (`_templated_ring_attention` and its backward twin): k/v rotate
over the group, each step runs the per-chunk kernel, which returns (out, logsumexp), and the
partial outputs merge through their logsumexps. In torch 2.13 that loop is wired only to the CUDA
kernels (`_scaled_dot_product_{flash,efficient,cudnn}_attention`); on CPU SDPA lowers to
`aten._scaled_dot_product_flash_attention_for_cpu`, which also returns (out, logsumexp) and has a
backward that takes the merged out and logsumexp, so the same loop drives it unchanged.
`register_cpu_ring_attention` adds the two CPU ops to DTensor's custom-op handler table, each
handler calling torch's ring loop with the CPU op. Nothing of torch's is copied.

Private torch API this depends on (`check_torch_api` names each and fails loudly when one moves;
tests/test_context_parallel.py pins it):
  torch.distributed.tensor.experimental._context_parallel._attention:
    `_templated_ring_attention(group, seq_dim, op, query, key, value, is_causal, **kwargs)`,
    `_templated_ring_attention_backward(group, seq_dim, op, grad_out, grad_out_name, query, key,
    value, out, logsumexp, is_causal, **kwargs)`, `_cp_options.enable_load_balance`,
    `existing_custom_ops` (the dispatcher's base handler table, restored when a CP context exits);
  `DTensor._op_dispatcher._custom_op_handlers` (op -> handler(op, args, kwargs)).

The handlers sit in the base table, so the backward of a forward run under `context_parallel`
also runs as ring attention after the context has exited (the training loss backward does).

`cp_sequence_logprobs` is `logprobs.sequence_logprobs` under CP: right-padded rows (causal
attention without a mask: real tokens never see the padding after them), the targets sharded with
the tokens, each rank's logprobs gathered over the CP group in the original order. The gather's
backward keeps each rank's own slice: every CP rank computes the same loss on the gathered
logprobs, so the slice is that rank's gradient; parameter gradients are then partial per rank
and are summed over the CP group (the worker's `_reduce_gradients`).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from grpo_train.policy.logprobs import IGNORE_INDEX, _target_logprobs

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# The attention implementation a model runs under CP: transformers' SDPA attention unchanged, with a
# mask function that builds no mask during a CP forward. transformers would otherwise read the
# load-balanced (non-contiguous) position ids as packed sequences and build a block mask of the
# local length, which SDPA cannot take under CP.
CP_ATTENTION = "grpo_cp_sdpa"
_CP_CALL = contextvars.ContextVar("grpo_cp_call", default=False)
_FWD = "_scaled_dot_product_flash_attention_for_cpu"
_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"
_SEQ_DIM = 2  # q/k/v are [B, heads, S, D]
_RING_FWD_PARAMS = ("group", "seq_dim", "op", "query", "key", "value", "is_causal")
_RING_BWD_PARAMS = (
    "group",
    "seq_dim",
    "op",
    "grad_out",
    "grad_out_name",
    "query",
    "key",
    "value",
    "out",
    "logsumexp",
    "is_causal",
)


def _cp_module():
    import torch.distributed.tensor.experimental._context_parallel._attention as cp_attention

    return cp_attention


def check_torch_api() -> None:
    """Raise RuntimeError naming what moved if torch's private CP pieces this module drives changed."""
    from torch.distributed.tensor import DTensor

    cpa = _cp_module()
    problems = []
    for name, params in (
        ("_templated_ring_attention", _RING_FWD_PARAMS),
        ("_templated_ring_attention_backward", _RING_BWD_PARAMS),
    ):
        fn = getattr(cpa, name, None)
        if fn is None:
            problems.append(f"{name} is gone")
        elif tuple(inspect.signature(fn).parameters)[: len(params)] != params:
            problems.append(f"{name}{inspect.signature(fn)} no longer starts with {params}")
    if not hasattr(getattr(cpa, "_cp_options", None), "enable_load_balance"):
        problems.append("_cp_options.enable_load_balance is gone")
    if not isinstance(getattr(cpa, "existing_custom_ops", None), dict):
        problems.append("existing_custom_ops (the base custom-op handler table) is gone")
    if not isinstance(getattr(DTensor._op_dispatcher, "_custom_op_handlers", None), dict):
        problems.append("DTensor._op_dispatcher._custom_op_handlers is gone")
    for op in (_FWD, _BWD):
        if not hasattr(torch.ops.aten, op):
            problems.append(f"aten.{op} is gone")
    if problems:
        raise RuntimeError(
            f"context parallelism on CPU needs torch {torch.__version__}'s private context-parallel "
            "API as of 2.13 (grpo_train.policy.context_parallel): " + "; ".join(problems)
        )


def _sharded_mesh(op_name: str, args: tuple) -> DeviceMesh:
    """The 1-D CP mesh of the DTensor arguments; refuses any other layout (this is CP's op only)."""
    from torch.distributed.tensor import DTensor, Shard

    meshes = {a.device_mesh for a in args if isinstance(a, DTensor)}
    placements = {tuple(a.placements) for a in args if isinstance(a, DTensor)}
    if len(meshes) != 1 or placements != {(Shard(_SEQ_DIM),)}:
        raise NotImplementedError(
            f"aten.{op_name} on DTensors: only context parallelism's layout (one 1-D mesh, "
            f"Shard({_SEQ_DIM}) everywhere) is handled, got {placements}"
        )
    return meshes.pop()


def _local(value):
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _wrap(tensors, mesh) -> tuple:
    from torch.distributed.tensor import DTensor, Shard

    return tuple(DTensor.from_local(t, mesh, [Shard(_SEQ_DIM)], run_check=False) for t in tensors)


def _refuse_extras(op_name: str, dropout_p: float, attn_mask) -> None:
    if attn_mask is not None:
        raise NotImplementedError(
            f"context parallelism: aten.{op_name} with an attention mask (only causal SDPA "
            "without a mask is ring-sharded)"
        )
    if dropout_p:
        raise NotImplementedError(f"context parallelism: aten.{op_name} with attention dropout {dropout_p}")


def _load_balanced():
    """torch's ring loop reads the load-balancing switch when it runs; CP here always shards head-tail."""
    import contextlib

    @contextlib.contextmanager
    def switch():
        options = _cp_module()._cp_options
        before, options.enable_load_balance = options.enable_load_balance, True
        try:
            yield
        finally:
            options.enable_load_balance = before

    return switch()


def _ring_forward(op_call, args: tuple, kwargs: dict) -> tuple:
    """aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)."""
    mesh = _sharded_mesh(_FWD, args)
    query, key, value = (_local(a) for a in args[:3])
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    _refuse_extras(_FWD, dropout_p, kwargs.get("attn_mask"))
    if not is_causal:
        raise NotImplementedError(
            f"context parallelism: aten.{_FWD} without is_causal (only causal attention is load-balanced)"
        )
    with _load_balanced():
        out, lse = _cp_module()._templated_ring_attention(
            mesh.get_group(),
            _SEQ_DIM,
            getattr(torch.ops.aten, _FWD).default,
            query,
            key,
            value,
            is_causal=True,
            scale=kwargs.get("scale"),
        )
    return _wrap((out, lse), mesh)


def _ring_backward(op_call, args: tuple, kwargs: dict) -> tuple:
    """aten._..._for_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)."""
    mesh = _sharded_mesh(_BWD, args)
    grad_out, query, key, value, out, lse = (_local(a) for a in args[:6])
    dropout_p = args[6] if len(args) > 6 else kwargs.get("dropout_p", 0.0)
    is_causal = args[7] if len(args) > 7 else kwargs.get("is_causal", False)
    _refuse_extras(_BWD, dropout_p, kwargs.get("attn_mask"))
    with _load_balanced():
        grads = _cp_module()._templated_ring_attention_backward(
            mesh.get_group(),
            _SEQ_DIM,
            getattr(torch.ops.aten, _BWD).default,
            grad_out=grad_out,
            grad_out_name="grad_out",
            query=query,
            key=key,
            value=value,
            out=out,
            logsumexp=lse,
            is_causal=is_causal,
            dropout_p=0.0,
            scale=kwargs.get("scale"),
        )
    return _wrap(grads[:3], mesh)


def register_cpu_ring_attention() -> None:
    """Route the CPU flash SDPA op (fwd, bwd) on CP-sharded DTensors to torch's ring loop. Idempotent."""
    from torch.distributed.tensor import DTensor

    check_torch_api()
    handlers = {
        getattr(torch.ops.aten, _FWD).default: _ring_forward,
        getattr(torch.ops.aten, _BWD).default: _ring_backward,
    }
    _cp_module().existing_custom_ops.update(handlers)  # the base table: live outside a CP context too
    DTensor._op_dispatcher._custom_op_handlers.update(handlers)  # the live table (a merged copy inside one)


@functools.cache
def _register_cp_attention() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CP_ATTENTION, sdpa_attention_forward)

    def cp_mask(*args, **kwargs):  # CP forwards: causal SDPA, no mask; any other call: SDPA's own mask
        return None if _CP_CALL.get() else sdpa_mask(*args, **kwargs)

    AttentionMaskInterface.register(CP_ATTENTION, cp_mask)


def cp_model_problem(config) -> str | None:
    """Why a model (its HF config) cannot run under CP, or None: CP rings transformers' SDPA attention
    over full causal attention only (no sliding window, no attention logit soft-capping)."""
    # model_families: read only when a CP model is checked
    from grpo_train.model_families import family_of

    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", CP_ATTENTION):
        return (
            f"the model's attention is attn_implementation={impl!r}; context parallelism rings transformers' "
            "'sdpa' attention only"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return (
            f"the model uses sliding-window attention (sliding_window={config.sliding_window}); context "
            "parallelism rings full causal attention only"
        )
    if family_of(config).attention_softcap():
        return "the model soft-caps its attention logits, which SDPA (and so its ring) cannot; set 1"
    return None


def use_cp_attention(model: torch.nn.Module) -> None:
    """Switch a model on transformers' SDPA attention to CP_ATTENTION (idempotent); refuse any other."""
    hf_model = cast(Any, model)  # a transformers PreTrainedModel
    if (problem := cp_model_problem(hf_model.config)) is not None:
        raise NotImplementedError(f"policy.dtensor_cfg.context_parallel_size: {problem}")
    if hf_model.config._attn_implementation == CP_ATTENTION:
        return
    _register_cp_attention()
    hf_model.set_attn_implementation(CP_ATTENTION)


class _GatherSequence(torch.autograd.Function):
    """All-gather [B, n] over the CP group -> [cp, B, n]; backward keeps this rank's slice (every CP
    rank computes the same function of the gathered tensor, so the slice is the whole gradient)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank], None


def _check_right_padded(attention_mask: torch.Tensor) -> None:
    if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
        raise ValueError(
            "context parallelism needs right-padded rows (attention_mask ones then zeros): causal "
            "attention without a mask must never let a real token see padding"
        )


def cp_sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    mesh,
    fused: bool = True,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """`sequence_logprobs` with the sequence sharded over the 1-D CP `mesh`: [B, S] fp32, every CP
    rank the same full result (differentiable)."""
    from torch.distributed.tensor.experimental import context_parallel

    register_cpu_ring_attention()
    use_cp_attention(model)
    _check_right_padded(attention_mask)
    B, S = input_ids.shape
    cp = mesh.size()
    pad = -S % (2 * cp)  # head-tail balancing cuts the sequence into 2 * cp equal chunks
    ids, mask = F.pad(input_ids, (0, pad)), F.pad(attention_mask, (0, pad))
    width = S + pad
    targets = F.pad(ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX), (0, 1), value=IGNORE_INDEX)
    positions = torch.arange(width, device=ids.device).expand(B, width).contiguous()
    ids, targets = ids.contiguous(), targets.contiguous()
    backbone = getattr(model, cast(Any, model).base_model_prefix)
    buffers = [ids, positions, targets]
    token = _CP_CALL.set(True)
    try:
        with (
            _load_balanced(),
            context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)),
        ):
            hidden = backbone(
                input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False
            ).last_hidden_state  # [B, width / cp, H]: this rank's chunks
    finally:
        _CP_CALL.reset(token)
    lp = (
        _target_logprobs(
            model, hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), temperature, fused, chunk_size
        )
        .view(B, -1)
        .float()
    )
    group = mesh.get_group()
    gathered = _GatherSequence.apply(lp, group)  # [cp, B, width / cp]
    where = _GatherSequence.apply(positions, group)  # the same ranks' token positions
    full = torch.zeros(B, width, dtype=lp.dtype, device=lp.device).scatter(
        1, where.permute(1, 0, 2).reshape(B, width), gathered.permute(1, 0, 2).reshape(B, width)
    )
    return F.pad(full[:, : S - 1], (1, 0))  # position t scored token t + 1; 0 at t = 0 as sequence_logprobs
