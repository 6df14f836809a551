"""The pure-PyTorch logprob oracle against the naive `log_softmax(logits / T).gather`.

The loss half of reference.py is pinned by hand arithmetic in test_pg_loss.py.
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from grpo_kernels import reference as R

IGNORE = -100


def naive(logits, targets, temperature=1.0, ignore_index=IGNORE):
    """fp64 log_softmax + gather, and -sum p log p; ignored rows give 0."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    ignored = targets == ignore_index
    lp = logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp.masked_fill(ignored, 0.0), ent.masked_fill(ignored, 0.0)


def make(T, V, dtype=torch.float32, seed=0, n_ignored=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[torch.randperm(T, generator=g)[:n_ignored]] = IGNORE
    return logits, targets


@pytest.mark.parametrize("V", [1, 37, 1001])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_values_match_naive_fp64(V, chunk_size, temperature):
    logits, targets = make(11, V, torch.float64, n_ignored=3)
    lp, ent = R.token_logprobs(logits, targets, temperature, True, chunk_size=chunk_size)
    ref_lp, ref_ent = naive(logits, targets, temperature)
    assert lp.dtype == ent.dtype == torch.float64
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    assert (lp[targets == IGNORE] == 0).all() and (ent[targets == IGNORE] == 0).all()


def test_single_row_and_logprob_only():
    logits, targets = make(1, 37, torch.float64)
    lp = R.token_logprobs(logits, targets, 0.9)
    torch.testing.assert_close(lp, naive(logits, targets, 0.9)[0], rtol=0, atol=1e-12)


def test_all_rows_ignored_and_empty_input():
    logits, targets = make(4, 37, n_ignored=4)
    lp, ent = R.token_logprobs(logits, targets, return_entropy=True)
    assert (lp == 0).all() and (ent == 0).all()
    lp = R.token_logprobs(torch.zeros(0, 37), torch.zeros(0, dtype=torch.int64))
    assert lp.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_logits_give_float32_close_to_fp64(dtype):
    logits, targets = make(9, 1001, dtype, n_ignored=2)
    lp, ent = R.token_logprobs(logits, targets, 0.8, True, chunk_size=4)
    assert lp.dtype == ent.dtype == torch.float32
    ref_lp, ref_ent = naive(logits, targets, 0.8)  # same (rounded) logits, exact maths
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-5)


def test_batched_logits_keep_the_target_shape():
    logits, targets = make(12, 37, torch.float64, n_ignored=2)
    lp, ent = R.token_logprobs(logits.view(3, 4, 37), targets.view(3, 4), return_entropy=True)
    assert lp.shape == ent.shape == (3, 4)
    torch.testing.assert_close(lp.reshape(-1), naive(logits, targets)[0], rtol=0, atol=1e-12)
    flat = R.token_logprobs(logits.view(3, 4, 37), targets)  # flat targets are accepted too
    assert flat.shape == (12,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradients_match_naive_autograd(dtype, with_entropy):
    logits, targets = make(10, 37, dtype, n_ignored=3)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(10, generator=g, dtype=dtype), torch.randn(10, generator=g, dtype=dtype)

    x = logits.clone().requires_grad_()
    out = R.token_logprobs(x, targets, 0.7, with_entropy, chunk_size=3)
    lp, ent = out if with_entropy else (out, None)
    ((lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0)).backward()

    y = logits.clone().requires_grad_()
    ref_lp, ref_ent = naive(y, targets, 0.7)
    ((ref_lp * w_lp).sum() + ((ref_ent * w_ent).sum() if with_entropy else 0)).backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(x.grad, y.grad.to(dtype), rtol=0, atol=tol)
    assert (x.grad[targets == IGNORE] == 0).all()


def test_gradcheck_fp64():
    logits, targets = make(6, 13, torch.float64, n_ignored=1, scale=1.0)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: R.token_logprobs(x, targets, 0.8, True, chunk_size=4), (logits,))
    assert torch.autograd.gradcheck(lambda x: R.token_logprobs(x, targets, 1.3), (logits,))


def test_entropy_only_gradient():
    logits, targets = make(5, 13, torch.float64, scale=1.0)
    x = logits.clone().requires_grad_()
    R.token_logprobs(x, targets, return_entropy=True, chunk_size=2)[1].sum().backward()
    y = logits.clone().requires_grad_()
    naive(y, targets)[1].sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Packed input
