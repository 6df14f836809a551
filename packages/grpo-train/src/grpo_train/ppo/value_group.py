"""Data-parallel value workers that the PPO loop drives like one worker.

Job: place `value.num_workers` `ValueWorker` Ray actors in a placement group of their own (one
bundle per rank, from the cluster: a GPU each on GPU clusters, a CPU each otherwise; the policy's
`worker_bundles` / `place_bundles`), join them in one torch.distributed group (NCCL on GPUs,
gloo on CPU), and split each call's rows across the ranks. The group has the worker's method
names and is called the same way, `group.<method>.remote(...)` giving one ObjectRef, so
`ppo_step` and `ppo_loop` run 1 or N value workers unchanged.

Training splits each optimizer step's rows across the ranks and passes every rank the step's
global valid token and sequence counts; each rank's loss is a partial sum of the global mean and
gradients are summed over ranks, so the step is the single worker's (GRPO-MATH.md). Rank 0
saves the checkpoint (the single worker's format); every rank loads it.

The module-level helpers (`shard_steps`, `combine_rank_metrics`, `sum_gradients`) are generic
over workers and belong beside `actor_group.split_rows` in time; the policy group has inline
twins of them. Boundary: no knowledge of rollouts, advantages or the loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import ray
import torch

from grpo_train.actor_group import remote_method, split_rows
from grpo_train.batch import batch_size
from grpo_train.config.schema import ClusterConfig, ValueConfig, ValueLossConfig
from grpo_train.policy.group import place_bundles, take_rows, worker_bundles

# Metrics that are the same on every rank (after the gradient all-reduce); the rest are partial
# sums of global means and add up over ranks.
SHARED_METRICS = ("value_grad_norm", "value_lr")


def shard_steps(batch: dict[str, torch.Tensor], per_step: int,
                world_size: int) -> tuple[list[dict[str, torch.Tensor]], list[float], list[float]]:
    """Each optimizer step's rows (`per_step` of them) split across the ranks, in step order:
    (one batch per rank, global valid tokens per step, global valid sequences per step)."""
    n = batch_size(batch)
    steps = [slice(k * per_step, min((k + 1) * per_step, n)) for k in range(max(1, n // per_step))]
    tokens, seqs = [], []
    shards: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(world_size)]
    for step in steps:
        step_batch = take_rows(batch, step)
        tokens.append(float((step_batch["token_mask"] * step_batch["sample_mask"].unsqueeze(1)).sum()))
        seqs.append(float(step_batch["sample_mask"].sum()))
        for rank, rows in enumerate(split_rows(batch_size(step_batch), world_size)):
            shards[rank].append(take_rows(step_batch, rows))
    return [{k: torch.cat([s[k] for s in shard]) for k in batch} for shard in shards], tokens, seqs


def combine_rank_metrics(per_rank: list[dict[str, float]], shared: Iterable[str]) -> dict[str, float]:
    """Partial sums add up over ranks; `shared` metrics are rank 0's (the same on every rank)."""
    shared = set(shared)
    keys = dict.fromkeys(k for m in per_rank for k in m)
    return {k: per_rank[0][k] if k in shared else math.fsum(m.get(k, 0.0) for m in per_rank) for k in keys}


def sum_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """All-reduce SUM of the gradients over the default process group, as one flat buffer (a
    rank that ran no micro-batch contributes zeros)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    params = [p for p in parameters if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for param, grad in zip(params, _unflatten_dense_tensors(flat, grads)):
        param.grad = grad


def place_value_bundles(cluster: ClusterConfig, num_workers: int):
    """The value ranks' ready placement group; a StartupError names value.num_workers."""
    from grpo_train.setup import StartupError

    bundles, strategy = worker_bundles(cluster, num_workers)
    try:
        return place_bundles(bundles, strategy)
    except StartupError as exc:
        raise StartupError(f"value.num_workers={num_workers}: the value ranks do not fit beside the policy and "
                           f"generation ({exc})") from None


class ValueGroup:
    """N data-parallel `ValueWorker` actors behind the worker's method names."""

    def __init__(self, model_path: str, cfg: ValueConfig, loss_cfg: ValueLossConfig, cluster: ClusterConfig,
                 global_batch_size: int, seed: int, num_threads: int = 1, start: bool = True) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from grpo_train.ppo.value_worker import ValueWorker

        self.world_size = cfg.num_workers
        self.global_batch_size = global_batch_size
        self.placement_group = place_value_bundles(cluster, self.world_size)
        on_gpus = cluster.gpus_per_node > 0
        actor = ray.remote(ValueWorker)
        self.workers = [
            actor.options(num_cpus=1, num_gpus=1 if on_gpus else 0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank)).remote(
                model_path, cfg, loss_cfg, global_batch_size, seed, rank=rank, world_size=self.world_size,
                num_threads=num_threads, device="cuda" if on_gpus else "cpu")
            for rank in range(self.world_size)
        ]
        self._started = False
        if start:
            self.start()

    def start(self) -> None:
        """Wait for the ranks to load and join their process group (construction returns while
        they load, so the policy and generator can start meanwhile)."""
        if not self._started:
            host, port = ray.get(self.workers[0].free_address.remote())
            ray.get([w.init_distributed.remote(host, port) for w in self.workers])
            self._started = True

    @property
    def rank0(self):
        return self.workers[0]

    @remote_method
    def values(self, batch: dict[str, torch.Tensor]):
        rows = split_rows(batch_size(batch), self.world_size)
        parts = [w.values.remote(take_rows(batch, r)) for w, r in zip(self.workers, rows)]
        return ray.put(torch.cat(ray.get(parts)))  # [B, S]

    @remote_method
    def train(self, batch: dict[str, torch.Tensor]):
        """Each optimizer step's rows (global_batch_size of them) split across the ranks."""
        shards, tokens, seqs = shard_steps(batch, self.global_batch_size, self.world_size)
        calls = [w.train.remote(shard, tokens, seqs) for w, shard in zip(self.workers, shards)]
        return ray.put(combine_rank_metrics(ray.get(calls), SHARED_METRICS))

    @remote_method
    def save(self, folder: str):
        return self.rank0.save.remote(folder)

    @remote_method
    def load(self, folder: str):
        ray.get([w.load.remote(folder) for w in self.workers])
        return ray.put(None)

    @remote_method
    def weights(self):
        return self.rank0.weights.remote()

    @remote_method
    def gradients(self):
        return self.rank0.gradients.remote()

    @remote_method
    def ping(self):
        ray.get([w.ping.remote() for w in self.workers])
        return self.rank0.ping.remote()

    @remote_method
    def whereabouts(self):
        return ray.put(ray.get([w.whereabouts.remote() for w in self.workers]))

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        ray.util.remove_placement_group(self.placement_group)
