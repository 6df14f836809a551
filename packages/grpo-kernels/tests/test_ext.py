"""grpo_kernels._ext: the only importer of the compiled extension, its error message, and the
torch op `grpo_kernels::position_ids_from_cu_seqlens` (real, fake and compiled)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_kernels import _ext, packing, reference

SRC = Path(_ext.__file__).resolve().parent
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_extension_is_built():
    # A silent build failure would otherwise only show up as slow packing.
    assert _ext.has_extension(), _ext._missing_message(_ext._IMPORT_ERROR)
    assert _ext.has_cuda_extension() == bool(_ext.require_extension().with_cuda)


def _imports_extension(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name.endswith("._C") or a.name == "_C" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (
            (node.module or "").endswith("_C") or any(a.name == "_C" for a in node.names)
        ):
            return True
        if isinstance(node, ast.Constant) and node.value == "grpo_kernels._C":
            return True
    return False


def test_only_ext_touches_the_raw_module():
    importers = sorted(p.name for p in SRC.rglob("*.py") if _imports_extension(p))
    assert importers == ["_ext.py"]


def test_import_grpo_kernels_stays_cheap():
    code = (
        "import sys, grpo_kernels; print(sorted(m for m in ('triton', 'torch', 'grpo_kernels._C') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_extension_raises_a_clear_import_error(monkeypatch):
    module, error = _ext._load("grpo_kernels._C_not_there")
    assert module is None and isinstance(error, ImportError)
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", error)
    assert not _ext.has_extension() and not _ext.has_cuda_extension()
    with pytest.raises(ImportError, match=r"uv sync --reinstall-package grpo-kernels") as info:
        _ext.pack_first_fit_decreasing(np.array([1], dtype=np.int64), 2)
    assert "_C_not_there" in str(info.value) and "implementation='python'" in str(info.value)
    with pytest.raises(ImportError, match="not available"):
        packing.pack_lengths([1, 2], 4, implementation="cpp")
    assert packing.pack_lengths([1, 2], 4, implementation="python") == [[0, 1]]


# ------------------------------------------------------------------------------------------
# The torch op
# ------------------------------------------------------------------------------------------
OP = _ext.register_torch_ops()


def test_op_is_registered_once():
    assert _ext.register_torch_ops() is OP
    assert hasattr(torch.ops.grpo_kernels, "position_ids_from_cu_seqlens")


def test_op_values_on_cpu():
    cu = torch.tensor([0, 3, 3, 5, 9], dtype=torch.int64)
    expected = [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert torch.ops.grpo_kernels.position_ids_from_cu_seqlens(cu, 9).tolist() == expected
    assert _ext.position_ids_from_cu_seqlens(cu, 9).tolist() == expected
    assert _ext.position_ids_from_cu_seqlens(torch.tensor([0, 0]), 0).tolist() == []


@pytest.mark.parametrize(
    ("cu", "total", "message"),
    [
        (torch.tensor([0, 3], dtype=torch.int32), 3, "int64"),
        (torch.tensor([[0, 3]]), 3, "1-D"),
        (torch.tensor([1, 3]), 3, "from 0 to total=3"),
        (torch.tensor([0, 3]), 4, "from 0 to total=4"),
        (torch.tensor([0, 3, 2, 4]), 4, "non-decreasing"),
    ],
)
@pytest.mark.parametrize("entry", ["op", "eager"])
def test_op_rejects_bad_cu_seqlens(cu, total, message, entry):
    call = OP if entry == "op" else _ext.position_ids_from_cu_seqlens
    with pytest.raises(ValueError, match=message):
        call(cu, total)


def test_op_passes_opcheck():
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int64)
    result = torch.library.opcheck(OP, (cu, 7))
    assert set(result.values()) == {"SUCCESS"}, result


def test_op_fake_implementation_gives_the_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = OP(torch.empty(5, dtype=torch.int64), 11)
    assert out.shape == (11,) and out.dtype == torch.int64


def test_op_traces_under_torch_compile():
    @torch.compile(backend="aot_eager", fullgraph=True)
    def shifted_positions(cu: torch.Tensor) -> torch.Tensor:
        return OP(cu, 6) + 1

    assert shifted_positions(torch.tensor([0, 4, 6])).tolist() == [1, 2, 3, 4, 1, 2]


@pytest.mark.gpu
@cuda
def test_op_cuda_kernel_matches_torch():
    assert _ext.has_cuda_extension(), "GPU machines must build the CUDA kernels (GRPO_REQUIRE_CUDA=ON)"
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 700, (257,), generator=gen)
    lengths[::7] = 0
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    total = int(cu[-1])
    got = _ext.position_ids_from_cu_seqlens(cu.cuda(), total)
    assert got.is_cuda and torch.equal(got.cpu(), _ext._position_ids_torch(cu, total))
    # A cu_seqlens that overruns `total` must not write out of bounds.
    short = _ext.position_ids_from_cu_seqlens(cu.cuda(), total // 2)
    torch.cuda.synchronize()
    assert short.shape == (total // 2,)


# ------------------------------------------------------------------------------------------
# The token_logprobs op (CUDA kernels in csrc/cuda/token_logprobs.cu; PyTorch elsewhere)
# ------------------------------------------------------------------------------------------
IGNORE = -100
LOGPROBS = _ext.register_logprob_ops()


def logits_and_targets(T, V, dtype=torch.float64, seed=0, device="cpu", scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)
    targets = torch.randint(0, V, (T,), generator=gen)
    targets[::4] = IGNORE
    return logits, targets.to(device)


def reference_with_grads(logits, targets, temperature, w_lp, w_ent):
    """fp64 reference: (logprobs, entropies, d(sum w_lp lp + w_ent H)/d logits)."""
    x = logits.detach().double().clone().requires_grad_()
    lp, ent = reference.token_logprobs(x, targets, temperature, True)
    ((lp * w_lp.double()).sum() + (ent * w_ent.double()).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def test_logprob_op_is_registered_once():
    assert _ext.register_logprob_ops() is LOGPROBS
    assert hasattr(torch.ops.grpo_kernels, "token_logprobs")
    assert hasattr(torch.ops.grpo_kernels, "token_logprobs_backward")


def test_logprob_op_on_cpu_matches_the_reference_with_gradients():
    logits, targets = logits_and_targets(6, 19)
    gen = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(6, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)
    x = logits.clone().requires_grad_()
    lp, ent = _ext.token_logprobs(x, targets, 0.8, True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    ref_lp, ref_ent, ref_grad = reference_with_grads(logits, targets, 0.8, w_lp, w_ent)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_grad, rtol=0, atol=1e-12)
    # Only one output used: the other's gradient is absent, not a zero tensor to multiply.
    x.grad = None
    _ext.token_logprobs(x, targets, 0.8, True)[1].sum().backward()
    _, _, ent_only = reference_with_grads(logits, targets, 0.8, torch.zeros(6), torch.ones(6))
    torch.testing.assert_close(x.grad, ent_only, rtol=0, atol=1e-12)


def test_logprob_op_passes_opcheck_and_gradcheck():
    logits, targets = logits_and_targets(5, 11)
    for entropy in (True, False):
        result = torch.library.opcheck(LOGPROBS, (logits.clone().requires_grad_(), targets, 0.9, IGNORE, entropy))
        assert set(result.values()) == {"SUCCESS"}, result
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: _ext.token_logprobs(z, targets, 1.3, True), (x,))


def test_logprob_op_fake_shapes_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        lp, ent, lse = LOGPROBS(
            torch.empty(2, 3, 7, dtype=torch.bfloat16), torch.empty(6, dtype=torch.int64), 1.0, IGNORE, False
        )
    assert lp.shape == lse.shape == (6,) and ent.shape == (0,) and lp.dtype == torch.float32

    @torch.compile(backend="aot_eager", fullgraph=True)
    def total_logprob(logits, targets):
        return LOGPROBS(logits, targets, 0.5, IGNORE, False)[0].sum()

    logits, targets = logits_and_targets(4, 9)
    x = logits.clone().requires_grad_()
    total_logprob(x, targets).backward()
    _, _, grad = reference_with_grads(logits, targets, 0.5, torch.ones(4), torch.zeros(4))
    torch.testing.assert_close(x.grad, grad, rtol=0, atol=1e-12)


def test_rows_layout_addresses_every_row_as_the_kernels_do():
    """The CUDA kernels find row r at (r // inner) * outer_stride + (r % inner) * inner_stride."""
    full = torch.arange(3 * 5 * 7, dtype=torch.float32).view(3, 5, 7)
    cases = {
        "sliced": full[:, :-1],
        "strided rows": full.view(15, 7)[::2],
        "transposed": full.transpose(0, 1),
        "flat": full.view(15, 7),
    }
    for name, logits in cases.items():
        view, outer, inner_stride, inner = _ext._rows_layout(logits)
        rows = logits.reshape(-1, 7)
        for r in range(rows.shape[0]):
            at = view.storage_offset() + (r // inner) * outer + (r % inner) * inner_stride
            assert torch.equal(torch.as_strided(view, (7,), (1,), at), rows[r]), (name, r)
        if name != "transposed":  # mergeable layouts are walked in place
            assert view.data_ptr() == logits.data_ptr(), name


@pytest.mark.parametrize(
    ("logits", "targets", "message"),
    [
        (torch.zeros(4, 5), torch.zeros(3, dtype=torch.int64), "targets"),
        (torch.zeros(4, 5), torch.zeros(4, dtype=torch.int32), "targets"),
        (torch.zeros(5), torch.zeros(5, dtype=torch.int64), "logits"),
    ],
)
def test_logprob_op_rejects_bad_arguments(logits, targets, message):
    with pytest.raises(ValueError, match=message):
        LOGPROBS(logits, targets, 1.0, IGNORE, False)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_cuda_logprob_kernels_match_fp64_no_worse_than_eager(dtype):
    """Same rule as the Triton GPU test: logprob error no worse than eager in the input dtype."""
    import grpo_kernels

    assert _ext.has_cuda_extension(), "GPU machines must build the CUDA kernels (GRPO_REQUIRE_CUDA=ON)"
    T, V = 1024, 50257  # odd V: rows after the first are not 16-byte aligned (scalar path)
    logits, targets = logits_and_targets(T, V, dtype, device="cuda", scale=4.0)
    w_lp = torch.randn(T, device="cuda")
    x = logits.clone().requires_grad_()
    lp, ent = grpo_kernels.token_logprobs(x, targets, 0.7, True)
    ((lp * w_lp).sum() + ent.sum()).backward()
    exact_lp, exact_ent, exact_grad = reference_with_grads(logits, targets, 0.7, w_lp, torch.ones(T, device="cuda"))
    logp = torch.log_softmax(logits.float() / 0.7, -1)  # eager in the same input dtype
    eager_lp = logp.gather(1, targets.clamp_min(0)[:, None]).squeeze(1).masked_fill(targets == IGNORE, 0)
    assert (lp.double() - exact_lp).abs().max() <= (eager_lp.double() - exact_lp).abs().max() + 1e-5
    assert torch.isfinite(ent).all() and (ent.double() - exact_ent).abs().max() < 1e-3
    grad_tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
    torch.testing.assert_close(x.grad.double(), exact_grad, rtol=0, atol=grad_tol)
    assert (x.grad[targets == IGNORE] == 0).all()


@pytest.mark.gpu
@cuda
def test_cuda_logprob_kernels_on_strided_views_many_rows_and_masked_vocabulary():
    assert _ext.has_cuda_extension()
    # [B, S, V][:, :-1] is walked in place; V = 4096 keeps rows 16-byte aligned (vector path).
    full, _ = logits_and_targets(3 * 9, 4096, torch.bfloat16, device="cuda")
    full = full.view(3, 9, 4096)
    full[0, :, 1000:] = -float("inf")
    targets = torch.randint(0, 1000, (3, 8), device="cuda")
    x = full.clone().requires_grad_()
    lp, ent = _ext.token_logprobs(x[:, :-1], targets, 1.1, True)
    (lp.sum() + ent.sum()).backward()
    exact_lp, exact_ent, exact_grad = reference_with_grads(
        full[:, :-1], targets, 1.1, torch.ones(24, device="cuda"), torch.ones(24, device="cuda")
    )
    torch.testing.assert_close(lp.double(), exact_lp.view(3, 8), rtol=0, atol=1e-4)
    torch.testing.assert_close(ent.double(), exact_ent.view(3, 8), rtol=0, atol=1e-3)
    torch.testing.assert_close(x.grad[:, :-1].double(), exact_grad, rtol=0, atol=2e-2)
    assert (x.grad[:, -1] == 0).all() and torch.isfinite(x.grad).all()
    # More rows than the grid cap of 65536 blocks: every row is written (grid-stride loop).
    logits, targets = logits_and_targets(200_000, 33, torch.float32, device="cuda")
    lp = _ext.token_logprobs(logits, targets)
    ref = reference.token_logprobs(logits.double(), targets)
    torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-5)


@pytest.mark.gpu
@cuda
def test_cuda_logprob_kernels_pass_opcheck_and_gradcheck_fp64():
    assert _ext.has_cuda_extension()
    logits, targets = logits_and_targets(4, 11, device="cuda", scale=1.0)
    result = torch.library.opcheck(LOGPROBS, (logits.clone().requires_grad_(), targets, 0.9, IGNORE, True))
    assert set(result.values()) == {"SUCCESS"}, result
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: _ext.token_logprobs(z, targets, 1.3, True), (x,))


@pytest.mark.gpu
@cuda
def test_dispatch_picks_the_cuda_extension_and_says_so(caplog):
    import logging

    import grpo_kernels

    logits, targets = logits_and_targets(8, 64, torch.float32, device="cuda")
    with caplog.at_level(logging.DEBUG, logger="grpo_kernels.dispatch"):
        grpo_kernels.token_logprobs(logits, targets)
    expected = "cuda extension" if _ext.has_cuda_extension() else "triton"
    assert f"token_logprobs -> {expected}" in caplog.text
