"""Data-parallel policy workers that the loops drive like one worker.

Job: place N `PolicyWorker` Ray actors with a placement group (one bundle per rank: `{"CPU": 1}`
on CPU machines, `{"GPU": 1, "CPU": 1}` on GPUs), join them in one torch.distributed group
(NCCL on GPUs, gloo on CPU; FSDP2-sharded as `policy.dtensor_cfg.enabled` says, on GPUs by
default), and split each call's rows across the ranks (a rank may get none: it still takes part
in every collective). The group is a plain driver object with the worker's method names: each
method fans out to the ranks, waits, and returns the combined value (rows concatenated, metrics
reduced as the loss defines them), so `sync_loop` and `train_step` run 1 or N workers unchanged.
The calls a weight transport must overlap with the engines' side are `submit_*`: they return the
ranks' ObjectRefs without waiting (`submit_weights` gives rank 0's weights by reference).
Training splits each optimizer step's rows across ranks and passes every rank the step's
global valid token and sequence counts, so the summed gradient is the single-worker gradient.

Colocated generation on GPUs (`colocated_generation`): each rank takes half its GPU; who holds the
GPU when (engines asleep, trainer state offloaded) is `grpo_train.colocation`'s order, which calls
this group's `offload` / `reload`.
Boundary: no knowledge of rollouts or of the loop; weight pushes go through a transport
(`grpo_train.refit`).
"""

from __future__ import annotations

import ray
import torch

from grpo_train.actor_group import RankGroup, combine_rank_metrics, shard_steps, split_rows, take_rows
from grpo_train.batch import batch_size
from grpo_train.config.schema import ClusterConfig, LossConfig, PolicyConfig
from grpo_train.errors import StartupError
from grpo_train.placement import actor_class

# Metrics of clipped_pg_loss that are min/max over ranks; rank-independent ones come from rank 0.
_MIN_METRICS = ("ratio_min", "clipped_ratio_min")
_MAX_METRICS = ("ratio_max", "clipped_ratio_max", "max_seq_mult_prob_error")
_SHARED_METRICS = ("grad_norm", "lr")
PLACEMENT_TIMEOUT_S = 120


def worker_bundles(cluster: ClusterConfig, num_workers: int) -> tuple[list[dict[str, float]], str]:
    """One bundle per rank and the placement strategy: GPUs pack node by node (NCCL ranks of a
    node stay together); CPU ranks spread over the configured nodes."""
    if cluster.gpus_per_node > 0:
        return [{"GPU": 1, "CPU": 1}] * num_workers, "PACK"
    if cluster.num_nodes == 1:
        return [{"CPU": 1}] * num_workers, "PACK"
    return [{"CPU": 1}] * num_workers, "STRICT_SPREAD" if num_workers <= cluster.num_nodes else "SPREAD"


def place_bundles(bundles: list[dict[str, float]], strategy: str):
    """A ready placement group, or a StartupError-worthy message naming the config keys."""
    from ray.util.placement_group import placement_group

    pg = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise StartupError(
            f"policy.num_workers / cluster: {len(bundles)} bundles of {bundles[0]} ({strategy}) do not fit the Ray "
            f"cluster within {PLACEMENT_TIMEOUT_S} s; it has {ray.cluster_resources()}"
        )
    return pg


