"""Data-parallel value workers that the PPO loop drives like one worker.

Job: place `value.num_workers` `ValueWorker` Ray actors in a placement group of their own (one
bundle per rank, from the cluster: a GPU each on GPU clusters, a CPU each otherwise; the policy's
`worker_bundles` / `place_bundles`), join them in one torch.distributed group (NCCL on GPUs,
gloo on CPU), and split each call's rows across the ranks. The group is a plain driver object
with the worker's method names: each method fans out to the ranks, waits, and returns the
combined value, so `ppo_step` and `ppo_loop` run 1 or N value workers unchanged.

Training splits each optimizer step's rows across the ranks and passes every rank the step's
global valid token and sequence counts; each rank's loss is a partial sum of the global mean and
gradients are summed over ranks, so the step is the single worker's (GRPO-MATH.md). Rank 0
saves the checkpoint (the single worker's format); every rank loads it.

The row sharding, metric merging and gradient sum are `actor_group`'s, shared with the policy
group. Boundary: no knowledge of rollouts, advantages or the loop.
"""

from __future__ import annotations

import ray
import torch

from grpo_train.actor_group import RankGroup, combine_rank_metrics, shard_steps, split_rows, take_rows
from grpo_train.batch import batch_size
from grpo_train.config.schema import ClusterConfig, ValueConfig, ValueLossConfig
from grpo_train.errors import StartupError
from grpo_train.placement import actor_class
from grpo_train.policy.group import place_bundles, worker_bundles

# Metrics that are the same on every rank (after the gradient all-reduce); the rest are partial
# sums of global means and add up over ranks.
SHARED_METRICS = ("value_grad_norm", "value_lr")


def place_value_bundles(cluster: ClusterConfig, num_workers: int):
    """The value ranks' ready placement group; a StartupError names value.num_workers."""
    bundles, strategy = worker_bundles(cluster, num_workers)
    try:
        return place_bundles(bundles, strategy)
    except StartupError as exc:
        raise StartupError(
            f"value.num_workers={num_workers}: the value ranks do not fit beside the policy and generation ({exc})"
        ) from None


class ValueGroup(RankGroup):
    """N data-parallel `ValueWorker` actors behind the worker's method names."""

    def __init__(
        self,
        model_path: str,
        cfg: ValueConfig,
        loss_cfg: ValueLossConfig,
        cluster: ClusterConfig,
        global_batch_size: int,
        seed: int,
        num_threads: int = 1,
        start: bool = True,
    ) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # the worker module (torch, transformers) loads when the group starts its actors
        from grpo_train.ppo.value_worker import ValueWorker

        self.world_size = cfg.num_workers
        self.global_batch_size = global_batch_size
        self.placement_group = place_value_bundles(cluster, self.world_size)
        on_gpus = cluster.gpus_per_node > 0
        actor = actor_class(ValueWorker)
        self.workers = [
            actor.options(
                num_cpus=1,
                num_gpus=1 if on_gpus else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(
                model_path,
                cfg,
                loss_cfg,
                global_batch_size,
                seed,
                rank=rank,
                world_size=self.world_size,
                num_threads=num_threads,
                device="cuda" if on_gpus else "cpu",
            )
            for rank in range(self.world_size)
        ]
        self._started = False
        if start:
            self.start()

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = split_rows(batch_size(batch), self.world_size)
        parts = [w.values.remote(take_rows(batch, r)) for w, r in zip(self.workers, rows)]
        return torch.cat(ray.get(parts))  # [B, S]

    def train(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Each optimizer step's rows (global_batch_size of them) split across the ranks."""
        shards, tokens, seqs = shard_steps(batch, self.global_batch_size, self.world_size)
        calls = [w.train.remote(shard, tokens, seqs) for w, shard in zip(self.workers, shards)]
        return combine_rank_metrics(ray.get(calls), SHARED_METRICS)

    def save(self, folder: str) -> None:
        ray.get(self.rank0.save.remote(folder))

    def load(self, folder: str) -> None:
        ray.get([w.load.remote(folder) for w in self.workers])

    def weights(self) -> dict[str, torch.Tensor]:
        return ray.get(self.rank0.weights.remote())

    def gradients(self) -> dict[str, torch.Tensor]:
        return ray.get(self.rank0.gradients.remote())
