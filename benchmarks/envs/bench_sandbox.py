"""Code sandbox throughput: executions/s of the code env in-process (no Ray), one sandboxed
process per test run, at 1 and 2 runs in flight (``max_parallel``).

    uv run --no-sync python benchmarks/envs/bench_sandbox.py [--label after]

The workload is bench_envs.py's code batch (32 responses x 4 stdin/stdout tests). To measure an
older sandbox, put its grpo-envs sources first on PYTHONPATH. Prints one markdown table row per
configuration, with the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import grpo_envs

CODE_SOLUTION = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CODE_TESTS = {"tests": [{"input": f"{i} {i + 1}\n", "output": f"{2 * i + 1}\n"} for i in range(4)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": CODE_SOLUTION}]] * args.batch
    infos = [CODE_TESTS] * args.batch
    units = args.batch * len(CODE_TESTS["tests"])
    for parallel in (1, 2):
        load_before = os.getloadavg()[0]
        env = grpo_envs.make("code", max_parallel=parallel)
        env.step(logs[:2], infos[:2])  # warm-up
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = env.step(logs, infos)
            rates.append(units / (time.perf_counter() - t0))
        assert out.metrics["pass_rate"] == 1.0, out.metadata[0]
        print(
            f"| {args.label} | {parallel} | {statistics.median(rates):.1f} | {min(rates):.1f} | {max(rates):.1f} "
            f"| {load_before:.1f} → {os.getloadavg()[0]:.1f} | {out.metadata[0].get('isolation')} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
