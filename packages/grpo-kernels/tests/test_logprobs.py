"""Triton token logprobs under the interpreter (TRITON_INTERPRET=1, set by the root conftest)
against the fp64 reference: tiny shapes, fp32/fp64 only (bf16 is not trustworthy there).

The kernels are called through their launcher / Function layers: the public dispatch keeps CPU
tensors on the reference.
"""

import pytest
import torch

pytest.importorskip("triton")

from grpo_kernels import reference as R  # noqa: E402
from grpo_kernels.ops import logprobs as K  # noqa: E402

IGNORE = -100


def make(T, V, dtype, seed=0, n_ignored=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[torch.randperm(T, generator=g)[:n_ignored]] = IGNORE
    return logits, targets


def tolerance(dtype):
    return dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=0, atol=3e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "T, V, block_v, programs", [(1, 37, 16, None), (7, 37, 16, 3), (5, 64, 64, None), (4, 13, 4, 2)]
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_matches_reference(dtype, T, V, block_v, programs, temperature):
    logits, targets = make(T, V, dtype, n_ignored=T // 3)
    lp, ent, lse = K.token_logprobs_fwd(logits, targets, temperature, IGNORE, True, block_v, programs)
    ref_lp, ref_ent = R.token_logprobs(logits, targets, temperature, True)
    assert lp.dtype == ent.dtype == R.work_dtype(dtype)
    torch.testing.assert_close(lp, ref_lp, **tolerance(dtype))
    torch.testing.assert_close(ent, ref_ent, **tolerance(dtype))
    ref_lse = torch.logsumexp(logits.double() / temperature, -1)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-12 if dtype == torch.float64 else 3e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grads", ["logprob", "entropy", "both"])
def test_backward_matches_reference(dtype, grads):
    T, V = 6, 37
    logits, targets = make(T, V, dtype, n_ignored=2)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(T, generator=g, dtype=dtype), torch.randn(T, generator=g, dtype=dtype)

    def loss(lp, ent):
        return (lp * w_lp).sum() * (grads != "entropy") + (ent * w_ent).sum() * (grads != "logprob")

    x = logits.clone().requires_grad_()
    lp, ent = K.TokenLogprobsFunction.apply(x, targets, 0.8, IGNORE, True, 16)
    loss(lp, ent).backward()
    y = logits.clone().requires_grad_()
    loss(*R.token_logprobs(y, targets, 0.8, True)).backward()
    torch.testing.assert_close(x.grad, y.grad, **tolerance(dtype))
    assert (x.grad[targets == IGNORE] == 0).all()


def test_gradcheck_fp64_through_the_kernels():
    logits, targets = make(4, 11, torch.float64, n_ignored=1, scale=1.0)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: K.TokenLogprobsFunction.apply(x, targets, 1.3, IGNORE, True, 4), (logits,)
    )


def test_all_rows_ignored():
    logits, targets = make(3, 13, torch.float32, n_ignored=3)
    x = logits.clone().requires_grad_()
    lp, ent = K.token_logprobs(x, targets, 0.9, True, block_v=8)
    assert (lp == 0).all() and (ent == 0).all()
    (lp.sum() + ent.sum()).backward()
    assert (x.grad == 0).all()


def test_strided_batched_logits_need_no_copy():
    """logits[:, :-1] of [B, S, V] is not mergeable into rows; the kernel walks it in place."""
    full, _ = make(2 * 4, 13, torch.float64)
    full = full.view(2, 4, 13)
    sliced = full[:, :-1]
    targets = torch.randint(0, 13, (2, 3), generator=torch.Generator().manual_seed(2))
    x = sliced.detach().clone().requires_grad_()  # same values, contiguous, for the reference
    ref_lp, ref_ent = R.token_logprobs(x, targets, 1.1, True)
    (ref_lp.sum() + ref_ent.sum()).backward()
    s = full.clone().requires_grad_()
    lp, ent = K.token_logprobs(s[:, :-1], targets, 1.1, True, block_v=8)
    assert lp.shape == (2, 3)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    (lp.sum() + ent.sum()).backward()
    torch.testing.assert_close(s.grad[:, :-1], x.grad, rtol=0, atol=1e-12)
    assert (s.grad[:, -1] == 0).all()


def test_packed_input():
    logits, ids = make(9, 13, torch.float64)
    cu = torch.tensor([0, 4, 6, 9])
    lp, ent = K.token_logprobs(logits, ids, 0.9, True, cu_seqlens=cu, block_v=8)
    ref_lp, ref_ent = R.token_logprobs(logits, ids, 0.9, True, cu_seqlens=cu)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    assert (lp[cu[1:] - 1] == 0).all()


def test_nan_poisoned_outputs_are_all_overwritten(monkeypatch):
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_empty)
    logits, targets = make(5, 37, torch.float32, n_ignored=2)
    lp, ent, lse = K.token_logprobs_fwd(logits, targets, 0.7, IGNORE, True, 16, 2)
    grad = K.token_logprobs_bwd(logits, targets, lse, ent, torch.ones(5), None, 0.7, IGNORE, 16, 2)
    for out in (lp, ent, lse, grad):
        assert torch.isfinite(out).all()


