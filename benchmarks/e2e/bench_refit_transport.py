"""Weight-push time by transport: object store vs the bucketed collective broadcast.

One policy rank (Ray actor) and one vLLM engine (CPU build) on the given model; each variant
pushes the same weights `--pushes` times and the median seconds per push are reported, with
the number of buckets a collective push sends. The bucket size bounds the extra memory of a
push on both ends (one flattened bucket at a time), at the price of more broadcasts.
Writes a markdown report with the machine it ran on. Usage:
    uv run --no-sync python benchmarks/e2e/bench_refit_transport.py [--model builtin:arith-tiny]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_demo import ROOT, git_commit, machine  # noqa: E402

MIB = 1 << 20
VARIANTS = [
    ("object_store", 1024 * MIB),
    ("collective", 1024 * MIB),
    ("collective", 1 * MIB),
    ("collective", MIB // 16),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="builtin:arith-tiny")
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/refit_transport_cpu.md"))
    args = parser.parse_args()

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # as the grpo CLI: workers use this .venv
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import ray

    from grpo_train.config.schema import ClusterConfig, LossConfig, PolicyConfig
    from grpo_train.generation import make_generation_actor
    from grpo_train.policy.group import PolicyGroup
    from grpo_train.refit import GIB, make_transport, push_weights
    from grpo_train.refit.buckets import plan_buckets
    from grpo_train.setup import actor_env_vars, init_ray, resolve_model_path

    model = resolve_model_path(args.model)
    init_ray(ClusterConfig(num_cpus=4), actor_env_vars())
    cfg = PolicyConfig(precision="float32", train_global_batch_size=1, train_micro_batch_size=1)
    engine = make_generation_actor(
        "vllm", model, num_cpus=1, dtype="float32", max_model_len=64, kv_cache_space_gb=0.125
    )
    policy = PolicyGroup(model, cfg, LossConfig(), ClusterConfig(), seed=0, num_threads=1)
    ray.get(engine.ready.remote())
    metas = policy.weight_metadata()
    total = sum(m.nbytes() for m in metas)
    rows = []
    for name, bucket_bytes in VARIANTS:
        transport = make_transport(name, bucket_bytes / GIB)
        policy.attach(transport, [engine])
        seconds = []
        for version in range(args.pushes):
            start = time.perf_counter()
            push_weights(policy, version)
            seconds.append(time.perf_counter() - start)
        buckets = len(plan_buckets(metas, bucket_bytes)) if name == "collective" else "-"
        rows.append(f"| {name} | {bucket_bytes / MIB:g} | {buckets} | {statistics.median(seconds) * 1000:.1f} |")
    policy.close()
    ray.get(engine.shutdown.remote())

    report = [
        "# Weight push time by transport (CPU)",
        "",
        f"Machine: {machine()}; commit {git_commit()}; model {args.model} ({len(metas)} tensors, "
        f"{total / MIB:.2f} MiB fp32); median of {args.pushes} pushes, one policy rank -> one vLLM engine; "
        f"1-min load average at the end {os.getloadavg()[0]:.1f} (a shared machine inflates the times).",
        "",
        "| transport | bucket (MiB) | buckets per push | push (ms) |",
        "|---|---|---|---|",
        *rows,
        "",
    ]
    Path(args.out).write_text("\n".join(report))
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
