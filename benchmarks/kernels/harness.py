"""Measuring kernels: median time, peak extra memory, kernel launches, the machine's ceilings,
and writing results with the hardware, versions and git commit. Used by bench_logprobs.py and
bench_pg_loss.py (one process per script, so every implementation sees the same machine state).

On a GPU: CUDA-event timing, `torch.cuda.max_memory_allocated` above the live baseline, CUDA
kernels counted by the profiler. On CPU: wall-clock timing, and peak extra memory from the
profiler's allocation events (the same measurement the tests use); "launches" are then the
aten ops dispatched.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timings(
    fn: Callable[[], object], device: torch.device, warmup: int = 2, repeats: int = 10, min_seconds: float = 0.2
) -> dict[str, float]:
    """Median wall time (CUDA events on a GPU) over `repeats` runs, more while under
    min_seconds, after warm-up runs. On CPU also the median process CPU time, which a busy
    shared machine disturbs less than the wall clock."""
    for _ in range(warmup):
        fn()
    sync(device)
    wall: list[float] = []
    cpu: list[float] = []
    start = time.perf_counter()
    while len(wall) < repeats or (time.perf_counter() - start < min_seconds and len(wall) < 10 * repeats):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            wall.append(begin.elapsed_time(end))
        else:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    out = {"ms": statistics.median(wall)}
    if cpu:
        out["cpu_ms"] = statistics.median(cpu)
    return out


def median_ms(fn: Callable[[], object], device: torch.device, **kwargs) -> float:
    return timings(fn, device, **kwargs)["ms"]


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated during fn beyond what was live before it."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def launches(fn: Callable[[], object], device: torch.device) -> int:
    """CUDA kernels (GPU) or aten ops (CPU) run by one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    if device.type == "cuda":
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    # aten ops not called by another aten op (backward ops hang under autograd::engine nodes)
    return sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )


def ceilings(device: torch.device) -> dict[str, float]:
    """Measured copy bandwidth (GB/s, read + write) and bf16 GEMM rate (TFLOP/s)."""
    if device.type == "cuda":
        n_bytes, gemm = 2 * 2**30, 8192
    else:
        n_bytes, gemm = 256 * 2**20, 1024
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_ms = median_ms(functools.partial(dst.copy_, src), device, repeats=5)  # binds src/dst before the del
    del src, dst
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(gemm, gemm, dtype=dtype, device=device)
    b = torch.randn(gemm, gemm, dtype=dtype, device=device)
    gemm_ms = median_ms(lambda: a @ b, device, repeats=5)
    return {
        "copy_GBps": 2 * n_bytes / copy_ms / 1e6,
        "gemm_TFLOPs": 2 * gemm**3 / gemm_ms / 1e9,
        "gemm_dtype": str(dtype).replace("torch.", ""),
    }


def _cmd(*args: str) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
    except OSError:
        return "n/a"


def machine(device: torch.device) -> dict[str, str]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu}",
        "CPU": f"{cpu}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}",
        "load average at start (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        "Python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "git commit": _cmd("git", "rev-parse", "HEAD")
        + (
            " (kernel sources modified)"
            if _cmd("git", "status", "--porcelain", "--", "packages/grpo-kernels/src")
            else ""
        ),
    }
    if device.type == "cuda":
        info["driver"] = _cmd("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        info["CUDA (torch)"] = str(torch.version.cuda)
    return info


def compile_or_none(fn: Callable, **kwargs):
    """torch.compile(fn), or None with the reason when compiling fails on this machine."""
    try:
        compiled = torch.compile(fn, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure means "not available here"
        return None, f"{type(err).__name__}: {err}"
    return compiled, None


def write_results(
    stem: str, title: str, info: dict, ceiling: dict, rows: list[dict], columns: list[str], notes: list[str]
) -> Path:
    """Write benchmarks/results/<stem>.md (table) and <stem>.json (everything)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", "", f"Produced on {time.strftime('%Y-%m-%d %H:%M %Z')}.", "", "## Machine and versions", ""]
    lines += [f"- **{k}**: {v}" for k, v in info.items()]
    lines += [
        f"- **measured ceilings**: copy {ceiling['copy_GBps']:.1f} GB/s, "
        f"{ceiling['gemm_dtype']} GEMM {ceiling['gemm_TFLOPs']:.2f} TFLOP/s",
        "",
    ]
    lines += notes + ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    lines.append("")
    md = RESULTS / f"{stem}.md"
    md.write_text("\n".join(lines))
    (RESULTS / f"{stem}.json").write_text(json.dumps({"machine": info, "ceilings": ceiling, "rows": rows}, indent=1))
    return md


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return " ".join(str(value).split()).replace("|", "/")
