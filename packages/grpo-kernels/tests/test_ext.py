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

from grpo_kernels import _ext, packing

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
    code = "import sys, grpo_kernels; print(sorted(m for m in ('triton', 'torch', 'grpo_kernels._C') if m in sys.modules))"
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
