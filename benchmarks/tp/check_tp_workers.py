"""Policy workers under TP on 4 ranks (dp=2 x tp=2) and bf16 TP=2 against one worker: a check too heavy
for the test suite on the project's 2-core machine, run by hand.

    RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 uv run --no-sync python benchmarks/tp/check_tp_workers.py [case ...]

Cases: fsdp (dp=2 x tp=2, FSDP2 over the dp sub-mesh), allreduce (dp=2 x tp=2, gradients summed over the
dp group), bf16 (dp=2 x tp=2, FSDP2, policy.precision=bfloat16: FSDP2's mixed precision; TP with bf16 and
no FSDP2 is refused at startup). Each: the real
PolicyGroup (Ray actors, gloo mesh) loads one in-process worker's checkpoint, then both score and take one
optimizer step on the same batch; prints the largest relative differences (logprobs, metrics, gradients,
updated weights); exits 1 above the tolerance (1e-5 fp32; bf16: equal logprobs within 2e-2 abs, gradients
and weights within 2e-2 relative, as bf16 TP sums in another order).
"""

from __future__ import annotations

import sys
import tempfile
import time

import ray
import torch

sys.path.insert(0, "packages/grpo-train/tests")
from conftest import build_tiny_model  # noqa: E402
from grpo_train.config.schema import ClusterConfig, DTensorConfig, PolicyConfig  # noqa: E402
from grpo_train.policy.group import PolicyGroup  # noqa: E402
from grpo_train.policy.worker import PolicyWorker  # noqa: E402
from test_tp_workers import LOSS, make_batch  # noqa: E402

CASES = {"fsdp": (4, True, "float32"), "allreduce": (4, None, "float32"), "bf16": (4, True, "bfloat16")}


def cfg(num_workers: int, tp: int, enabled, precision: str) -> PolicyConfig:
    return PolicyConfig(
        precision=precision,
        train_global_batch_size=8,
        train_micro_batch_size=2,
        logprob_batch_size=2,
        max_grad_norm=1.0,
        num_workers=num_workers,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5, "momentum": 0.9}},
        dtensor_cfg=DTensorConfig(enabled=enabled, tensor_parallel_size=tp),
        generation={"temperature": 0.7},
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


def run(case: str, model_dir: str, folder: str) -> float:
    workers, enabled, precision = CASES[case]
    torch.set_num_threads(1)
    single = PolicyWorker(model_dir, cfg(1, 1, enabled, precision), LOSS, seed=0)
    group = PolicyGroup(model_dir, cfg(workers, 2, enabled, precision), LOSS, ClusterConfig(), seed=0, num_threads=1)
    try:
        single.save(f"{folder}/{case}")
        group.load(f"{folder}/{case}")
        batch = make_batch(8, seed=0)
        lp1, lp2 = single.logprobs_and_reference(batch), group.logprobs_and_reference(batch)
        errors = {"logprobs (max abs)": float((lp1 - lp2).abs().max())}
        m1 = single.train({**batch, "prev_logprobs": lp1[0], "ref_logprobs": lp1[1]})
        m2 = group.train({**batch, "prev_logprobs": lp2[0], "ref_logprobs": lp2[1]})
        errors.update({f"metric {k}": abs(m2[k] - m1[k]) / max(abs(m1[k]), 1e-6) for k in ("loss", "grad_norm")})
        g1, g2 = single.gradients(), group.gradients()
        errors["gradients (worst)"] = max(rel(g2[k], g1[k]) for k in g1 if float(g1[k].norm()) > 1e-6)
        w1, w2 = single.weights(), group.weights()
        errors["weights (worst)"] = max(rel(w2[k], w1[k]) for k in w1)
    finally:
        group.close()
    worst = max(errors.values())
    print(
        f"{case}: {workers} ranks, tp 2, dtensor_cfg.enabled={enabled}, {precision}: "
        + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()),
        flush=True,
    )
    return worst


def main() -> int:
    cases = sys.argv[1:] or list(CASES)
    from grpo_train.setup import start_local_head

    start_local_head(
        lambda: ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False),
        ray.shutdown,
    )
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(f"{tmp}/model")
        for case in cases:
            start = time.perf_counter()
            worst = run(case, f"{tmp}/model", tmp)
            ok &= worst <= (2e-2 if CASES[case][2] != "float32" else 1e-5)
            print(f"  {time.perf_counter() - start:.0f} s wall", flush=True)
    ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
