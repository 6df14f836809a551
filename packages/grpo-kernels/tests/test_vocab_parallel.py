"""The vocab-parallel logprob op on real gloo ranks against the unsharded op.

Two processes each hold a column shard of the same logits; the torch op's logprobs,
entropies and shard gradients must equal `reference.token_logprobs` on the full logits (and
the slice of its gradient), and so must the Triton op's (`ops.vocab_parallel`, under the
interpreter on CPU: TRITON_INTERPRET=1 from the root conftest reaches the child processes) and
the reference twin's (gather, then the unsharded op).
Rank 0 runs in the test process, the others in child processes that load this file by path.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
import subprocess
import sys

import pytest
import torch

from grpo_kernels import reference as R
from grpo_kernels.vocab_parallel import vocab_parallel_token_logprobs

IGNORE = -100
# The Triton op runs where it can: compiled on CUDA, interpreted on CPU under TRITON_INTERPRET=1.
HAS_TRITON = importlib.util.find_spec("triton") is not None
# Columns per Triton block in these tests: every shard (12 to 24 columns) takes two blocks, the
# last one partial.
TEST_BLOCK_V = 8
# (name, leading shape, V, dtype, temperature, packed, entropy)
CASES = [
    ("flat_fp64", (13,), 24, torch.float64, 1.0, False, True),
    ("padded_fp32", (3, 7), 48, torch.float32, 0.7, False, True),
    ("packed_fp32", (17,), 30, torch.float32, 1.3, True, False),
    ("masked_vocab_fp32", (9,), 36, torch.float32, 1.0, False, True),
]


def tolerance(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}


def make_case(leading, V, dtype, seed, masked_vocab=False):
    """Full logits [*leading, V], targets (a few ignored) and the upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*leading, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    if masked_vocab:  # padded vocabulary rows of an lm_head: -inf in one shard only
        logits[..., -5:] = -torch.inf
    targets = torch.randint(0, V - 5 if masked_vocab else V, leading, generator=g)
    targets.view(-1)[torch.randperm(targets.numel(), generator=g)[:2]] = IGNORE
    g_lp = torch.randn(leading, generator=g, dtype=torch.float64)
    g_ent = torch.randn(leading, generator=g, dtype=torch.float64)
    return logits, targets, g_lp, g_ent


def forward_backward(fn, logits, targets, temperature, entropy, g_lp, g_ent, **kw):
    x = logits.detach().clone().requires_grad_(True)
    out = fn(x, targets, temperature=temperature, return_entropy=entropy, **kw)
    lp, ent = out if entropy else (out, None)
    loss = (lp * g_lp.to(lp.dtype)).sum() + ((ent * g_ent.to(ent.dtype)).sum() if entropy else 0)
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), x.grad


def implementations(device: torch.device) -> list:
    """The torch op, the reference twin, where it runs the Triton op (with TEST_BLOCK_V on CPU, its
    own block size on CUDA), and the public dispatch (the torch op on CPU, Triton on CUDA)."""
    import grpo_kernels

    impls = [vocab_parallel_token_logprobs, R.vocab_parallel_token_logprobs]
    if HAS_TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        from grpo_kernels.ops import vocab_parallel as K

        impls.append(
            functools.partial(K.vocab_parallel_token_logprobs, block_v=TEST_BLOCK_V)
            if device.type == "cpu"
            else K.vocab_parallel_token_logprobs
        )
    impls.append(grpo_kernels.vocab_parallel_token_logprobs)  # the dispatch: the torch op on CPU, Triton on CUDA
    return impls


