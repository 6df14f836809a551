"""grpo_kernels.pack_tensors: list <-> flat and padded <-> flat packing, round trips (empty
sequences included), gradients, and the Triton gather / scatter launchers under the
interpreter (TRITON_INTERPRET=1 from the root conftest) on tiny fp32 shapes."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from grpo_kernels import pack_tensors
from grpo_kernels.pack_tensors import (
    PackedBatch,
    gather_rows,
    pack_padded,
    pack_sequences,
    scatter_rows,
    unpack_padded,
    unpack_sequences,
)

triton_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton and TRITON_INTERPRET=1 (set by the root conftest)",
)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_seqs(lengths, trailing=(), dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randn(n, *trailing, generator=gen).to(dtype) for n in lengths]
    return [s.to(device) for s in seqs]


# ------------------------------------------------------------------------------------------
# list <-> flat
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trailing", [(), (3,), (2, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_round_trip_with_empty_sequences(trailing, dtype):
    seqs = make_seqs([3, 0, 5, 0, 1], trailing, dtype)
    packed = pack_sequences(seqs)
    assert packed.flat.shape == (9, *trailing) and packed.flat.dtype == dtype
    assert packed.cu_seqlens.tolist() == [0, 3, 3, 8, 8, 9]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    assert packed.max_seqlen == 5 and packed.seqlens == [3, 0, 5, 0, 1]
    back = unpack_sequences(packed.flat, packed.cu_seqlens)
    assert len(back) == len(seqs)
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(seqs, back))


def test_all_empty_and_single_sequence():
    empty = pack_sequences([torch.zeros(0, 4), torch.zeros(0, 4)])
    assert empty.flat.shape == (0, 4) and empty.cu_seqlens.tolist() == [0, 0, 0] and empty.max_seqlen == 0
    assert [s.shape for s in unpack_sequences(empty.flat, empty.cu_seqlens)] == [(0, 4), (0, 4)]
    one = pack_sequences([torch.arange(4)])
    assert one.position_ids.tolist() == [0, 1, 2, 3]


def test_unpack_gives_views_of_flat():
    packed = pack_sequences(make_seqs([2, 3]))
    first, _ = unpack_sequences(packed.flat, packed.cu_seqlens)
    first[0] = 42.0
    assert packed.flat[0] == 42.0


def test_pack_sequences_is_differentiable():
    seqs = [s.requires_grad_() for s in make_seqs([2, 0, 3], (4,))]
    (pack_sequences(seqs).flat * 2).sum().backward()
    assert all(torch.equal(s.grad, torch.full_like(s, 2.0)) for s in seqs)


@pytest.mark.parametrize(
    ("seqs", "message"),
    [
        ([], "empty batch"),
        ([torch.zeros(2, 3), torch.zeros(2, 4)], r"seqs\[1\]"),
        ([torch.zeros(2), torch.zeros(2, dtype=torch.int64)], r"seqs\[1\]"),
        ([torch.tensor(1.0)], "leading length dim"),
    ],
)
def test_pack_sequences_bad_inputs(seqs, message):
    with pytest.raises(ValueError, match=message):
        pack_sequences(seqs)


@pytest.mark.parametrize(
    ("cu", "message"),
    [
        (torch.tensor([0, 2, 4], dtype=torch.int32), "int64"),
        (torch.tensor([1, 5]), "from 0 to 5"),
        (torch.tensor([0, 4]), "from 0 to 5"),
        (torch.tensor([0, 3, 2, 5]), r"cu_seqlens\[2\] = 2 < 3"),
    ],
)
def test_unpack_rejects_bad_cu_seqlens(cu, message):
    with pytest.raises(ValueError, match=message):
        unpack_sequences(torch.zeros(5), cu)


# ------------------------------------------------------------------------------------------
# padded <-> flat
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trailing", [(), (3,)])
def test_padded_round_trip(trailing):
    lengths = [3, 0, 5, 1]
    seqs = make_seqs(lengths, trailing)
    packed = pack_sequences(seqs)
    padded = unpack_padded(packed.flat, packed.cu_seqlens, max_len=6, pad_value=-7.0)
    assert padded.shape == (4, 6, *trailing)
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        assert torch.equal(padded[b, :n], s)
        assert bool((padded[b, n:] == -7.0).all())
    again = pack_padded(padded, lengths)
    assert isinstance(again, PackedBatch)
    assert torch.equal(again.flat, packed.flat)
    assert torch.equal(again.cu_seqlens, packed.cu_seqlens) and torch.equal(again.position_ids, packed.position_ids)
    assert unpack_padded(packed.flat, packed.cu_seqlens).shape == (4, 5, *trailing)


def test_padded_token_ids_with_ignore_index():
    packed = pack_sequences([torch.tensor([5, 6, 7]), torch.tensor([], dtype=torch.int64), torch.tensor([8])])
    padded = unpack_padded(packed.flat, packed.cu_seqlens, pad_value=-100)
    assert padded.tolist() == [[5, 6, 7], [-100, -100, -100], [8, -100, -100]]
    assert pack_padded(padded, torch.tensor([3, 0, 1])).flat.tolist() == [5, 6, 7, 8]


def test_padded_gradients_match_autograd_of_indexing():
    lengths = [2, 4, 0, 3]
    x = torch.randn(4, 4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: pack_padded(t, lengths).flat, (x,))
    packed = pack_padded(x.detach(), lengths)
    flat = packed.flat.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda f: unpack_padded(f, packed.cu_seqlens, max_len=5, pad_value=3.0), (flat,))


def test_pack_padded_bad_inputs():
    with pytest.raises(ValueError, match=r"lengths\[1\] = 5 is outside \[0, 4\]"):
        pack_padded(torch.zeros(2, 4), [1, 5])
    with pytest.raises(ValueError, match="3 lengths for a batch of 2"):
        pack_padded(torch.zeros(2, 4), [1, 1, 1])
    with pytest.raises(ValueError, match=r"\[B, L, ...\]"):
        pack_padded(torch.zeros(4), [1])
    with pytest.raises(ValueError, match="shorter than the longest"):
        packed = pack_sequences(make_seqs([3, 1]))
        unpack_padded(packed.flat, packed.cu_seqlens, max_len=2)


# ------------------------------------------------------------------------------------------
# Triton launchers, called directly, under the interpreter
# ------------------------------------------------------------------------------------------
@triton_interpreter
@pytest.mark.parametrize(("n_src", "n_rows", "row_size"), [(10, 3, 2), (40, 37, 1), (7, 5, 130)])
def test_triton_gather_rows(n_src, n_rows, row_size):
    gen = torch.Generator().manual_seed(n_rows)
    src = torch.randn(n_src, row_size, generator=gen)
    index = torch.randint(0, n_src, (n_rows,), generator=gen)
    assert torch.equal(gather_rows(src, index), src[index])


@triton_interpreter
@pytest.mark.parametrize(("n_dst", "n_rows", "row_size"), [(10, 3, 2), (40, 37, 1), (7, 5, 130)])
def test_triton_scatter_rows(n_dst, n_rows, row_size):
    gen = torch.Generator().manual_seed(n_rows)
    src = torch.randn(n_rows, row_size, generator=gen)
    index = torch.randperm(n_dst, generator=gen)[:n_rows]
    out = torch.full((n_dst, row_size), -1.0)
    expected = out.clone()
    expected[index] = src
    assert scatter_rows(src, index, out) is out
    assert torch.equal(out, expected)


@triton_interpreter
def test_triton_launchers_handle_empty_and_reject_bad_shapes():
    assert gather_rows(torch.zeros(4, 3), torch.zeros(0, dtype=torch.int64)).shape == (0, 3)
    with pytest.raises(ValueError, match="int64"):
        gather_rows(torch.zeros(4, 3), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        scatter_rows(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), torch.zeros(4, 2))


@triton_interpreter
def test_padded_path_through_triton_kernels(monkeypatch):
    # Route the CPU tensors through the Triton kernels (as CUDA tensors would be) and compare.
    lengths = [3, 0, 4, 1]
    x = torch.randn(4, 5, 3, requires_grad=True)
    reference = pack_padded(x, lengths)
    (reference.flat * torch.arange(8.0)[:, None]).sum().backward()
    expected_grad, x.grad = x.grad.clone(), None
    monkeypatch.setattr(pack_tensors, "_use_triton", lambda t: True)
    packed = pack_padded(x, lengths)
    assert torch.equal(packed.flat, reference.flat)
    (packed.flat * torch.arange(8.0)[:, None]).sum().backward()
    assert torch.equal(x.grad, expected_grad)
    assert torch.equal(
        unpack_padded(packed.flat.detach(), packed.cu_seqlens, 5),
        x.detach() * (torch.arange(5)[None, :, None] < torch.tensor(lengths)[:, None, None]),
    )


# ------------------------------------------------------------------------------------------
# CUDA (GPU machines only)
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_cuda_matches_cpu(dtype):
    lengths = [5, 0, 129, 1, 64]
    seqs = make_seqs(lengths, (7,), dtype)
    cpu = pack_sequences(seqs)
    gpu = pack_sequences([s.cuda() for s in seqs])
    assert torch.equal(gpu.flat.cpu(), cpu.flat)
    assert torch.equal(gpu.position_ids.cpu(), cpu.position_ids) and gpu.position_ids.is_cuda
    padded_cpu = unpack_padded(cpu.flat, cpu.cu_seqlens, pad_value=0)
    padded_gpu = unpack_padded(gpu.flat, gpu.cu_seqlens, pad_value=0)
    assert torch.equal(padded_gpu.cpu(), padded_cpu)
    assert torch.equal(pack_padded(padded_gpu, lengths).flat.cpu(), cpu.flat)
    back = unpack_sequences(gpu.flat, gpu.cu_seqlens)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(back, seqs))
