"""csrc/cuda/online_lse.h, the softmax math of the CUDA token_logprobs kernels, compiled for the
host with the system C++ compiler (no GPU, no nvcc) and replayed in the kernels' order: each
thread pushes its 16-byte packs and tail columns of the row, then warp butterflies merge the
states (see online_lse_harness.cpp). Checked
against the fp64 reference for logsumexp, entropy and d logits."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from grpo_kernels import reference as R

HERE = Path(__file__).resolve().parent
HEADER_DIR = HERE.parents[2] / "csrc" / "cuda"
CXX = shutil.which("c++") or shutil.which("g++")
pytestmark = pytest.mark.skipif(
    CXX is None or not (HEADER_DIR / "online_lse.h").exists(), reason="needs a C++ compiler and the csrc/ tree"
)
IGNORE = -100


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("online_lse") / "harness"
    subprocess.run(
        [
            CXX,
            "-std=c++17",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{HEADER_DIR}",
            str(HERE / "online_lse_harness.cpp"),
            "-o",
            str(exe),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return exe


def run_harness(exe, acc, threads, vec, temperature, logits, targets, g_lp, g_ent):
    lines = [str(len(logits))]
    for row, t, a, b in zip(logits.tolist(), targets.tolist(), g_lp.tolist(), g_ent.tolist()):
        lines.append(f"{len(row)} {t} {a!r} {b!r} " + " ".join(repr(v) for v in row))
    out = subprocess.run(
        [str(exe), acc, str(threads), str(vec), repr(temperature)],
        input="\n".join(lines),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    values = torch.tensor([[float(v) for v in line.split()] for line in out.splitlines()], dtype=torch.float64)
    return values[:, 0], values[:, 1], values[:, 2:]


def rows(V, n, seed, scale):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g, dtype=torch.float64) * scale
    logits[0, : V // 2] = -float("inf")  # a masked half row (whole thread slices empty)
    logits[1, :-1] = -float("inf")  # one live logit
    logits[2] = torch.linspace(-scale, scale, V, dtype=torch.float64)  # the max comes last
    targets = torch.randint(V // 2, V, (n,), generator=g)
    targets[1] = V - 1
    g_lp, g_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    return logits, targets, g_lp, g_ent


def exact(logits, targets, temperature, g_lp, g_ent):
    x = logits.clone().requires_grad_()
    lp, ent = R.token_logprobs(x, targets, temperature, True)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return torch.logsumexp(logits / temperature, -1), ent.detach(), x.grad


# (accumulator, values per 16-byte pack as read by the kernel, tolerance): fp64 logits, fp32 logits,
# bf16/fp16 logits (float accumulation, 8 per pack), and an unaligned row (no packs).
ACCS = [("double", 2, 1e-12), ("float", 4, 2e-5), ("float", 8, 2e-5), ("float", 0, 2e-5)]


@pytest.mark.parametrize("acc, vec, tol", ACCS)
@pytest.mark.parametrize("V, threads, scale", [(37, 128, 3.0), (1000, 256, 30.0), (70, 32, 1.0)])
def test_kernel_order_matches_the_fp64_reference(harness, acc, vec, tol, V, threads, scale):
    logits, targets, g_lp, g_ent = rows(V, 6, seed=V, scale=scale)
    if acc == "float":  # the kernel reads float32 logits: compare on the same inputs
        logits = logits.float().double()
    lse, ent, grad = run_harness(harness, acc, threads, vec, 0.7, logits, targets, g_lp, g_ent)
    ref_lse, ref_ent, ref_grad = exact(logits, targets, 0.7, g_lp, g_ent)
    torch.testing.assert_close(lse, ref_lse, rtol=tol, atol=tol)
    torch.testing.assert_close(ent, ref_ent, rtol=tol, atol=tol * max(1.0, scale))
    torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol)
    assert (grad[0, : V // 2] == 0).all()  # -inf logits get exactly 0, not NaN


def test_row_of_only_masked_logits_gives_minus_inf_lse(harness):
    logits = torch.full((1, 40), -float("inf"), dtype=torch.float64)
    lse, _, _ = run_harness(harness, "double", 64, 2, 1.0, logits, torch.tensor([3]), torch.zeros(1), torch.zeros(1))
    assert lse.item() == -float("inf")
