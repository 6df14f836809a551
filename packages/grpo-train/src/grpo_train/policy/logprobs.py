"""Per-token logprobs of a causal LM through grpo_kernels' ops, on right-padded [B, S] rows or on
one packed stream of sequences laid end to end ([T] tokens described by cu_seqlens).

Training logits are divided by the sampling temperature, exactly as in generation. With
`fused`, the lm_head matmul is fused into the logprob op so full logits never exist.

Packed input needs attention that stops at sequence boundaries. transformers 5 derives a
block-diagonal mask from reset position ids only when no KV cache exists, and the model's
default `use_cache=True` creates one: the derived mask then silently becomes plain causal and
every sequence attends to the ones packed before it. So packed forwards here never rely on
that derivation: they pass the boundaries (`cu_seq_lens_*`, flash-attention's names) to the
attention function and skip mask building. flash_attention_2/3 consume them natively; any other
model is switched to `varlen_sdpa_attention` below (registered through transformers' public
AttentionInterface), which runs each sequence's causal attention on its own and falls back to
plain SDPA for unpacked calls.
"""

from __future__ import annotations

import contextvars
import functools

import torch
import torch.nn.functional as F

import grpo_kernels
from grpo_train.model_families import family_of
from grpo_train.policy.tensor_parallel import tp_state

IGNORE_INDEX = -100
# Name under which varlen_sdpa_attention is registered with transformers.
VARLEN_ATTENTION = "grpo_varlen_sdpa"
# Attention implementations that split attention by cu_seq_lens_* on their own.
PACKED_ATTENTION = (VARLEN_ATTENTION, "flash_attention_2", "flash_attention_3")
# Set during a packed forward: the mask function registered for VARLEN_ATTENTION then builds no
# mask (the boundaries travel as cu_seq_lens_*), whatever the model's own mask plumbing is.
_PACKED_CALL = contextvars.ContextVar("grpo_packed_call", default=False)
# Off the flash kernel, sequences whose lengths are within this factor share one padded SDPA
# call: a bucket spends at most 1 - 0.8**2 = 36 % of its attention work on padding, and a stream
# of lengths 1..L needs only about log(L) / log(1.25) calls per layer.
BUCKET_RATIO = 0.8


