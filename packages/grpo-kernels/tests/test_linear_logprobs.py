"""The GPU path of the fused lm_head logprobs (chunked matmul + Triton softmax kernels), run on
CPU tensors under the Triton interpreter against the reference (fp32 / fp64, tiny shapes)."""

import pytest
import torch

pytest.importorskip("triton")

from grpo_kernels import reference as R  # noqa: E402
from grpo_kernels.ops import linear_logprobs as K  # noqa: E402

IGNORE = -100


def make(T, H, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[::3] = IGNORE
    return hidden, weight, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [1, 4, 16])
def test_values_and_grads_match_reference(dtype, chunk_size):
    hidden, weight, targets = make(7, 5, 37, dtype)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(7, generator=g, dtype=dtype), torch.randn(7, generator=g, dtype=dtype)

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fn(h, w, targets, 0.8, True, chunk_size=chunk_size)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        return lp, ent, h.grad, w.grad

    tol = dict(rtol=0, atol=1e-11) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for ours, ref in zip(run(K.linear_token_logprobs), run(R.linear_token_logprobs)):
        torch.testing.assert_close(ours, ref, **tol)


def test_no_grad_path_packed_input_and_weight_only_grad():
    hidden, weight, ids = make(9, 4, 13, torch.float64, seed=2)
    cu = torch.tensor([0, 5, 9])
    with torch.no_grad():
        lp = K.linear_token_logprobs(hidden, weight, ids, 1.2, chunk_size=4, cu_seqlens=cu)
    torch.testing.assert_close(lp, R.linear_token_logprobs(hidden, weight, ids, 1.2, cu_seqlens=cu), rtol=0, atol=1e-12)
    w = weight.clone().requires_grad_()
    K.linear_token_logprobs(hidden, w, ids, chunk_size=4, cu_seqlens=cu).sum().backward()
    w_ref = weight.clone().requires_grad_()
    R.linear_token_logprobs(hidden, w_ref, ids, cu_seqlens=cu).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=1e-12)


def test_gradcheck_fp64():
    hidden, weight, targets = make(4, 3, 11, torch.float64, seed=3)
    hidden.requires_grad_()
    weight.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, w: K.linear_token_logprobs(h, w, targets, 0.9, True, chunk_size=3), (hidden, weight)
    )


def test_bad_input_names_the_argument():
    hidden, weight, targets = make(4, 3, 11, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        K.linear_token_logprobs(hidden, weight[:, :2], targets)
    with pytest.raises(ValueError, match="target_ids"):
        K.linear_token_logprobs(hidden, weight, torch.tensor([0, 1, 2, 11]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dispatch_bf16_close_to_fp64():
    import grpo_kernels

    T, H, V = 2048, 512, 32001
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(T, H, generator=g, device="cuda") / H**0.5).bfloat16().requires_grad_()
    weight = torch.randn(V, H, generator=g, device="cuda").bfloat16().requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g, device="cuda")
    lp = grpo_kernels.linear_token_logprobs(hidden, weight, targets, chunk_size=512)
    lp.sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    exact = R.linear_token_logprobs(h64, w64, targets, chunk_size=512)
    exact.sum().backward()
    assert (lp.double() - exact).abs().max() < 0.1  # bf16 logits: ~3 significant digits
    assert (hidden.grad.double() - h64.grad).abs().max() / h64.grad.abs().max() < 2e-2
    assert (weight.grad.double() - w64.grad).abs().max() / w64.grad.abs().max() < 2e-2
