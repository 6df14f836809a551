"""Throughput of the environments through EnvPool: math verifications/s, code executions/s.

    uv run --no-sync python benchmarks/envs/bench_envs.py [--out benchmarks/results/envs_cpu.md]

Each configuration scores a warm-up batch first (worker start, math-verify import), then
times `--repeats` batches. Code executions count test-case runs (one sandboxed process each).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

MATH_RESPONSES = [
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("So we get \\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("Answer: 42", "42"),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2"),
    ("\\boxed{\\{1, 2, 3\\}}", "\\{3, 2, 1\\}"),
    ("\\boxed{(0, 1]}", "(0,1]"),
    ("\\boxed{7}", "8"),
    ("I am not sure.", "3"),
]
CODE_SOLUTION = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CODE_TESTS = {"tests": [{"input": f"{i} {i + 1}\n", "output": f"{2 * i + 1}\n"} for i in range(4)]}


def _logs(responses):
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": r}] for r in responses]


def math_batch(n):
    picks = [MATH_RESPONSES[i % len(MATH_RESPONSES)] for i in range(n)]
    return _logs([r for r, _ in picks]), [{"ground_truth": g} for _, g in picks]


def code_batch(n):
    return _logs([CODE_SOLUTION] * n), [CODE_TESTS] * n


def measure(pool, batch, units_per_batch, repeats):
    pool.step(*batch)  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = pool.step(*batch)
        rates.append(units_per_batch / (time.perf_counter() - t0))
    return statistics.median(rates), min(rates), max(rates), out


def machine_info():
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?"
    )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "packages/grpo-envs", "benchmarks/envs"], capture_output=True, text=True
    ).stdout.strip()
    import ray

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "load": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
        "commit": commit + (" (+ uncommitted grpo-envs changes)" if dirty else ""),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "root": os.geteuid() == 0,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--math-batch", type=int, default=256)
    parser.add_argument("--code-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import ray

    from grpo_envs.pool import EnvPool

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    info = machine_info()
    rows = []
    mb = math_batch(args.math_batch)
    cb = code_batch(args.code_batch)
    code_units = args.code_batch * len(CODE_TESTS["tests"])
    for label, kwargs in [("in-process", {"in_process": True})] + [
        (f"{w} Ray worker(s)", {"num_workers": w}) for w in args.workers
    ]:
        with EnvPool("math", {"timeout_s": 5.0}, **{"num_workers": 1, **kwargs}) as pool:
            med, lo, hi, out = measure(pool, mb, args.math_batch, args.repeats)
            rows.append(("math", label, "verifications/s", med, lo, hi, out.metrics.get("accuracy")))
        with EnvPool("code", {}, **{"num_workers": 1, **kwargs}) as pool:
            med, lo, hi, out = measure(pool, cb, code_units, args.repeats)
            rows.append(("code", label, "executions/s", med, lo, hi, out.metrics.get("pass_rate")))
        print(rows[-2], rows[-1], flush=True)
    info["load_after"] = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    ray.shutdown()

    lines = [
        "# grpo-envs throughput (CPU)",
        "",
        f"- CPU: {info['cpu']}, {info['cores']} cores; load average (1/5/15 min) {info['load']} at start, "
        f"{info['load_after']} at the end (the machine is shared with other work)",
        f"- commit {info['commit']}; Python {info['python']}; Ray {info['ray']}; running as root: {info['root']} "
        "(sandbox with fresh uid, network and mount namespaces, audit hook)",
        "- no GPU used",
        f"- math: batches of {args.math_batch} responses (8 kinds: fractions, radicals, polynomials, sets, "
        "intervals, wrong and missing answers), timeout 5 s",
        f"- code: batches of {args.code_batch} responses x {len(CODE_TESTS['tests'])} stdin/stdout tests; "
        "one sandboxed process per test run",
        f"- median (min-max) of {args.repeats} timed batches after one warm-up batch",
        "- reproduce: `uv run --no-sync python benchmarks/envs/bench_envs.py --out benchmarks/results/envs_cpu.md`",
        "",
        "| env | pool | rate | median | min | max | accuracy / pass rate |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for env, label, unit, med, lo, hi, acc in rows:
        lines.append(f"| {env} | {label} | {unit} | {med:.1f} | {lo:.1f} | {hi:.1f} | {acc:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
