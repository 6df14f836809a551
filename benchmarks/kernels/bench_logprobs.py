"""Token logprobs (+ entropy) from logits, and the fused lm_head logprobs: torch eager,
torch.compile, the chunked reference, Liger (when installed) and grpo_kernels (its CUDA extension and
its Triton kernels), in one process.

    uv run --no-sync python benchmarks/kernels/bench_logprobs.py [--device auto|cpu|cuda] [--quick]

On a GPU it runs the issue's shapes (T in {4096, 16384, 32768}, V in {32000, 128256, 151936},
H in {2048, 4096}, bf16); on CPU small float32 shapes (CPU runs use float32, and there
grpo_kernels dispatches to the reference, so "ours" is not repeated). Reports median time,
GB/s (logits op) or TFLOP/s (fused op) against the ceilings measured in the same run, and
peak extra memory. Writes benchmarks/results/kernels_logprobs_{gpu,cpu}.{md,json}.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import grpo_kernels  # noqa: E402
from grpo_kernels import _ext, reference  # noqa: E402

TEMPERATURE = 0.7
GPU_SHAPES = dict(T=(4096, 16384, 32768), V=(32000, 128256, 151936), H=(2048, 4096), dtype=torch.bfloat16)
CPU_SHAPES = dict(T=(512, 2048), V=(4096, 32000), H=(256,), dtype=torch.float32)
QUICK_SHAPES = dict(T=(256,), V=(4096,), H=(128,), dtype=torch.float32)
# Targets of issue 4 on an H200 (T=16384, V=151936, bf16, logprob + entropy, forward).
TARGETS = [
    "logprob + entropy forward at T=16384, V=151936: <= 1.35 ms (>= 85 % of copy bandwidth), >= 5x eager",
    "fused lm_head forward: >= 550 TFLOP/s, peak extra memory <= 1/10 of the naive path",
]


def eager(logits, targets, temperature, entropy):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    return (lp, -(logp.exp() * logp).sum(-1)) if entropy else lp


def triton_logits_impl():
    try:
        from grpo_kernels.ops.logprobs import token_logprobs
    except ImportError as err:
        return f"triton unavailable: {err}"
    return token_logprobs


def liger_logits_impl():
    """Liger's cross entropy with reduction='none' gives -logprob (no entropy)."""
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerCrossEntropyLoss(reduction="none")

    def run(logits, targets, temperature, entropy):
        if entropy:
            raise NotImplementedError("no entropy output")
        return -loss(logits / temperature, targets)

    return run


def liger_linear_impl():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")

    def run(hidden, weight, targets, temperature, entropy):
        if entropy or temperature != 1.0:
            raise NotImplementedError("no entropy output / temperature")
        return -loss(weight, hidden, targets)

    return run


def logits_impls(device):
    impls = {"eager": eager, "reference": reference.token_logprobs}
    compiled, why = harness.compile_or_none(eager, dynamic=False)
    impls["torch.compile"] = compiled or why
    if device.type == "cuda":
        # Both fast paths, named: the dispatch (grpo_kernels.token_logprobs) takes the first.
        impls["grpo_kernels cuda ext"] = (
            _ext.token_logprobs if _ext.has_cuda_extension() else "grpo_kernels._C was built without CUDA"
        )
        impls["grpo_kernels triton"] = triton_logits_impl()
        impls["liger"] = liger_logits_impl() or "not installed"
    return impls


def linear_impls(device):
    def naive(hidden, weight, targets, temperature, entropy):
        return eager(hidden @ weight.t(), targets, temperature, entropy)

    impls = {"eager": naive, "reference": reference.linear_token_logprobs}
    compiled, why = harness.compile_or_none(naive, dynamic=False)
    impls["torch.compile"] = compiled or why
    if device.type == "cuda":
        impls["grpo_kernels"] = grpo_kernels.linear_token_logprobs
        impls["liger"] = liger_linear_impl() or "not installed"
    return impls


def measure(call, inputs, device, repeats):
    """-> dict of forward / forward+backward median times and peak extra memory."""

    def forward():
        with torch.no_grad():
            return call()

    def forward_backward():
        out = call()
        total = sum(o.float().sum() for o in (out if isinstance(out, tuple) else (out,)))
        return torch.autograd.grad(total, inputs)

    fwd = harness.timings(forward, device, repeats=repeats)
    fwd_bwd = harness.timings(forward_backward, device, repeats=repeats)
    result = dict(
        fwd_ms=fwd["ms"],
        fwd_bwd_ms=fwd_bwd["ms"],
        peak_fwd_MiB=harness.peak_extra_bytes(forward, device) / 2**20,
        peak_fwd_bwd_MiB=harness.peak_extra_bytes(forward_backward, device) / 2**20,
    )
    if "cpu_ms" in fwd:
        result.update(fwd_cpu_ms=fwd["cpu_ms"], fwd_bwd_cpu_ms=fwd_bwd["cpu_ms"])
    return result


