"""The clipped PG loss + KL: eager composition (the reference), torch.compile of it, Liger
(when installed) and grpo_kernels' Triton kernels, in one process.

    uv run --no-sync python benchmarks/kernels/bench_pg_loss.py [--device auto|cpu|cuda] [--quick]

Shapes: T in {16K, 256K, 1M} tokens on a GPU ({16K, 256K} on CPU) as a padded [T/1024, 1024]
batch, token- and sequence-level loss, beta in {0, 0.04}. Reports median time forward (graph
built, no backward) and forward+backward, kernel launches (aten ops on CPU), peak extra memory.
Writes benchmarks/results/kernels_pg_loss_{gpu,cpu}.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import grpo_kernels  # noqa: E402
from grpo_kernels import reference  # noqa: E402
from grpo_kernels.loss_config import PGLossConfig  # noqa: E402

SEQ_LEN = 1024
GPU_TOKENS = (16 * 1024, 256 * 1024, 1024 * 1024)
CPU_TOKENS = (16 * 1024, 256 * 1024)
QUICK_TOKENS = (16 * 1024,)
TARGETS = ["one launch each way on the token-level path", ">= 4x faster than eager at 1M tokens on an H200"]


def make_batch(n_tokens: int, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    B = max(1, n_tokens // SEQ_LEN)
    shape = (B, SEQ_LEN)
    gen = -torch.rand(shape, generator=g, device=device) * 3
    prev = gen + torch.randn(shape, generator=g, device=device) * 0.05
    curr = prev + torch.randn(shape, generator=g, device=device) * 0.05
    ref = prev + torch.randn(shape, generator=g, device=device) * 0.1
    adv = torch.randn(B, 1, generator=g, device=device).expand(shape).contiguous()
    lengths = torch.randint(SEQ_LEN // 4, SEQ_LEN + 1, (B,), generator=g, device=device)
    token_mask = (torch.arange(SEQ_LEN, device=device)[None, :] < lengths[:, None]).float()
    token_mask[:, :64] = 0  # prompt
    sample_mask = torch.ones(B, device=device)
    return dict(
        curr=curr,
        prev=prev,
        gen=gen,
        ref=ref,
        advantages=adv,
        token_mask=token_mask,
        sample_mask=sample_mask,
        global_valid_tokens=int(token_mask.sum()),
        global_valid_seqs=B,
    )


def impls(device):
    out = {"eager (reference)": reference.clipped_pg_loss}
    compiled, why = harness.compile_or_none(reference.clipped_pg_loss, dynamic=False)
    out["torch.compile"] = compiled or why
    if device.type == "cuda":
        out["grpo_kernels"] = grpo_kernels.clipped_pg_loss
        out["liger"] = "not comparable: Liger's GRPO loss starts from hidden states / logits, not from logprobs"
    return out


def bench(tokens, device, repeats) -> list[dict]:
    rows = []
    implementations = impls(device)
    for n_tokens in tokens:
        batch = make_batch(n_tokens, device)
        for level in ("token", "sequence"):
            for beta in (0.0, 0.04):
                cfg = PGLossConfig(token_level_loss=level == "token", reference_policy_kl_penalty=beta)
                eager_ms = None
                for name, impl in implementations.items():
                    row = dict(T=n_tokens, level=level, beta=beta, impl=name)
                    rows.append(row)
                    if isinstance(impl, str):
                        row["note"] = impl[:100]
                        continue
                    curr = batch["curr"].clone().requires_grad_()
                    args = {k: v for k, v in batch.items() if k != "curr"}

                    def forward():
                        return impl(curr, **args, config=cfg)

                    def forward_backward():
                        loss, _ = forward()
                        return torch.autograd.grad(loss, curr)

                    try:
                        fwd = harness.timings(forward, device, repeats=repeats)
                        fwd_bwd = harness.timings(forward_backward, device, repeats=repeats)
                    except Exception as err:  # noqa: BLE001 - report, keep going
                        row["note"] = f"failed: {type(err).__name__}: {err}"[:120]
                        continue
                    eager_ms = eager_ms or (fwd["ms"], fwd_bwd["ms"])
                    row.update(
                        fwd_ms=fwd["ms"],
                        fwd_bwd_ms=fwd_bwd["ms"],
                        fwd_cpu_ms=fwd.get("cpu_ms", ""),
                        fwd_bwd_cpu_ms=fwd_bwd.get("cpu_ms", ""),
                        speedup_fwd=eager_ms[0] / fwd["ms"],
                        speedup_fwd_bwd=eager_ms[1] / fwd_bwd["ms"],
                        launches_fwd=harness.launches(forward, device),
                        launches_fwd_bwd=harness.launches(forward_backward, device),
                        peak_fwd_bwd_MiB=harness.peak_extra_bytes(forward_backward, device) / 2**20,
                    )
                    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="16K tokens only (smoke run)")
    args = parser.parse_args(argv)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    kind = "gpu" if device.type == "cuda" else "cpu"
    tokens = QUICK_TOKENS if args.quick else (GPU_TOKENS if kind == "gpu" else CPU_TOKENS)
    info = harness.machine(device)
    ceiling = harness.ceilings(device)
    print(info, ceiling, flush=True)
    rows = bench(tokens, device, repeats=10 if kind == "gpu" else 3)
    notes = [
        f"Padded [T/{SEQ_LEN}, {SEQ_LEN}] float32 logprobs, ragged response lengths, 64 prompt "
        "tokens masked; default GRPO options otherwise (clip 0.2, k3 KL with clamps). fwd = "
        "forward with curr requiring grad (graph built, metrics included, no host sync); "
        "fwd+bwd adds the backward to curr. launches = CUDA kernels (GPU) or top-level aten ops "
        "(CPU) per call, including the metrics. `*_cpu_ms` (CPU only) = process CPU time.",
        "",
        "Targets (issue 5): " + "; ".join(TARGETS) + ".",
    ]
    if kind == "cpu":
        notes += [
            "",
            "**GPU figures: pending.** No GPU was available to this task; on CPU grpo_kernels "
            "dispatches to the reference (the eager composition), so the Triton kernels are not "
            "timed here. Run this script on a CUDA machine to write kernels_pg_loss_gpu.md. The "
            "machine is shared (see the load average): CPU medians are noisy.",
        ]
    columns = ["T", "level", "beta", "impl", "fwd_ms", "fwd_bwd_ms"]
    columns += ["fwd_cpu_ms", "fwd_bwd_cpu_ms"] if kind == "cpu" else []
    columns += ["speedup_fwd", "speedup_fwd_bwd", "launches_fwd", "launches_fwd_bwd", "peak_fwd_bwd_MiB", "note"]
    stem = f"kernels_pg_loss_{kind}" + ("_quick" if args.quick else "")
    path = harness.write_results(stem, f"Clipped PG loss + KL ({kind.upper()})", info, ceiling, rows, columns, notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