# ------------------------------------------------------------------------------ logprobs
def _target_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    fused: bool,
    chunk_size: int | None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """grpo_kernels' (fused) lm_head logprob op on hidden [N, H] -> [N], with what the model's
    family does to logits after the head (`model_families`: a logit scale folds into the
    temperature; a soft-cap needs the logits, so it takes the unfused path)."""
    family = family_of(model.config)
    scale, cap = family.logit_scale(), family.logit_softcap()
    head = model.get_output_embeddings()
    kwargs = {
        "temperature": temperature * scale if cap is None else temperature,
        "ignore_index": IGNORE_INDEX,
        "cu_seqlens": cu_seqlens,
    }
    if (tp := tp_state(model)) is not None:  # a column-parallel head: this rank's vocab slice of the logits
        logits = head(hidden)  # [N, V / tp]
        if cap is not None:  # elementwise, so it applies shard by shard
            logits = cap * torch.tanh(logits / scale / cap)
        # grpo_kernels' dispatch: Triton's per-shard kernels on CUDA tensors, the sharded torch op on CPU.
        logprob = grpo_kernels.vocab_parallel_token_logprobs(logits, targets, tp.group, **kwargs)
        assert isinstance(logprob, torch.Tensor)  # no entropy asked for
        return logprob
    if chunk_size is not None:
        kwargs["chunk_size"] = chunk_size
    if cap is not None:
        logits = head(hidden) / scale
        return grpo_kernels.token_logprobs(cap * torch.tanh(logits / cap), targets, **kwargs)
    if fused and getattr(head, "bias", None) is None:
        return grpo_kernels.linear_token_logprobs(hidden, head.weight, targets, **kwargs)
    return grpo_kernels.token_logprobs(head(hidden), targets, **kwargs)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    fused: bool = True,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log p(x_t | x_<t) for t >= 1, 0 at t = 0 and on padding: [B, S] fp32."""
    B, S = input_ids.shape
    if family_of(model.config).attention_softcap():  # transformers' SDPA drops it; ours applies it
        use_packed_attention(model)
    backbone = getattr(model, model.base_model_prefix)
    if (tp := tp_state(model)) is not None and (pad := tp.pad_to(S)):  # SP splits the sequence evenly
        input_ids, attention_mask = F.pad(input_ids, (0, pad)), F.pad(attention_mask, (0, pad))
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    if tp is not None:
        hidden = tp.gather_sequence(hidden, dim=1)
        input_ids, attention_mask = input_ids[:, :S], attention_mask[:, :S]
    hidden = hidden[:, : S - 1]  # [B, S-1, H]
    targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX).reshape(-1)  # [B*(S-1)]
    lp = _target_logprobs(model, hidden.reshape(-1, hidden.shape[-1]), targets, temperature, fused, chunk_size)
    return F.pad(lp.view(B, S - 1).float(), (1, 0))


def packed_hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
) -> torch.Tensor:
    """The last hidden states of a packed stream: [T, H]. `model` is an HF causal LM or a bare
    backbone (its `base_model` runs); it is switched to an attention that honours the boundaries
    first (see the module docstring).

    input_ids, position_ids: [T] int64 (positions restart at 0 per sequence); cu_seqlens [n + 1]
    must cover all T tokens (a padding tail is a sequence of its own).
    """
    if int(cu_seqlens[-1]) != input_ids.shape[0]:
        raise ValueError(
            f"cu_seqlens ends at {int(cu_seqlens[-1])} but the stream has {input_ids.shape[0]} tokens; "
            "give a padding tail a segment of its own"
        )
    use_packed_attention(model)
    n_tokens = input_ids.shape[0]
    if (tp := tp_state(model)) is not None and (pad := tp.pad_to(n_tokens)):  # SP: a padding segment of its own
        input_ids = F.pad(input_ids, (0, pad))
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)])
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens[-1:] + pad])
    cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)  # flash-attention wants int32
    token = _PACKED_CALL.set(True)
    try:
        base: torch.nn.Module = model.base_model  # pyright: ignore[reportAssignmentType]
        hidden = base(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            attention_mask=None,
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max_seqlen,
            max_length_k=max_seqlen,
        ).last_hidden_state[0]  # [T, H] ([T / tp, H] under SP)
    finally:
        _PACKED_CALL.reset(token)
    return hidden if tp is None else tp.gather_sequence(hidden, dim=0)[:n_tokens]


def packed_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    temperature: float,
    fused: bool = True,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log p(x_t | x_<t) of a packed stream: [T] fp32, 0 at the first token of every sequence
    (inputs as in `packed_hidden_states`)."""
    hidden = packed_hidden_states(model, input_ids, position_ids, cu_seqlens, max_seqlen)  # [T, H]
    # With cu_seqlens the op scores input_ids[t + 1] at t inside each sequence (0 at its last token).
    lp = _target_logprobs(
        model, hidden, input_ids, temperature, fused, chunk_size, cu_seqlens=cu_seqlens.to(input_ids.device)
    )
    return F.pad(lp[:-1].float(), (1, 0))  # [T]: token t holds log p(x_t | x_<t)


