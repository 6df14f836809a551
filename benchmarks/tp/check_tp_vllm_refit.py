"""Refit from a tensor-parallel trainer (policy.dtensor_cfg.tensor_parallel_size=2: two Ray actors on a gloo
mesh) into a tensor-parallel vLLM engine (policy.generation.vllm_cfg.tensor_parallel_size=2: the CPU build's
two worker processes): too heavy for the test suite on the project's 2-core machine (the engine alone took
minutes to start under load), run by hand.

    RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 uv run --no-sync python benchmarks/tp/check_tp_vllm_refit.py

The trainer takes one optimizer step (every weight moves), then pushes over each CPU transport in turn:
object_store (rank 0's gathered state dict, sent to the engine's workers as safetensors bytes) and
collective (rank 0 broadcasts buckets to both vLLM workers, ranks 1 and 2 of a 3-rank gloo group; each
worker loads its own shard of every tensor). Before each push the engine is reset to the starting weights,
and its scores must then disagree with the trainer's (so the push is what makes them agree). After the
push the engine's logprobs on probe sequences must pass the fp32 refit gate against the TP trainer's own
scores. Prints the gate statistics and wall times; exits 1 on a failure.
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
from grpo_train.refit import push_weights  # noqa: E402
from grpo_train.refit.check import DEFAULT_LIMITS, gate_refit, refit_stats  # noqa: E402
from grpo_train.refit.collective import CollectiveTransport  # noqa: E402
from grpo_train.refit.object_store import ObjectStoreTransport  # noqa: E402
from test_refit import InProcess  # noqa: E402
from test_tp_workers import LOSS, make_batch  # noqa: E402

TEMPERATURE = 0.7
BUCKET_BYTES = 64 * 1024


def main() -> int:
    from grpo_train.generation import VllmGenerator
    from grpo_train.setup import start_local_head

    torch.set_num_threads(1)
    start_local_head(
        lambda: ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False),
        ray.shutdown,
    )
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        model = f"{tmp}/model"
        build_tiny_model(model)
        cfg = PolicyConfig(
            precision="float32",
            train_global_batch_size=6,
            train_micro_batch_size=3,
            logprob_batch_size=3,
            max_grad_norm=1.0,
            num_workers=2,
            optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5, "momentum": 0.9}},
            dtensor_cfg=DTensorConfig(tensor_parallel_size=2),
            generation={"temperature": TEMPERATURE},
        )
        start = time.perf_counter()
        group = PolicyGroup(model, cfg, LOSS, ClusterConfig(), seed=0, num_threads=1)
        start_weights = group.weights()
        batch = make_batch(6, seed=0)
        lp = group.logprobs_and_reference(batch)
        group.train({**batch, "prev_logprobs": lp[0], "ref_logprobs": lp[1]})
        print(f"TP=2 trainer up and one step taken: {time.perf_counter() - start:.0f} s", flush=True)
        start = time.perf_counter()
        engine = VllmGenerator(
            model,
            tensor_parallel_size=2,
            max_model_len=256,
            kv_cache_space_gb=0.25,
            temperature_for_logprobs=TEMPERATURE,
        )
        print(f"TP=2 vLLM engine up: {time.perf_counter() - start:.0f} s", flush=True)
        try:
            seqs = [[3 + (7 * i + 5 * j) % 60 for i in range(40 + 9 * j)] for j in range(4)]
            plens = [len(s) - 12 for s in seqs]
            trainer = group.score(seqs, plens)
            local = InProcess(engine)
            for version, transport in enumerate(
                (ObjectStoreTransport(BUCKET_BYTES), CollectiveTransport(BUCKET_BYTES)), start=1
            ):
                engine.update_weights(start_weights, 10 * version)
                stale = refit_stats(trainer, engine.score(seqs, plens))
                ok &= stale.max_abs_diff > 0.05
                group.transport, group.generators = transport, [local]
                transport.connect(group, [local])
                start = time.perf_counter()
                push_weights(group, version)
                seconds = time.perf_counter() - start
                try:
                    stats = gate_refit(trainer, engine.score(seqs, plens), DEFAULT_LIMITS["float32"])
                    print(
                        f"{transport.name}: before the push max |dlogprob| {stale.max_abs_diff:.3f}; after: "
                        f"{stats.tokens} tokens, max {stats.max_abs_diff:.2e}, mean {stats.mean_abs_diff:.2e} "
                        f"(push {seconds:.1f} s)",
                        flush=True,
                    )
                except Exception as err:  # report it and go on to the next transport
                    ok = False
                    print(f"{transport.name}: FAILED {err}", flush=True)
        finally:
            engine.shutdown()
            group.close()
    ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