def run_rank(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    """Every case on this rank's shard; asserts inside (a failing child exits non-zero). NCCL
    ranks compute on GPU `rank`."""
    import datetime

    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        for seed, (name, leading, V, dtype, temperature, packed, entropy) in enumerate(CASES):
            V = V // world * world
            case = make_case(leading, V, dtype, seed, masked_vocab=name.startswith("masked"))
            kw = {}
            if packed:
                kw["cu_seqlens"] = torch.tensor([0, 5, 6, 12, 17], device=device)
                case = (case[0], torch.randint(0, V, leading, generator=torch.Generator().manual_seed(seed)), *case[2:])
            logits, targets, g_lp, g_ent = (t.to(device) for t in case)
            want_lp, want_ent, want_grad = forward_backward(
                R.token_logprobs, logits, targets, temperature, entropy, g_lp, g_ent, **kw
            )
            cols = slice(rank * V // world, (rank + 1) * V // world)
            shard = logits[..., cols]
            for impl in implementations(device):
                lp, ent, grad = forward_backward(impl, shard, targets, temperature, entropy, g_lp, g_ent, **kw)
                what = f"{name} {getattr(impl, 'func', impl).__module__} rank {rank}"
                torch.testing.assert_close(lp, want_lp, **tolerance(dtype), msg=what)
                if entropy:
                    torch.testing.assert_close(ent, want_ent, **tolerance(dtype), msg=what)
                torch.testing.assert_close(grad, want_grad[..., cols], **tolerance(dtype), msg=what)
            with torch.no_grad():  # the no-grad path gives the same numbers
                for impl in implementations(device):
                    torch.testing.assert_close(
                        impl(shard, targets, temperature=temperature, **kw), want_lp, **tolerance(dtype)
                    )
    finally:
        dist.destroy_process_group()


CHILD = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("vocab_parallel_rank", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
torch.set_num_threads(1)
module.run_rank(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
"""


def run_ranks(world: int, backend: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, __file__, str(rank), str(world), str(port), backend],
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(1, world)
    ]
    try:
        run_rank(0, world, port, backend)
    finally:
        errors = [child.communicate(timeout=180)[1] for child in children]
    for child, err in zip(children, errors, strict=True):
        assert child.returncode == 0, err[-3000:]


def test_sharded_logprobs_entropy_and_gradients_match_the_unsharded_op():
    assert len(implementations(torch.device("cpu"))) == 4 or not HAS_TRITON  # Triton's op is compared too
    run_ranks(2, "gloo")


AOT_COMPILE = """
import inspect
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from grpo_kernels.ops import vocab_parallel as K

for fn, const in [(K._vocab_parallel_token_logprobs_fwd_kernel, dict(RETURN_ENTROPY=True)),
                  (K._vocab_parallel_token_logprobs_bwd_kernel, dict(HAS_GRAD_LOGPROBS=True, HAS_GRAD_ENTROPY=True))]:
    const.update(ACC=tl.float32, BLOCK_V=4096)
    names = list(inspect.signature(fn.fn).parameters)
    types = {"targets_ptr": "*i64", "logits_ptr": "*bf16", "grad_logits_ptr": "*bf16", "temp_hi": "fp32", "temp_lo": "fp32"}
    sig = {n: "constexpr" if n in const else types.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    print(".entry " + fn.fn.__name__ in triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


def test_triton_kernels_compile_for_sm90(tmp_path):
    """The interpreter does not type-check as the compiler does; this compiles both kernels (bf16
    logits, fp32 accumulation) to PTX for an H100/H200, no GPU needed, in a fresh Triton cache."""
    if not HAS_TRITON:
        pytest.skip("needs triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", AOT_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode and "ptxas" in out.stderr.lower() and "not found" in out.stderr.lower():
        pytest.skip("triton's bundled ptxas is missing")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["True", "True"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")
def test_nccl_ranks_match_the_unsharded_op():
    """The same cases on two GPUs over NCCL: the torch op, the twin, and the Triton kernels (compiled
    when run with TRITON_INTERPRET=0, as the other GPU tests), directly and through the dispatch."""
    run_ranks(2, "nccl")


def test_bad_inputs_name_the_argument():
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="target_ids: id 8 is out of range"):
            vocab_parallel_token_logprobs(torch.zeros(2, 8), torch.tensor([1, 8]))
        with pytest.raises(ValueError, match="logits: expected"):
            vocab_parallel_token_logprobs(torch.zeros(8), torch.tensor([1]))
        with pytest.raises(ValueError, match="temperature"):
            vocab_parallel_token_logprobs(torch.zeros(2, 8), torch.tensor([1, 2]), temperature=0.0)
    finally:
        dist.destroy_process_group()
