"""Vocab-parallel token logprobs on gloo ranks against the unsharded reference on one process.

    uv run --no-sync python benchmarks/kernels/bench_vocab_parallel.py [--tp 2] [--T 2048] [--V 32000] [--repeats 5]

Each of `--tp` processes (one thread each) holds a [T, V / tp] float32 shard and runs
`grpo_kernels.vocab_parallel.vocab_parallel_token_logprobs` forward + backward; the baseline is
`reference.token_logprobs` on the full [T, V] logits in one process (one thread). Reports the
median of `--repeats` timed runs after one warm-up, and the largest logprob difference to the
baseline. CPU/gloo only: this measures the op's arithmetic and its four per-row all-reduces on
a CPU, not NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def make(T: int, V: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(T, V, generator=g) * 3, torch.randint(0, V, (T,), generator=g)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fwd_bwd(op, logits, targets, **kw):
    x = logits.detach().clone().requires_grad_(True)
    out = op(x, targets, temperature=0.7, **kw)
    out.sum().backward()
    return out.detach()


def rank_main(rank: int, tp: int, port: int, T: int, V: int, repeats: int, queue) -> None:
    from grpo_kernels.vocab_parallel import vocab_parallel_token_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    logits, targets = make(T, V)
    shard = logits[:, rank * V // tp : (rank + 1) * V // tp].contiguous()

    def run():
        return fwd_bwd(vocab_parallel_token_logprobs, shard, targets)

    seconds = timed(run, repeats)
    out = run()  # every rank: it is a collective
    if rank == 0:  # plain numbers: the queue outlives the process
        from grpo_kernels import reference

        queue.put((seconds, float((out - fwd_bwd(reference.token_logprobs, logits, targets)).abs().max())))
    dist.destroy_process_group()


def main() -> None:
    from grpo_kernels import reference

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--V", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logits, targets = make(args.T, args.V)
    base_seconds = timed(lambda: fwd_bwd(reference.token_logprobs, logits, targets), args.repeats)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    mp.spawn(rank_main, args=(args.tp, port, args.T, args.V, args.repeats, queue), nprocs=args.tp)
    seconds, max_diff = queue.get()
    print(f"T={args.T} V={args.V} fp32 fwd+bwd, 1 thread per process")
    print(f"unsharded reference, 1 process: {base_seconds * 1e3:.1f} ms")
    print(f"vocab-parallel, tp={args.tp} gloo processes: {seconds * 1e3:.1f} ms (rank 0)")
    print(f"max |logprob difference|: {max_diff:.2e}")


if __name__ == "__main__":
    main()