# ---------------------------------------------------------------- attention on packed input
def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: causal attention within each packed sequence.

    query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None). Packed calls carry
    cu_seq_lens_q / max_length_q; other calls go to transformers' SDPA attention unchanged.
    On CUDA in fp16/bf16 the packed call is PyTorch's flash varlen kernel; elsewhere sequences of
    similar length are gathered into right-padded batches for causal SDPA, then scattered back.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    softcap = kwargs.get("softcap")  # Gemma 2's attention logit soft-capping: SDPA has none
    if cu is None and softcap:
        return _softcap_attention(query, key, value, attention_mask, scaling, softcap).transpose(1, 2), None
    if cu is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    max_len, n_q, n_kv = int(kwargs["max_length_q"]), query.shape[1], key.shape[1]
    if sliding_window is not None and max_len > sliding_window:  # shorter sequences never reach the window
        raise NotImplementedError(
            "packed sequences with sliding-window attention are not supported; "
            "disable policy.sequence_packing for this model"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one stream (batch 1), got batch {query.shape[0]}")
    varlen = _torch_varlen_attn()
    if (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and dropout == 0.0
        and varlen is not None
        and not softcap
    ):
        cu32 = cu.to(torch.int32)
        out = varlen(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            cu32,
            cu32,
            max_len,
            max_len,
            scale=scaling,
            window_size=(-1, 0),
            enable_gqa=n_q != n_kv,
        )  # [T, Hq, D]
        return out[None], None
    qkv = torch.cat([query[0], key[0], value[0]], dim=0).transpose(0, 1)  # [T, Hq + 2 Hkv, D]
    out = _bucketed_causal_attention(qkv, cu.to(torch.int64), (n_q, n_kv), dropout, scaling, softcap)  # [T, Hq, D]
    return out[None], None


def _length_buckets(lengths: list[int]) -> list[list[int]]:
    """Indices of the non-empty sequences grouped by similar length, longest first (BUCKET_RATIO)."""
    buckets: list[list[int]] = []
    for i in sorted((i for i in range(len(lengths)) if lengths[i]), key=lambda i: (-lengths[i], i)):
        if not buckets or lengths[i] < BUCKET_RATIO * lengths[buckets[-1][0]]:
            buckets.append([])
        buckets[-1].append(i)
    return buckets


def _bucketed_causal_attention(
    qkv: torch.Tensor,
    cu: torch.Tensor,
    heads: tuple[int, int],
    dropout: float,
    scaling: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence of a packed stream, one padded SDPA call per bucket of
    similar lengths. qkv [T, Hq + 2 Hkv, D] (cu covers all T tokens) -> [T, Hq, D].

    A bucket's sequences are gathered into right-padded [n, H, L, D]; under the causal mask no
    real query reaches a padding slot (they all come after it), and padding queries are dropped."""
    n_q, n_kv = heads
    D = qkv.shape[2]
    starts, lengths = cu[:-1].tolist(), cu.diff().tolist()
    outs, rows = [], []
    for bucket in _length_buckets(lengths):
        L = lengths[bucket[0]]
        first = torch.tensor([starts[i] for i in bucket], device=qkv.device)
        cols = torch.arange(L, device=qkv.device)
        valid = cols[None, :] < torch.tensor([lengths[i] for i in bucket], device=qkv.device)[:, None]  # [n, L]
        src = (first[:, None] + torch.where(valid, cols, 0)).reshape(-1)  # padding slots re-read token 0
        q, k, v = qkv.index_select(0, src).view(len(bucket), L, -1, D).transpose(1, 2).split([n_q, n_kv, n_kv], dim=1)
        if softcap:
            o = _softcap_attention(q, k, v, None, scaling, softcap)
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=n_q != n_kv
            )  # [n, Hq, L, D]
        keep = valid.reshape(-1).nonzero().squeeze(1)
        outs.append(o.transpose(1, 2).reshape(-1, n_q, D).index_select(0, keep))
        rows.append(src[keep])
    order = torch.argsort(torch.cat(rows))  # the buckets' tokens cover 0..T-1 once each
    return torch.cat(outs).index_select(0, order)


def _softcap_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    softcap: float,
) -> torch.Tensor:
    """Attention with soft-capped scores, cap * tanh(scores / cap), as Gemma 2 defines it (eager
    math: no fused kernel caps). query [B, Hq, Q, D], key/value [B, Hkv, K, D]; mask: transformers'
    SDPA mask (bool, True attends, or additive) or None for plain causal -> [B, Hq, Q, D]."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        q_len, k_len = scores.shape[-2:]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask[..., : scores.shape[-1]]
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
    return torch.matmul(probs, value)


@functools.cache
def _torch_varlen_attn():
    """PyTorch's flash varlen attention (torch >= 2.9, CUDA), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _register_varlen_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention)

    def varlen_mask(*args, **kwargs):  # unpacked calls build SDPA's masks, packed ones none
        return None if _PACKED_CALL.get() else sdpa_mask(*args, **kwargs)

    AttentionMaskInterface.register(VARLEN_ATTENTION, varlen_mask)


def use_packed_attention(model: torch.nn.Module) -> None:
    """Make `model` (and its later deep copies) honour packed-sequence boundaries: keep
    flash-attention, else switch to varlen_sdpa_attention. Idempotent; checkpoints are unaffected
    (the implementation is not saved in config.json)."""
    if model.config._attn_implementation in PACKED_ATTENTION:
        return
    _register_varlen_attention()
    model.set_attn_implementation(VARLEN_ATTENTION)
