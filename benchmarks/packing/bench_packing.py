"""Sequence packing on one CPU core: C++ (grpo_kernels._C) against the pure-Python twins, and
how close each algorithm gets to the lower bound ceil(total / capacity).

    uv run --no-sync python benchmarks/packing/bench_packing.py [--out PATH] [--quick]

Writes benchmarks/results/packing_cpu.md with the machine (CPU model, cores, load), versions
and git commit. The length distributions are the test fixtures of
packages/grpo-kernels/tests/test_packing.py (loaded from that file, so both stay one).
Timings: the C++ kernel call (numpy in, numpy out, input copy included) and the whole
`pack_lengths` (validation + kernel + grouping into Python lists). Best and median of repeats.
The Python twins are O(n * bins) by design; sizes whose predicted time exceeds the budget are
not run, and the table says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from grpo_kernels import _ext, packing

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "packages" / "grpo-kernels" / "tests" / "test_packing.py"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "packing_cpu.md"
SIZES = (10**3, 10**4, 10**5, 10**6)
# The targets of issue 6 for the C++ packers (per call, one core).
TARGETS_MS = {10**4: 2.0, 10**5: 25.0}
PYTHON_BUDGET_S = 60.0  # longest single Python-twin run we are willing to wait for
MIN_REPEATS, MIN_SECONDS = 5, 0.5


def load_distributions() -> dict[str, Callable[[int, int], tuple[np.ndarray, int]]]:
    spec = importlib.util.spec_from_file_location("packing_fixtures", FIXTURES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DISTRIBUTIONS


def pin_to_one_core() -> int:
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return core


def timeit(fn: Callable[[], object], max_repeats: int = 50) -> tuple[float, float]:
    """(best, median) seconds over at least MIN_REPEATS runs or MIN_SECONDS of runs."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < MIN_REPEATS or (time.perf_counter() - start < MIN_SECONDS and len(times) < max_repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def machine() -> dict[str, str]:
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break

    def cmd(*args: str) -> str:
        try:
            return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
        except OSError:
            return "n/a"

    commit = cmd("git", "rev-parse", "HEAD")
    dirty = cmd("git", "status", "--porcelain", "--", "csrc", "packages/grpo-kernels/src", "benchmarks/packing")
    import pybind11

    return {
        "CPU": f"{model}, {os.cpu_count()} logical cores ({platform.machine()})",
        "load average at start (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        "OS": platform.platform(),
        "Python": platform.python_version(),
        "numpy": np.__version__,
        "pybind11": pybind11.__version__,
        "C++ compiler": cmd("c++", "--version").splitlines()[0] if cmd("c++", "--version") else "n/a",
        "extension": f"grpo_kernels._C (Release, CUDA kernels compiled: {_ext.has_cuda_extension()})",
        "git commit": commit + (" (packing sources modified)" if dirty else ""),
    }


def bench_speed(dists, sizes, python_budget: float) -> list[dict]:
    rows = []
    for dist_name, make in dists.items():
        for algorithm, packer in packing.PACKERS.items():
            previous_py: tuple[int, float] | None = None
            for n in sizes:
                lengths, capacity = make(n, 0)
                cpp_best, cpp_median = timeit(lambda: packer.cpp(lengths, capacity))
                full_best, _ = timeit(lambda: packing.pack_lengths(lengths, capacity, algorithm, "cpp"), max_repeats=10)
                row = {
                    "dist": dist_name,
                    "algorithm": algorithm,
                    "n": n,
                    "cpp_best": cpp_best,
                    "cpp_median": cpp_median,
                    "full_best": full_best,
                    "py": None,
                    "py_estimate": None,
                }
                # The twins cost ~ n * bins ~ n^2: predict from the last size that ran.
                estimate = previous_py[1] * (n / previous_py[0]) ** 2 if previous_py else 0.0
                if estimate <= python_budget:
                    as_list = lengths.tolist()
                    t0 = time.perf_counter()
                    packer.python(as_list, capacity)
                    row["py"] = time.perf_counter() - t0
                    previous_py = (n, row["py"])
                else:
                    row["py_estimate"] = estimate
                rows.append(row)
                print(
                    f"{dist_name:14s} {algorithm:13s} n={n:>8d} C++ {cpp_best * 1e3:9.3f} ms  "
                    f"pack_lengths {full_best * 1e3:9.3f} ms  python "
                    + (f"{row['py']:.3f} s" if row["py"] is not None else f"skipped (~{estimate:.0f} s)"),
                    flush=True,
                )
    return rows