def combine_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' train metrics as one worker's: loss-like partial sums add up, ratio min/max
    reduce, grad norm and lr are shared (a rank given no rows reports only loss, grad_norm, lr)."""
    return combine_rank_metrics(per_rank, _SHARED_METRICS, _MIN_METRICS, _MAX_METRICS)


class PolicyGroup(RankGroup):
    """N data-parallel `PolicyWorker` actors behind the worker's method names."""

    def __init__(
        self,
        model_path: str,
        policy_cfg: PolicyConfig,
        loss_cfg: LossConfig,
        cluster: ClusterConfig,
        seed: int,
        num_threads: int = 1,
        colocated_generation: bool = False,
        start: bool = True,
    ) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # the worker module (torch, transformers) loads when the group starts its actors
        from grpo_train.policy.worker import PolicyWorker

        self.cfg = policy_cfg
        self.world_size = policy_cfg.num_workers
        # Tensor parallelism: ranks dp_rank * tp + tp_rank; a dp group's tp ranks take the same rows and
        # report the same results, of which its first rank's are kept. Context parallelism (never with TP)
        # groups its cp ranks the same way: `tp` below counts a dp group's ranks, tp x cp.
        self.tp = policy_cfg.dtensor_cfg.tensor_parallel_size * policy_cfg.dtensor_cfg.context_parallel_size
        self.dp = self.world_size // self.tp
        bundles, strategy = worker_bundles(cluster, self.world_size)
        self.placement_group = place_bundles(bundles, strategy)
        # Colocated engines share the rank's GPU, so the worker takes half of it.
        self.on_gpus = cluster.gpus_per_node > 0
        self.colocated_generation = colocated_generation and self.on_gpus
        gpus = (0.5 if self.colocated_generation else 1.0) if self.on_gpus else 0
        actor = actor_class(PolicyWorker)
        self.workers = [
            actor.options(
                num_cpus=1,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(
                model_path, policy_cfg, loss_cfg, seed, rank=rank, world_size=self.world_size, num_threads=num_threads
            )
            for rank in range(self.world_size)
        ]
        self._sharded = False  # FSDP2: the ranks say so when they join (start)
        self.transport, self.generators = None, []
        self._started = False
        if start:
            self.start()

    def _joined(self, answers: list) -> None:
        self._sharded = any(answers)  # each rank says whether it sharded with FSDP2

    def attach(self, transport, generators: list) -> None:
        """Connect the weight transport to the generation engines (`refit.push_weights` uses it)."""
        self.start()
        self.transport, self.generators = transport, list(generators)
        transport.connect(self, self.generators)

    # -------------------------------------------------------------------------- scoring
    def _dp_rows(self, n: int) -> list[slice]:
        """Each rank's rows: the batch split over the dp groups, the same rows for a group's tp ranks."""
        return [rows for rows in split_rows(n, self.dp) for _ in range(self.tp)]

    def _per_dp_group(self, results: list) -> list:
        """One result per dp group (its first tp rank's): the tp ranks computed the same rows."""
        return results[:: self.tp]

    def logprobs(self, batch: dict[str, torch.Tensor], reference: bool = False) -> torch.Tensor:
        rows = self._dp_rows(batch_size(batch))
        parts = [w.logprobs.remote(take_rows(batch, r), reference=reference) for w, r in zip(self.workers, rows)]
        return torch.cat(self._per_dp_group(ray.get(parts)))  # [B, S]

    def logprobs_and_reference(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[2, B, S] current-weight and reference logprobs of `batch`, one call per rank."""
        rows = self._dp_rows(batch_size(batch))
        parts = [w.logprobs_and_reference.remote(take_rows(batch, r)) for w, r in zip(self.workers, rows)]
        return torch.cat(self._per_dp_group(ray.get(parts)), dim=1)  # [2, B, S]

    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """Rank 0's scores; every rank scores too, because ranks agree on micro-batch counts
        (and run FSDP2's collectives) together."""
        return ray.get([w.score.remote(sequences, prompt_lens) for w in self.workers][0])

    # ------------------------------------------------------------------------- training
    def train(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Each optimizer step's rows (train_global_batch_size of them) are split across the
        ranks; each rank gets its share of every step, in step order."""
        shards, tokens, seqs = shard_steps(batch, self.cfg.train_global_batch_size, self.dp)
        calls = [w.train.remote(shards[rank // self.tp], tokens, seqs) for rank, w in enumerate(self.workers)]
        return combine_metrics(self._per_dp_group(ray.get(calls)))  # loss-like sums counted once per dp group

    def gradients(self) -> dict[str, torch.Tensor]:
        return ray.get([w.gradients.remote() for w in self._gathering_workers()][0])

    # ------------------------------------------------------------------ weights and state
    def weights(self) -> dict[str, torch.Tensor]:
        """Rank 0's full weights (under FSDP2 every rank gathers with it)."""
        return ray.get(self.submit_weights())

    def submit_weights(self) -> ray.ObjectRef:
        """Rank 0's full weights by reference, not waited for: the object store transport hands
        the ref to the engines, so the weights never pass through the driver."""
        return [w.weights.remote() for w in self._gathering_workers()][0]

    def save(self, folder: str) -> None:
        """Rank 0 writes; every rank takes part (under FSDP2 they gather the full state)."""
        ray.get([w.save.remote(folder) for w in self.workers])

    def load(self, folder: str) -> None:
        ray.get([w.load.remote(folder) for w in self.workers])

    # ------------------------------------------------ weight transports (rank 0 is the source)
    def free_address(self) -> tuple[str, int]:
        return ray.get(self.rank0.free_address.remote())

    def collective_backend(self) -> str:
        return ray.get(self.rank0.collective_backend.remote())

    def weight_metadata(self) -> list:
        return ray.get(self.rank0.weight_metadata.remote())

    def submit_open_collective(self, host: str, port: int, world_size: int, backend: str) -> list[ray.ObjectRef]:
        """Rank 0 joins the weight group, not waited for: the engines join at the same time."""
        return [self.rank0.open_collective.remote(host, port, world_size, backend)]

    def submit_send_collective(self, bucket_bytes: int) -> list[ray.ObjectRef]:
        """Rank 0 broadcasts (under FSDP2 every rank gathers with it), not waited for: the engines
        receive at the same time. Rank 0's ref is first."""
        return [w.send_collective.remote(bucket_bytes) for w in self._gathering_workers()]

    def send_ipc(self) -> dict[str, list]:
        """Every rank's CUDA IPC handles, keyed by device UUID (GPU-only)."""
        merged: dict[str, list] = {}
        for handles in ray.get([w.send_ipc.remote() for w in self.workers]):
            merged.update(handles)
        return merged

    # ------------------------------------------ colocated memory choreography (colocation.py)
    def offload(self, parts: tuple[str, ...]) -> None:
        """Every rank moves `parts` of its state to the host and empties its allocator's cache."""
        ray.get([w.offload.remote(parts) for w in self.workers])

    def reload(self) -> None:
        """Every rank moves what it offloaded back to its device."""
        ray.get([w.reload.remote() for w in self.workers])

    def _gathering_workers(self) -> list:
        """The ranks a full-weight call needs: all of them under FSDP2 (each gather is a
        collective), else rank 0 alone. The first one's answer is the group's."""
        return self.workers if self._sharded else [self.rank0]
