"""What the data-parallel groups share: their ranks, and the row sharding around them.

Job: `RankGroup`, the base of `PolicyGroup` and `ppo.ValueGroup` (plain driver objects whose
methods fan a call out to their Ray actors, wait, and return the combined value), and the
data-parallel helpers (row shards per optimizer step, metric merging, gradient sum) that the
policy and the value groups and their workers use alike.
Boundary: no knowledge of what the actors compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import ray
import torch

from grpo_train.batch import batch_size


class RankGroup:
    """What the data-parallel groups share: their ranks (`workers`, Ray actors with `free_address`,
    `init_distributed`, `ping`, `whereabouts`) placed in `placement_group`, joined in one
    torch.distributed group by `start`. Subclasses set both attributes and `_started = False`."""

    workers: list
    placement_group: object
    _started: bool

    def start(self) -> None:
        """Wait for the ranks to load and join their process group (construction returns while
        they load, so other actors can start meanwhile)."""
        if not self._started:
            host, port = ray.get(self.workers[0].free_address.remote())
            self._joined(ray.get([w.init_distributed.remote(host, port) for w in self.workers]))
            self._started = True

    def _joined(self, answers: list) -> None:
        """The ranks' answers to `init_distributed`, for subclasses that need them."""

    @property
    def rank0(self):
        return self.workers[0]

    def ping(self) -> int:
        """Every rank answers; rank 0's pid."""
        return ray.get([w.ping.remote() for w in self.workers])[0]

    def whereabouts(self) -> list[dict]:
        """Where each rank runs (Ray node id, IP, pid, rank)."""
        return ray.get([w.whereabouts.remote() for w in self.workers])

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        ray.util.remove_placement_group(self.placement_group)


def split_rows(n: int, parts: int) -> list[slice]:
    """Contiguous, near-equal row ranges, one per member (empty ranges when n < parts)."""
    bounds = [n * r // parts for r in range(parts + 1)]
    return [slice(bounds[r], bounds[r + 1]) for r in range(parts)]


def take_rows(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    """The rows of every tensor, keeping the batch's width (shards of one batch then concatenate)."""
    return {key: value[rows] for key, value in batch.items()}


def shard_steps(
    batch: dict[str, torch.Tensor], per_step: int, world_size: int
) -> tuple[list[dict[str, torch.Tensor]], list[float], list[float]]:
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


def run_optimizer_steps(
    batch: dict[str, torch.Tensor],
    per_step: int,
    global_valid_tokens: list[float] | None,
    global_valid_seqs: list[float] | None,
    step: Callable[[dict[str, torch.Tensor], float, float], dict[str, float]],
) -> dict[str, float]:
    """A rank's side of `shard_steps`: `step(rows, tokens, seqs)` on each optimizer step's rows
    (`per_step` of this rank's rows each), with the step's global valid token and sequence counts
    (counted locally when not given, for one worker; at least 1); the steps' mean metrics."""
    n = batch_size(batch)
    num_steps = max(1, n // per_step)
    metrics: dict[str, float] = {}
    for k in range(num_steps):
        step_batch = take_rows(batch, slice(k * per_step, min((k + 1) * per_step, n)))
        valid = step_batch["token_mask"] * step_batch["sample_mask"].unsqueeze(1)
        tokens = global_valid_tokens[k] if global_valid_tokens else float(valid.sum())
        seqs = global_valid_seqs[k] if global_valid_seqs else float(step_batch["sample_mask"].sum())
        for key, value in step(step_batch, max(tokens, 1.0), max(seqs, 1.0)).items():
            metrics[key] = metrics.get(key, 0.0) + value / num_steps
    return metrics


def combine_rank_metrics(
    per_rank: list[dict[str, float]],
    shared: Iterable[str] = (),
    minimum: Iterable[str] = (),
    maximum: Iterable[str] = (),
) -> dict[str, float]:
    """Loss-like metrics are partial sums of global means, so ranks add up; `minimum`/`maximum`
    reduce; `shared` ones are the same on every rank (after the all-reduce) and come from the
    first rank that reports them. A rank given no rows may report fewer keys."""
    shared, minimum, maximum = set(shared), set(minimum), set(maximum)
    out: dict[str, float] = {}
    for key in dict.fromkeys(key for m in per_rank for key in m):
        values = [m[key] for m in per_rank if key in m]
        if key in minimum:
            out[key] = min(values)
        elif key in maximum:
            out[key] = max(values)
        elif key in shared:
            out[key] = values[0]
        else:
            out[key] = math.fsum(values)
    return out


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
