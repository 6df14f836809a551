"""The reference forward beside training vs before it, in one policy worker (issue #23), in-process.

A `PolicyWorker` with the bench's settings at either scale (`--scale tiny`: the bundled arith-tiny,
128 rows of up to 10 prompt + 8 generated tokens, micro-batches of 64; `--scale 34m`: the ~34M
Qwen2 of bench_vs_trl, 64 rows of up to 16 + 64 tokens, micro-batches of 32), KL 0.01, fp32, and
a synthetic batch of that shape. Two ways of running one step's reference forward and training,
called alternately (A, B, A, B, ...) so that both see the same load:
  - first:  `logprobs(batch, reference=True)` then `train(batch + ref)` (the old sync step's two calls);
  - beside: `train(batch)` with policy.reference_beside_training (the thread of policy/reference_ahead.py).
Prints median and fastest wall seconds and this process's CPU seconds (user+sys of all threads) per
way. On a loaded shared machine read the CPU seconds (the work) and the fastest wall time. The process
runs with OMP_WAIT_POLICY=PASSIVE, as the actors do (without it, under load, the spinning OpenMP
threads multiply both ways' CPU seconds several times).

Usage: uv run --no-sync python benchmarks/e2e/bench_reference_beside.py [--scale tiny|34m] [--threads 2] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# As in every actor (setup.actor_env_vars): idle OpenMP threads sleep. Set before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"tiny": (128, 10, 8, 64), "34m": (64, 16, 64, 32)}  # rows, max prompt, new tokens, micro-batch


def make_batch(vocab: int, rows: int, prompt: int, new: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    S = prompt + new
    prompt_lens = torch.randint(prompt // 2, prompt + 1, (rows,), generator=g)
    lengths = prompt_lens + new
    input_ids = torch.randint(2, vocab, (rows, S), generator=g)
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    token_mask = ((torch.arange(S)[None, :] >= prompt_lens[:, None]) & attention_mask.bool()).float()
    adv = torch.randn(rows, generator=g)
    gen = -torch.rand(rows, S, generator=g) * token_mask
    return {
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": gen,
        "advantages": adv[:, None] * token_mask,
        "sample_mask": torch.ones(rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from grpo_train.config.schema import LossConfig, PolicyConfig
    from grpo_train.policy.worker import PolicyWorker

    rows, prompt, new, micro = SHAPES[args.scale]
    if args.scale == "34m":
        from bench_vs_trl import write_34m_model

        model_dir = str(write_34m_model(Path(tempfile.mkdtemp(prefix="ref-beside-34m-")) / "model"))
    else:
        from grpo_train.assets import builtin_model_path

        model_dir = str(builtin_model_path("arith-tiny"))
    loss = LossConfig(
        reference_policy_kl_penalty=0.01,
        reference_policy_kl_type="k3",
        token_level_loss=True,
        use_importance_sampling_correction=False,
    )

    def worker(beside: bool) -> PolicyWorker:
        cfg = PolicyConfig(
            precision="float32",
            train_global_batch_size=rows,
            train_micro_batch_size=micro,
            logprob_batch_size=micro,
            max_grad_norm=1.0,
            use_fused_kernels=False,
            max_total_sequence_length=prompt + new + 16,
            reference_beside_training=beside,
            optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 3e-5, "weight_decay": 0.0}},
        )
        return PolicyWorker(model_dir, cfg, loss, seed=0, num_threads=args.threads)

    first, beside = worker(False), worker(True)
    batch = make_batch(first.model.config.vocab_size, rows, prompt, new)

    def run_first() -> None:
        first.train({**batch, "ref_logprobs": first.logprobs(batch, reference=True)})

    def run_beside() -> None:
        beside.train(batch)

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(
        f"scale {args.scale}, threads {torch.get_num_threads()}, repeats {args.repeats}; load before: {load}",
        flush=True,
    )
    times: dict[str, list[tuple[float, float]]] = {"first": [], "beside": []}
    run_first(), run_beside()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("first", run_first), ("beside", run_beside)):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - t0, time.process_time() - c0))
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load after: {load}")
    print("| way | median wall s | fastest wall s | median CPU s |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        walls, cpus = [t[0] for t in ts], [t[1] for t in ts]
        print(f"| {name} | {statistics.median(walls):.4f} | {min(walls):.4f} | {statistics.median(cpus):.4f} |")
    same = all(torch.equal(a, b) for a, b in zip(first.model.parameters(), beside.model.parameters()))
    print(f"weights after {args.repeats + 1} steps each bitwise equal: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