def bench_quality(dists, sizes) -> list[dict]:
    rows = []
    for dist_name, make in dists.items():
        for n in sizes:
            lengths, capacity = make(n, 0)
            lower = packing.lower_bound_bins(lengths, capacity)
            total = int(lengths.sum())
            row = {
                "dist": dist_name,
                "n": n,
                "capacity": capacity,
                "lower": lower,
                "large": int((2 * lengths > capacity).sum()),
            }
            for algorithm, packer in packing.PACKERS.items():
                n_bins = int(packer.cpp(lengths, capacity).max()) + 1
                row[algorithm] = (n_bins, total / (n_bins * capacity))
            rows.append(row)
    return rows


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 1 else f"{seconds * 1e3:,.0f}"


def write_markdown(path: Path, info: dict, speed: list[dict], quality: list[dict], core: int) -> None:
    lines = [
        "# Sequence packing on one CPU core",
        "",
        f"Produced by `benchmarks/packing/bench_packing.py` on {time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"process pinned to core {core}.",
        "",
        "## Machine and versions",
        "",
        *[f"- **{k}**: {v}" for k, v in info.items()],
        "",
        "The machine is shared: other jobs ran on it at the same time (see the load average), so "
        "the medians are noisy; the best-of-N column is the fairer figure for the code itself.",
        "",
        "## Time per call",
        "",
        "C++ = the `_C` kernel call (numpy int64 in, bin index per item out, input copy included); "
        "`pack_lengths` = validation + kernel + grouping into `list[list[int]]`; Python = the "
        "pure-Python twin (one run). Targets for C++: 10^4 items <= 2 ms, 10^5 items <= 25 ms.",
        "",
        "| distribution | algorithm | n | C++ best (ms) | C++ median (ms) | target | pack_lengths best (ms) | Python twin (ms) | Python / C++ |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in speed:
        target = TARGETS_MS.get(r["n"])
        verdict = (
            "" if target is None else (f"<= {target:g} ms: {'met' if r['cpp_best'] * 1e3 <= target else 'MISSED'}")
        )
        if r["py"] is not None:
            py, ratio = fmt_ms(r["py"]), f"{r['py'] / r['cpp_best']:,.0f}x"
        else:
            py, ratio = f"not run (est. {r['py_estimate']:,.0f} s)", ""
        lines.append(
            f"| {r['dist']} | {r['algorithm']} | {r['n']:,} | {fmt_ms(r['cpp_best'])} | {fmt_ms(r['cpp_median'])} | "
            f"{verdict} | {fmt_ms(r['full_best'])} | {py} | {ratio} |"
        )
    lines += [
        "",
        "## Bins against the lower bound",
        "",
        "bins (fill fraction = total tokens / (bins x capacity)); lower bound = ceil(total / capacity). "
        "'> C/2' counts items longer than half a bin: each needs a bin of its own, so the lower "
        "bound cannot be reached when they outnumber it.",
        "",
        "| distribution | n | capacity | > C/2 | lower bound | " + " | ".join(packing.PACKERS) + " |",
        "|---|---:|---:|---:|---:|" + "---|" * len(packing.PACKERS),
    ]
    for r in quality:
        cells = [f"{r[a][0]:,} ({r[a][1]:.2%}, +{r[a][0] - r['lower']})" for a in packing.PACKERS]
        lines.append(
            f"| {r['dist']} | {r['n']:,} | {r['capacity']:,} | {r['large']:,} | {r['lower']:,} | "
            + " | ".join(cells)
            + " |"
        )
    lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="sizes up to 10^4 only, and no file unless --out is given")
    parser.add_argument("--python-budget", type=float, default=PYTHON_BUDGET_S, help="seconds per Python-twin run")
    args = parser.parse_args()
    _ext.require_extension()
    core = pin_to_one_core()
    info = machine()
    dists = load_distributions()
    sizes = SIZES[:2] if args.quick else SIZES
    speed = bench_speed(dists, sizes, args.python_budget)
    quality = bench_quality(dists, sizes)
    if args.quick and "--out" not in sys.argv:
        return
    write_markdown(args.out, info, speed, quality, core)


if __name__ == "__main__":
    main()
