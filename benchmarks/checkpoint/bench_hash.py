"""Which content hash the checkpoint manifest uses: sha256 vs blake2b on a demo-sized checkpoint.

Writes a checkpoint the way the demo run does (the bundled arith-tiny policy after one AdamW
step, through PolicyWorker.save and CheckpointManager.save), then times hashing every file of it
with each algorithm (best of REPEATS, files in the page cache, as right after a save), plus one
larger synthetic file for throughput. Usage: uv run --no-sync python benchmarks/checkpoint/bench_hash.py
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

import torch

from grpo_train.assets import builtin_model_path
from grpo_train.checkpoint import CheckpointManager
from grpo_train.config.schema import LossConfig, PolicyConfig
from grpo_train.policy.worker import PolicyWorker
from grpo_train.state_io import file_hash, verify_manifest

ALGORITHMS = ("sha256", "blake2b")
REPEATS = 5
BIG_MB = 512


def demo_checkpoint(root: Path) -> Path:
    cfg = PolicyConfig(
        precision="float32",
        train_global_batch_size=4,
        train_micro_batch_size=4,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}},
    )
    worker = PolicyWorker(
        str(builtin_model_path("arith-tiny")), cfg, LossConfig(reference_policy_kl_penalty=0.0), seed=0
    )
    ids = torch.randint(3, 16, (4, 16))
    mask = torch.ones(4, 16)
    batch = {
        "input_ids": ids,
        "attention_mask": mask.long(),
        "token_mask": mask,
        "gen_logprobs": -mask,
        "advantages": mask,
        "sample_mask": torch.ones(4),
    }
    batch["prev_logprobs"] = worker.logprobs(batch)
    worker.train(batch)
    return CheckpointManager(root).save(1, lambda folder: worker.save(str(folder / "policy")), {"step": 1})


def best_time(fn) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = demo_checkpoint(Path(tmp))
        files = [p for p in folder.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        print(f"demo checkpoint: {len(files)} files, {size / 2**20:.2f} MiB")
        for algorithm in ALGORITHMS:
            seconds = best_time(lambda: [file_hash(p, algorithm) for p in files])
            print(f"  {algorithm:8s} {seconds * 1e3:7.2f} ms  ({size / 2**20 / seconds:7.0f} MiB/s)")
        print(f"  verify_manifest (sha256, all files) {best_time(lambda: verify_manifest(folder)) * 1e3:.2f} ms")
        big = Path(tmp) / "big.bin"
        big.write_bytes(os.urandom(BIG_MB * 2**20))
        print(f"synthetic {BIG_MB} MiB file:")
        for algorithm in ALGORITHMS:
            seconds = best_time(lambda: file_hash(big, algorithm))
            print(f"  {algorithm:8s} {seconds:6.3f} s  ({BIG_MB / seconds:7.0f} MiB/s)")
    print("hashlib:", hashlib.sha256().name, "openssl", __import__("ssl").OPENSSL_VERSION)


if __name__ == "__main__":
    main()
