"""dp=2 x cp=2 policy workers (4 gloo processes) against one worker, run by hand:

    uv run --no-sync python benchmarks/tp/check_cp_workers.py

The real `PolicyWorker` with `policy.dtensor_cfg.context_parallel_size: 2` on 4 ranks (a dp x cp mesh,
full replicas, gradients summed over cp then dp), each dp group given its rows the way `PolicyGroup`
does (`actor_group.shard_steps` over dp, the same rows for a group's cp ranks), against one unsharded
worker on the whole batch: logprobs, train metrics, gradients and updated weights (fp32). Prints the
worst relative difference of each and exits 1 above 1e-5. Four ranks cost minutes on the 2-core box,
which is why the suite runs dp=1 x cp=2 (tests/test_context_parallel.py) and this runs by hand.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

TOL = 1e-5
DP, CP = 2, 2


def cfg(num_workers: int, cp: int):
    from grpo_train.config.schema import DTensorConfig, PolicyConfig

    return PolicyConfig(
        precision="float32",
        train_global_batch_size=4,
        train_micro_batch_size=1,
        logprob_batch_size=2,
        max_grad_norm=1.0,
        num_workers=num_workers,
        generation={"temperature": 0.7},
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5, "momentum": 0.9}},
        dtensor_cfg=DTensorConfig(enabled=False, context_parallel_size=cp),
    )


def make_batch() -> dict:
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([120, 64, 97, 33])
    attention_mask = (torch.arange(120)[None, :] < lengths[:, None]).long()
    token_mask = attention_mask.float().clone()
    token_mask[:, :8] = 0
    return {
        "input_ids": torch.randint(3, 64, (4, 120), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": -torch.rand(4, 120, generator=g) * token_mask,
        "advantages": torch.randn(4, 1, generator=g) * token_mask,
        "sample_mask": torch.ones(4),
    }


def loss_cfg():
    from grpo_train.config.schema import LossConfig

    return LossConfig(reference_policy_kl_penalty=0.05)


def prepared(model_dir: str) -> dict:
    from grpo_train.policy.worker import PolicyWorker

    single = PolicyWorker(model_dir, cfg(1, 1), loss_cfg(), seed=0)
    batch = make_batch()
    batch["prev_logprobs"] = single.logprobs(batch) + 0.02 * batch["token_mask"]
    batch["ref_logprobs"] = single.logprobs(batch, reference=True) - 0.05 * batch["token_mask"]
    return batch


def rank_main(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    from grpo_train.actor_group import shard_steps, take_rows
    from grpo_train.policy.worker import PolicyWorker

    torch.set_num_threads(1)
    batch = prepared(model_dir)
    worker = PolicyWorker(model_dir, cfg(DP * CP, CP), loss_cfg(), seed=0, rank=rank, world_size=DP * CP)
    worker.init_distributed("127.0.0.1", port)
    dp_rank = rank // CP
    rows = slice(2 * dp_rank, 2 * dp_rank + 2)  # PolicyGroup's logprob split over dp (split_rows of 4 over 2)
    out = {"logprobs": worker.logprobs(take_rows(batch, rows))}
    shards, tokens, seqs = shard_steps(batch, 4, DP)
    out["metrics"] = worker.train(shards[dp_rank], tokens, seqs)
    out["gradients"], out["weights"] = worker.gradients(), worker.master_weights()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def main() -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "packages", "grpo-train", "tests"))
    from conftest import build_tiny_model
    from grpo_train.policy.worker import PolicyWorker

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        build_tiny_model(model_dir)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        start = time.time()
        mp.spawn(rank_main, args=(port, model_dir, tmp), nprocs=DP * CP)
        print(f"4 ranks: {time.time() - start:.0f} s wall", flush=True)
        single = PolicyWorker(model_dir, cfg(1, 1), loss_cfg(), seed=0)
        batch = prepared(model_dir)
        want = {"logprobs": single.logprobs(batch), "metrics": single.train(batch)}
        want["gradients"], want["weights"] = single.gradients(), single.master_weights()
        worst: dict[str, float] = {}
        outs = [torch.load(os.path.join(tmp, f"rank{rank}.pt")) for rank in range(DP * CP)]
        # the loss is a sum over the step's tokens: each dp group reports its share, PolicyGroup adds them
        # (combine_metrics over one rank per dp group); the cp ranks of a group report the same share
        loss = sum(outs[d * CP]["metrics"]["loss"] for d in range(DP))
        worst["loss"] = abs(loss - want["metrics"]["loss"]) / abs(want["metrics"]["loss"])
        for rank in range(DP * CP):
            got = outs[rank]
            dp_rank = rank // CP
            worst["cp ranks' loss (abs.) spread"] = max(
                worst.get("cp ranks' loss (abs.) spread", 0.0),
                abs(got["metrics"]["loss"] - outs[dp_rank * CP]["metrics"]["loss"]),
            )
            lp = want["logprobs"][2 * dp_rank : 2 * dp_rank + 2]
            worst["logprobs"] = max(worst.get("logprobs", 0.0), float((got["logprobs"] - lp).norm() / lp.norm()))
            rel = abs(got["metrics"]["grad_norm"] - want["metrics"]["grad_norm"]) / want["metrics"]["grad_norm"]
            worst["grad_norm"] = max(worst.get("grad_norm", 0.0), rel)
            for what in ("gradients", "weights"):
                for name, tensor in want[what].items():
                    rel = float((got[what][name] - tensor).norm() / tensor.norm().clamp_min(1e-12))
                    if float(tensor.norm()) > 1e-9:  # k_proj.bias's gradient is rounding noise (test_fsdp.py)
                        worst[what] = max(worst.get(what, 0.0), rel)
        for key, value in worst.items():
            print(
                f"dp {DP} x cp {CP} vs one worker: worst {key}{'' if 'abs.' in key else ' rel. diff'} {value:.2e}",
                flush=True,
            )
        return 0 if all(v <= TOL for v in worst.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