def test_error_no_worse_than_eager_in_the_same_dtype():
    """fp32 logits: |ours - fp64| <= |eager fp32 - fp64| + slack."""
    logits, targets = make(8, 64, torch.float32, scale=8.0)
    exact_lp, exact_ent = R.token_logprobs(logits.double(), targets, 0.6, True)
    lp, ent, _ = K.token_logprobs_fwd(logits, targets, 0.6, IGNORE, True, 16)
    logp = torch.log_softmax(logits / 0.6, -1)
    eager_lp = logp.gather(1, targets[:, None]).squeeze(1)
    eager_ent = -(logp.exp() * logp).sum(-1)
    slack = 1e-6
    assert (lp.double() - exact_lp).abs().max() <= (eager_lp.double() - exact_lp).abs().max() + slack
    assert (ent.double() - exact_ent).abs().max() <= (eager_ent.double() - exact_ent).abs().max() + slack


@pytest.mark.parametrize(
    "logits, targets, name",
    [
        (torch.zeros(37, 4).t(), torch.tensor([0, 1, 2, 3]), "logits"),  # V not contiguous
        (torch.zeros(4, 37), torch.tensor([0, 1, 2, 37]), "target_ids"),
        (torch.zeros(4, 37), torch.tensor([0, 1, 2]), "target_ids"),
        (torch.zeros(4, 37), torch.zeros(4, dtype=torch.int64, device="meta"), "target_ids"),
        (torch.zeros(4, 37, dtype=torch.int32), torch.tensor([0, 1, 2, 3]), "logits"),
    ],
)
def test_bad_input_names_the_argument(logits, targets, name):
    with pytest.raises(ValueError, match=name):
        K.token_logprobs(logits, targets)


def test_masked_vocabulary_with_minus_inf_logits():
    logits, targets = make(4, 37, torch.float64, scale=1.0)
    logits[:, 30:] = -float("inf")
    logits[0, :16] = -float("inf")  # the whole first block of row 0
    targets = targets % 16 + torch.tensor([16, 0, 0, 0])
    x = logits.clone().requires_grad_()
    lp, ent = K.TokenLogprobsFunction.apply(x, targets, 0.9, IGNORE, True, 16)
    (lp.sum() + ent.sum()).backward()
    y = logits.clone().requires_grad_()
    ref_lp, ref_ent = R.token_logprobs(y, targets, 0.9, True)
    (ref_lp.sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)


def test_one_launch_each_way(count_launches):
    launches = count_launches(K)
    logits, targets = make(9, 37, torch.float32, n_ignored=2)
    x = logits.clone().requires_grad_()
    lp, ent = K.token_logprobs(x, targets, 0.9, True, block_v=16)
    assert launches == {"_token_logprobs_fwd_kernel": 1}
    (lp.sum() + ent.sum()).backward()
    assert launches == {"_token_logprobs_fwd_kernel": 1, "_token_logprobs_bwd_kernel": 1}


# ---------------------------------------------------------------------------------------------
# Compiled kernels on a GPU (skipped without CUDA; run with TRITON_INTERPRET=0 to compile)
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_dispatch_matches_fp64_no_worse_than_eager(dtype):
    import grpo_kernels

    T, V = 1024, 50257
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(T, V, generator=g, device="cuda") * 4).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g, device="cuda")
    targets[::7] = IGNORE
    x = logits.clone().requires_grad_()
    lp, ent = grpo_kernels.token_logprobs(x, targets, 0.7, True)
    (lp.sum() + ent.sum()).backward()
    y = logits.double().requires_grad_()
    exact_lp, exact_ent = R.token_logprobs(y, targets, 0.7, True)
    (exact_lp.sum() + exact_ent.sum()).backward()
    logp = torch.log_softmax(logits.float() / 0.7, -1)  # eager in the same input dtype
    eager_lp = logp.gather(1, targets.clamp_min(0)[:, None]).squeeze(1).masked_fill(targets == IGNORE, 0)
    slack = 1e-5
    assert (lp.double() - exact_lp).abs().max() <= (eager_lp.double() - exact_lp).abs().max() + slack
    assert torch.isfinite(ent).all() and (ent.double() - exact_ent).abs().max() < 1e-3
    grad_tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(x.grad.double(), y.grad, rtol=0, atol=grad_tol)