def bench_logits(shapes, device, ceiling, repeats) -> list[dict]:
    rows = []
    impls = logits_impls(device)
    for T in shapes["T"]:
        for V in shapes["V"]:
            g = torch.Generator(device=device).manual_seed(0)
            logits = (torch.randn(T, V, generator=g, device=device) * 2).to(shapes["dtype"]).requires_grad_()
            targets = torch.randint(0, V, (T,), generator=g, device=device)
            nbytes = logits.numel() * logits.element_size()
            for entropy in (False, True):
                eager_ms = None
                for name, impl in impls.items():
                    row = dict(op="logprobs", impl=name, T=T, V=V, entropy=entropy, dtype=str(shapes["dtype"])[6:])
                    rows.append(row)
                    if isinstance(impl, str):
                        row["note"] = impl[:80]
                        continue
                    try:
                        m = measure(
                            functools.partial(impl, logits, targets, TEMPERATURE, entropy), logits, device, repeats
                        )
                    except Exception as err:  # noqa: BLE001 - report, keep going
                        row["note"] = f"failed: {type(err).__name__}: {err}"[:120]
                        continue
                    eager_ms = eager_ms or (m["fwd_ms"], m["fwd_bwd_ms"])
                    row.update(
                        m,
                        # minimum traffic: forward reads the logits once; backward reads them
                        # again and writes d(logits)
                        fwd_bw_frac=nbytes / m["fwd_ms"] / 1e6 / ceiling["copy_GBps"],
                        fwd_bwd_bw_frac=3 * nbytes / m["fwd_bwd_ms"] / 1e6 / ceiling["copy_GBps"],
                        speedup_fwd=eager_ms[0] / m["fwd_ms"],
                        speedup_fwd_bwd=eager_ms[1] / m["fwd_bwd_ms"],
                    )
                    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            del logits
    return rows


def bench_linear(shapes, device, ceiling, repeats) -> list[dict]:
    rows = []
    impls = linear_impls(device)
    for T in shapes["T"]:
        for H in shapes["H"]:
            for V in shapes["V"]:
                g = torch.Generator(device=device).manual_seed(0)
                hidden = (torch.randn(T, H, generator=g, device=device) / H**0.5).to(shapes["dtype"]).requires_grad_()
                weight = torch.randn(V, H, generator=g, device=device).to(shapes["dtype"]).requires_grad_()
                targets = torch.randint(0, V, (T,), generator=g, device=device)
                flops = 2 * T * H * V
                eager_ms = None
                for name, impl in impls.items():
                    row = dict(
                        op="linear_logprobs", impl=name, T=T, H=H, V=V, entropy=False, dtype=str(shapes["dtype"])[6:]
                    )
                    rows.append(row)
                    if isinstance(impl, str):
                        row["note"] = impl[:80]
                        continue
                    try:
                        m = measure(
                            lambda: impl(hidden, weight, targets, 1.0, False), (hidden, weight), device, repeats
                        )
                    except Exception as err:  # noqa: BLE001
                        row["note"] = f"failed: {type(err).__name__}: {err}"[:120]
                        continue
                    eager_ms = eager_ms or (m["fwd_ms"], m["fwd_bwd_ms"])
                    row.update(
                        m,
                        fwd_tflops=flops / m["fwd_ms"] / 1e9,
                        fwd_bwd_tflops=3 * flops / m["fwd_bwd_ms"] / 1e9,
                        fwd_gemm_frac=flops / m["fwd_ms"] / 1e9 / ceiling["gemm_TFLOPs"],
                        speedup_fwd=eager_ms[0] / m["fwd_ms"],
                        speedup_fwd_bwd=eager_ms[1] / m["fwd_bwd_ms"],
                    )
                    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="one tiny shape (smoke run)")
    args = parser.parse_args(argv)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    shapes = QUICK_SHAPES if args.quick else (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    kind = "gpu" if device.type == "cuda" else "cpu"
    info = harness.machine(device)
    ceiling = harness.ceilings(device)
    print(info, ceiling, flush=True)
    repeats = 10 if device.type == "cuda" else 3
    rows = bench_logits(shapes, device, ceiling, repeats) + bench_linear(shapes, device, ceiling, repeats)
    notes = [
        f"Temperature {TEMPERATURE} for the logits op (1.0 for the fused op). fwd = under no_grad; "
        "fwd+bwd = forward with grad + backward of sum(outputs). `*_frac` = achieved fraction of "
        "the measured copy bandwidth (minimum traffic: fwd reads the logits once, fwd+bwd 3x) or "
        "of the measured GEMM rate (fused op, 2*T*H*V flops forward, 3x that forward+backward). "
        "Peak = extra memory allocated during the call above what was live before it. "
        "`*_cpu_ms` (CPU only) = process CPU time, less disturbed than wall time on a shared machine.",
        "",
        "Targets (issue 4, H200): " + "; ".join(TARGETS) + ".",
    ]
    if kind == "cpu":
        notes += [
            "",
            "**GPU figures: pending.** No GPU was available to this task; on CPU `grpo_kernels` "
            "dispatches to the reference, so only eager, torch.compile and the reference are timed "
            "(on a GPU the logits op adds `grpo_kernels cuda ext`, the compiled kernels of "
            "csrc/cuda/token_logprobs.cu, and `grpo_kernels triton`). "
            "Run this script on a CUDA machine to write kernels_logprobs_gpu.md. The machine is "
            "shared (see the load average): CPU medians are noisy.",
        ]
    columns = ["op", "impl", "T", "H", "V", "dtype", "entropy", "fwd_ms", "fwd_bwd_ms"]
    columns += ["fwd_cpu_ms", "fwd_bwd_cpu_ms"] if kind == "cpu" else []
    columns += [
        "fwd_bw_frac",
        "fwd_bwd_bw_frac",
        "fwd_tflops",
        "fwd_gemm_frac",
        "speedup_fwd",
        "speedup_fwd_bwd",
        "peak_fwd_MiB",
        "peak_fwd_bwd_MiB",
        "note",
    ]
    stem = f"kernels_logprobs_{kind}" + ("_quick" if args.quick else "")
    path = harness.write_results(
        stem, f"Token logprobs and fused lm_head logprobs ({kind.upper()})", info, ceiling, rows, columns, notes
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