# ---------------------------------------------------------------------------------------------
def test_shift_targets_packed_hand_case():
    ids = torch.tensor([10, 11, 12, 20, 21, 30, 99, 98])
    cu = torch.tensor([0, 3, 5, 5, 6])  # seqs [10 11 12] [20 21] [] [30], then 2 pad tokens
    t = R.shift_targets_packed(ids, cu, IGNORE)
    assert t.tolist() == [11, 12, IGNORE, 21, IGNORE, IGNORE, IGNORE, IGNORE]


def test_packed_logprobs_equal_per_sequence_logprobs():
    logits, ids = make(9, 37, torch.float64)
    cu = torch.tensor([0, 4, 6, 9])
    lp, ent = R.token_logprobs(logits, ids, 0.9, True, chunk_size=2, cu_seqlens=cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref_lp, ref_ent = naive(logits[s : e - 1], ids[s + 1 : e], 0.9)
        torch.testing.assert_close(lp[s : e - 1], ref_lp, rtol=0, atol=1e-12)
        torch.testing.assert_close(ent[s : e - 1], ref_ent, rtol=0, atol=1e-12)
        assert lp[e - 1] == 0 and ent[e - 1] == 0
    # Rolled by one, position t holds log p(x_t | x_<t) and every sequence start holds 0.
    rolled = torch.roll(lp, 1)
    assert (rolled[cu[:-1]] == 0).all()


# ---------------------------------------------------------------------------------------------
# Memory: measured allocations, not estimates
# ---------------------------------------------------------------------------------------------
def allocations(fn):
    """Run fn under the profiler; -> (peak of live bytes allocated during fn, largest block)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())  # stable: same-time events keep their order
    live = peak = largest = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
        largest = max(largest, e.nbytes())
    return peak, largest


def test_profiler_sees_the_naive_fp32_intermediate():
    """The measurement is real: the naive path shows its [T, V] float32 tensor."""
    logits, targets = make(256, 1001, torch.bfloat16)
    full = 256 * 1001 * 4
    peak, largest = allocations(lambda: naive(logits, targets))
    assert largest >= full and peak >= full


def test_chunked_forward_never_allocates_full_fp32_logits():
    T, V, chunk = 256, 1001, 16
    logits, targets = make(T, V, torch.float32)
    full = T * V * 4
    peak, largest = allocations(lambda: R.token_logprobs(logits, targets, 0.7, True, chunk_size=chunk))
    assert largest <= 2 * chunk * V * 4
    assert peak <= 4 * chunk * V * 4 + 8 * T * 4, (peak, full)
    assert peak < full / 4


def test_chunked_backward_allocates_only_the_gradient_plus_chunks():
    T, V, chunk = 256, 1001, 16
    logits, targets = make(T, V, torch.bfloat16)
    x = logits.clone().requires_grad_()

    def step():
        lp, ent = R.token_logprobs(x, targets, 0.7, True, chunk_size=chunk)
        (lp.sum() + ent.sum()).backward()

    peak, largest = allocations(step)
    grad_bytes = T * V * 2  # d(logits) itself, bf16 like the logits
    assert largest <= grad_bytes  # nothing [T, V] in float32
    assert peak <= grad_bytes + 4 * chunk * V * 4 + 16 * T * 4, peak


def test_linear_forward_and_backward_never_materialise_logits():
    T, H, V, chunk = 256, 16, 1001, 32
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (T,), generator=g)

    def step():
        lp, ent = R.linear_token_logprobs(hidden, weight, targets, 0.9, True, chunk_size=chunk)
        (lp.sum() + ent.sum()).backward()

    peak, largest = allocations(step)
    assert largest < T * V * 4 / 2
    assert peak <= 5 * chunk * V * 4 + 2 * (T + V) * H * 4, peak


# ---------------------------------------------------------------------------------------------
# linear_token_logprobs (reference)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_linear_matches_unfused_values_and_grads(chunk_size):
    T, H, V = 13, 8, 37
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[[2, 7]] = IGNORE
    w_lp, w_ent = torch.randn(T, generator=g, dtype=torch.float64), torch.randn(T, generator=g, dtype=torch.float64)

    h1, W1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = R.linear_token_logprobs(h1, W1, targets, 0.7, True, chunk_size=chunk_size)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    h2, W2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = naive(h2 @ W2.t(), targets, 0.7)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    for a, b in ((lp, ref_lp), (ent, ref_ent), (h1.grad, h2.grad), (W1.grad, W2.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_linear_no_grad_path_and_weight_only_grad():
    T, H, V = 6, 4, 11
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (T,), generator=g)
    with torch.no_grad():
        lp = R.linear_token_logprobs(hidden, weight, targets, chunk_size=4)
    assert lp.grad_fn is None
    torch.testing.assert_close(lp, naive(hidden @ weight.detach().t(), targets)[0], rtol=0, atol=1e-12)
    R.linear_token_logprobs(hidden, weight, targets, chunk_size=4).sum().backward()
    W2 = weight.detach().clone().requires_grad_()
    naive(hidden @ W2.t(), targets)[0].sum().backward()
    torch.testing.assert_close(weight.grad, W2.grad, rtol=0, atol=1e-12)


def test_linear_gradcheck_fp64_and_packed():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 3, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 9, (7,), generator=g)
    cu = torch.tensor([0, 3, 7])
    assert torch.autograd.gradcheck(
        lambda h, w: R.linear_token_logprobs(h, w, ids, 1.2, True, chunk_size=2, cu_seqlens=cu),
        (hidden, weight),
    )


def test_linear_bf16_weight_grad_is_accumulated_in_fp32():
    T, H, V = 64, 8, 37
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(T, H, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(V, H, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    R.linear_token_logprobs(hidden, weight, targets, chunk_size=4).sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    naive(h64 @ w64.t(), targets)[0].sum().backward()
    assert weight.grad.dtype == torch.bfloat16
    err = (weight.grad.double() - w64.grad).abs().max() / w64.grad.abs().max()
    assert err < 2e-2


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the argument
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(target_ids=torch.tensor([0, 37, 1, 2])), "target_ids"),
        (dict(target_ids=torch.tensor([0, -1, 1, 2])), "target_ids"),
        (dict(target_ids=torch.tensor([0, 1, 2])), "target_ids"),
        (dict(target_ids=torch.tensor([0.0, 1, 2, 3])), "target_ids"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(logits=torch.zeros(4, 37, dtype=torch.int64)), "logits"),
        (dict(logits=torch.zeros(37)), "logits"),
        (dict(cu_seqlens=torch.tensor([1, 4])), "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 3, 2, 4])), "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 5])), "cu_seqlens"),
    ],
)
def test_bad_input_names_the_argument(kwargs, name):
    args = dict(logits=torch.zeros(4, 37), target_ids=torch.tensor([0, 1, 2, IGNORE]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        R.token_logprobs(**args)


@pytest.mark.parametrize(
    "hidden, weight, name",
    [
        (torch.zeros(4, 8), torch.zeros(11, 7), "weight"),
        (torch.zeros(4, 8), torch.zeros(11, 8, dtype=torch.float64), "weight"),
        (torch.zeros(8), torch.zeros(11, 8), "hidden"),
    ],
)
def test_linear_bad_input_names_the_argument(hidden, weight, name):
    with pytest.raises(ValueError, match=name):
        R.linear_token_logprobs(hidden, weight, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="target_ids"):
        R.linear_token_logprobs(torch.zeros(4, 8), torch.zeros(11, 8), torch.tensor([0, 1, 2, 11]))


def test_masked_vocabulary_with_minus_inf_logits():
    """-inf logits (a masked vocabulary) have p = 0: finite entropy and gradients."""
    logits, targets = make(5, 37, torch.float64, scale=1.0)
    logits[:, 30:] = -float("inf")
    logits[0, :20] = -float("inf")  # a whole leading block masked
    targets = targets % 20 + torch.tensor([20, 0, 0, 0, 0])
    x = logits.clone().requires_grad_()
    lp, ent = R.token_logprobs(x, targets, 0.8, True, chunk_size=2)
    finite = logits[:, :30].clone()
    finite[0, :20] = -1e4  # exp underflows to exactly 0, like -inf
    ref_lp, ref_ent = naive(finite, targets, 0.8)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    (lp.sum() + ent.sum()).backward()
    y = finite.clone().requires_grad_()
    sum(naive(y, targets, 0.8)).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[:, 30:] == 0).all()
    torch.testing.assert_close(x.grad[:, :30], y.grad, rtol=0, atol=1e-12)
