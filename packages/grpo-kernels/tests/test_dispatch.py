"""The public ops: CPU tensors always take the reference, and the choice is logged."""

import logging
from types import SimpleNamespace

import torch

import grpo_kernels
from grpo_kernels import dispatch, reference


def test_cpu_tensors_take_the_reference_and_say_so(caplog):
    logits = torch.randn(5, 11, dtype=torch.float64)
    targets = torch.tensor([0, 3, -100, 10, 2])
    with caplog.at_level(logging.DEBUG, logger="grpo_kernels.dispatch"):
        lp, ent = grpo_kernels.token_logprobs(logits, targets, 0.9, True)
    assert "token_logprobs -> reference (CPU tensors)" in caplog.text
    ref_lp, ref_ent = reference.token_logprobs(logits, targets, 0.9, True)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)


def test_linear_and_loss_dispatch_on_cpu(caplog):
    hidden, weight = torch.randn(4, 3), torch.randn(7, 3)
    targets = torch.tensor([1, 2, 3, 4])
    with caplog.at_level(logging.DEBUG, logger="grpo_kernels.dispatch"):
        lp = grpo_kernels.linear_token_logprobs(hidden, weight, targets, chunk_size=2)
        z = torch.zeros(2, 3)
        loss, metrics = grpo_kernels.clipped_pg_loss(
            z,
            z,
            z,
            z,
            torch.ones(2, 3),
            torch.ones(2, 3),
            torch.ones(2),
            grpo_kernels.PGLossConfig(),
            6,
            2,
        )
    assert "linear_token_logprobs -> reference" in caplog.text
    assert "clipped_pg_loss -> reference" in caplog.text
    assert torch.equal(lp, reference.linear_token_logprobs(hidden, weight, targets))
    assert loss.item() == -1.0 and metrics["ratio_mean"].item() == 1.0


def test_triton_availability_is_a_bool():
    assert isinstance(dispatch.triton_available(), bool)


def test_vocab_parallel_op_takes_triton_on_cuda_tensors_and_the_torch_op_elsewhere(caplog, monkeypatch):
    """Which implementation serves which logits, without a GPU: CPU tensors take the sharded torch
    op; a CUDA tensor (a stand-in with is_cuda) takes the Triton kernels when triton imports, the
    torch op when it does not. The numbers of each are checked in test_vocab_parallel.py."""
    from grpo_kernels import vocab_parallel

    caplog.set_level(logging.DEBUG, logger="grpo_kernels.dispatch")
    assert (
        dispatch.pick_vocab_parallel_token_logprobs(torch.zeros(2, 4)) is vocab_parallel.vocab_parallel_token_logprobs
    )
    assert "vocab_parallel_token_logprobs -> torch op (CPU tensors)" in caplog.text
    cuda_logits = SimpleNamespace(is_cuda=True)
    if dispatch.triton_available():
        from grpo_kernels.ops import vocab_parallel as triton_op

        assert dispatch.pick_vocab_parallel_token_logprobs(cuda_logits) is triton_op.vocab_parallel_token_logprobs
        assert "vocab_parallel_token_logprobs -> triton" in caplog.text
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert dispatch.pick_vocab_parallel_token_logprobs(cuda_logits) is vocab_parallel.vocab_parallel_token_logprobs
    assert "vocab_parallel_token_logprobs -> torch op (triton is not installed)" in caplog.text


def test_public_vocab_parallel_op_is_the_dispatch():
    import grpo_kernels

    assert grpo_kernels.vocab_parallel_token_logprobs is dispatch.vocab_parallel_token_logprobs
