"""The worker core: what a policy rank and a value rank share about training one model.

`WorkerCore` is the base class of `policy.worker.PolicyWorker` and `ppo.value_worker.ValueWorker`.
It owns the trainable model's state and its life: fp32 masters (precision.py), optimizer and
scheduler, the micro-batch loops (inference rows, and one optimizer step: forward, backward,
metrics, gradient reduction, clipping, the non-finite guard), checkpoint files (masters, PEFT
adapters, optimizer/scheduler/RNG state), the process group and the Ray actor plumbing. A
subclass keeps only what is its own: how its model is built, what one micro-batch computes
(`_microbatch_loss`, `_forward_rows`' forward) and its checkpoint's model files.

A base class rather than a composed object: a Ray actor exposes the methods of its class, so
the shared public methods (`save` helpers, `gradients`, `master_weights`, `ping`, `whereabouts`,
...) would otherwise need a forwarding method in each worker, and tests and groups reach the
same attributes (`model`, `master`, `optimizer`, `peft`) on both.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpo_train.actor_group import sum_gradients
from grpo_train.batch import batch_size
from grpo_train.errors import NonFiniteLossError
from grpo_train.policy import fsdp, microbatch
from grpo_train.policy.optim import apply_optimizer_config, build_optimizer, build_scheduler
from grpo_train.policy.precision import DTYPES, MasterWeights
from grpo_train.state_io import load_state, save_state

MASTERS_FILE = "master_weights.safetensors"  # fp32 masters of a mixed-precision run (always, under LoRA)
ADAPTER_DIR = "adapter"  # a LoRA checkpoint's adapters in PEFT format (save_pretrained)
# A worker's non-weight state: key in `read_states`' dict -> state file stem (state_io).
STATE_FILES = {"optimizer": "optimizer", "scheduler": "scheduler", "rng": "torch_rng"}

Forward = Callable[[dict[str, torch.Tensor], microbatch.MicroBatch], torch.Tensor]


def read_states(folder: Path) -> dict[str, Any]:
    """A checkpoint's optimizer, scheduler and torch RNG state (state files, no pickle)."""
    return {key: load_state(folder, stem) for key, stem in STATE_FILES.items()}


def merge_metrics(
    sums: dict[str, float], metrics: dict[str, Any], mins: tuple[str, ...] = (), maxes: tuple[str, ...] = ()
) -> None:
    """One micro-batch's metrics into the step's: min or max for the names in mins / maxes, else summed."""
    for key, value in metrics.items():
        value = float(value)
        if key in mins:
            sums[key] = min(sums.get(key, math.inf), value)
        elif key in maxes:
            sums[key] = max(sums.get(key, -math.inf), value)
        else:
            sums[key] = sums.get(key, 0.0) + value


class WorkerCore:
    # Set by the subclass. A micro-batch step's metric names start with metric_prefix (its loss:
    # prefix + "loss", then prefix + "grad_norm" and prefix + "lr"); step_name names the step in
    # the non-finite error; mins / maxes are metrics merged over micro-batches by min / max.
    metric_prefix = ""
    step_name = "training"
    min_metrics: tuple[str, ...] = ()
    max_metrics: tuple[str, ...] = ()
    # Whether forward/backward may hold collectives (FSDP2, TP): then every data-parallel rank runs
    # as many micro-batches as the rank with the most (dummy ones where it has fewer).
    lockstep_microbatches = True

    cfg: Any  # the worker's config section: precision, optimizer, scheduler, max_grad_norm
    model: Any  # the subclass's torch.nn.Module (HF models' attributes are untyped)
    peft: Any  # peft.PeftModel over the model (or its backbone) under LoRA, else None

    def __init__(self, cfg: Any, seed: int, rank: int, world_size: int, num_threads: int | None):
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.cfg = cfg
        # fp32 masters, compute in cfg.precision (precision.py): the model is loaded in fp32, then
        # its parameters become the compute copy (`_build_optimizer`).
        self.dtype = DTYPES[cfg.precision]
        self.rank, self.world_size = rank, world_size
        # Data parallelism over all ranks unless a subclass lays out a dp x tp mesh (policy TP).
        self.tp_size, self.dp_size, self.dp_rank = 1, world_size, rank
        self._dp_group = None  # the dp sub-mesh's process group under TP or CP (None: the default group)
        self._cp_mesh = None  # the cp sub-mesh under context parallelism (PolicyWorker.init_distributed)
        self._sharded = False  # parameters are DTensors (FSDP2 and/or TP): gathers are collectives
        self._fsdp = False  # FSDP2 reduces the gradients over dp itself
        self.peft = None

    def _build_optimizer(self, masters_dtype: torch.dtype) -> None:
        """fp32 masters of the model's trainable parameters (its parameters become the
        masters_dtype copy), and the optimizer and scheduler over the masters."""
        self.master = MasterWeights(self.model, masters_dtype)
        self.optimizer = build_optimizer(self.master.parameters(), self.cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.scheduler)

    # --------------------------------------------------------------------- micro-batches
    def _planner(self, purpose: microbatch.Purpose) -> microbatch.Planner:
        raise NotImplementedError

    def _plan(self, batch: dict[str, torch.Tensor], purpose: microbatch.Purpose):
        """This rank's planner, row lengths and micro-batches (none for an empty share)."""
        planner = self._planner(purpose)
        lengths = microbatch.row_lengths(batch["attention_mask"])
        return planner, lengths, planner.plan(lengths, batch["input_ids"].shape[1]) if lengths else []

    def _dummy(
        self, batch: dict[str, torch.Tensor], planner: microbatch.Planner, lengths: list[int]
    ) -> tuple[dict[str, torch.Tensor], microbatch.MicroBatch]:
        """A micro-batch whose result is thrown away, run to keep this rank in step with ranks
        that have more; a rank given no rows (batch smaller than the ranks) runs two pad tokens."""
        if not lengths:
            width = microbatch.MIN_WIDTH
            batch = {
                "input_ids": torch.zeros(1, width, dtype=torch.long),
                "attention_mask": torch.ones(1, width, dtype=torch.long),
            }
            lengths = [width]
        return batch, planner.dummy(lengths, batch["input_ids"].shape[1])

    def _agree_microbatch_count(self, n: int) -> int:
        """Micro-batches every data-parallel rank runs: the most any rank has (`lockstep_microbatches`).
        Ranks with fewer run dummy ones, so collectives inside forward/backward (FSDP) stay matched."""
        import torch.distributed as dist

        if (
            not self.lockstep_microbatches
            or self.world_size == 1
            or not (dist.is_available() and dist.is_initialized())
        ):
            return n
        count = torch.tensor([n], dtype=torch.int64, device=next(self.model.parameters()).device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count.item())

    def _forward_rows(self, batch: dict[str, torch.Tensor], forward: Forward) -> torch.Tensor:
        """[B, S] fp32 on CPU: forward(batch, mb) -> [len(mb.rows), W] over the inference micro-batches."""
        out = torch.zeros(batch_size(batch), batch["input_ids"].shape[1])
        planner, lengths, plan = self._plan(batch, "logprob")
        for i in range(self._agree_microbatch_count(len(plan))):
            if i >= len(plan):  # keeps this rank in step; the result is not used
                forward(*self._dummy(batch, planner, lengths))
                continue
            rows = forward(batch, plan[i])  # [rows, W]
            out[torch.tensor(plan[i].rows), : rows.shape[1]] = rows.float().cpu()
        return out

    # -------------------------------------------------------------------------- training
    def _train_forward(self, batch: dict[str, torch.Tensor], mb: microbatch.MicroBatch) -> torch.Tensor:
        """The training forward of one micro-batch (run alone for a dummy micro-batch)."""
        raise NotImplementedError

    def _microbatch_loss(
        self, batch: dict[str, torch.Tensor], mb: microbatch.MicroBatch, global_tokens: float, global_seqs: float
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """(loss, metrics) of one micro-batch; metrics hold the loss under metric_prefix + "loss"."""
        raise NotImplementedError

    def _optimizer_step(
        self, batch: dict[str, torch.Tensor], global_tokens: float, global_seqs: float
    ) -> dict[str, float]:
        """One optimizer step over `batch` in train micro-batches: each micro-batch's loss backward
        (gradients accumulate into the fp32 masters), then `_apply_gradients`."""
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        lr = self.scheduler.get_last_lr()[0]
        planner, lengths, plan = self._plan(batch, "train")
        for i in range(self._agree_microbatch_count(len(plan))):
            if i >= len(plan):  # keeps this rank in step: gradients of exactly zero
                (self._train_forward(*self._dummy(batch, planner, lengths)).sum() * 0.0).backward()
                self.master.accumulate()
                continue
            loss, metrics = self._microbatch_loss(batch, plan[i], global_tokens, global_seqs)
            loss.backward()
            self.master.accumulate()  # fp32 gradients (under FSDP2: its fp32 reduce-scatter)
            merge_metrics(sums, metrics, self.min_metrics, self.max_metrics)
        loss_key = self.metric_prefix + "loss"
        sums.setdefault(loss_key, 0.0)  # a rank given no rows adds nothing
        grad_norm = self._apply_gradients(sums[loss_key])
        return sums | {f"{self.metric_prefix}grad_norm": grad_norm, f"{self.metric_prefix}lr": lr}

    def _apply_gradients(self, loss: float) -> float:
        """Reduce the gradients over dp, clip them to cfg.max_grad_norm and step optimizer, masters
        and scheduler; a non-finite loss or norm skips the step and raises. Returns the norm."""
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        self._reduce_gradients()
        grad_norm = fsdp.clip_grad_norm(self.master.parameters(), max_norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"non-finite {self.step_name} step: loss={loss}, grad_norm={grad_norm}; "
                "the optimizer step was skipped and the last checkpoint is intact"
            )
        self.optimizer.step()
        self.master.refresh()
        self.scheduler.step()
        return grad_norm

    def _reduce_gradients(self) -> None:
        """Sum gradients over data-parallel ranks. Each rank's loss is divided by the global
        token (or sequence) count, so the sum is the single-worker gradient (GRPO-MATH.md).
        FSDP2 reduces its own gradients during backward."""
        if self._cp_mesh is not None:  # each cp rank's gradients come from its tokens: their sum, then over dp
            fsdp.sum_local_gradients(self.master.parameters(), self._cp_mesh.get_group())
        if self.dp_size == 1 or self._fsdp:
            return
        if self.tp_size > 1 or self._cp_mesh is not None:  # tp shards / cp ranks of a dp group: sum over dp only
            fsdp.sum_local_gradients(self.master.parameters(), self._dp_group)
            return
        sum_gradients(self.master.parameters())  # the fp32 gradients

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last optimizer step's (reduced) gradients by parameter name, on CPU (full tensors:
        under FSDP2 every rank calls it, to gather)."""
        if not self._sharded:
            return {
                name: m.grad.detach().to("cpu", copy=True)
                for name, m in zip(self.master.names, self.master.parameters())
                if m.grad is not None
            }
        return {
            name: fsdp.full(p.grad.detach()).to("cpu", copy=True)
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name on CPU (full tensors: under FSDP2 every rank
        calls it, to gather)."""
        if not self._sharded:
            return self.master.state()
        return {name: fsdp.full(p.detach()).to("cpu", copy=True) for name, p in self.model.named_parameters()}

    # ------------------------------------------------------------------------ checkpoints
    def _save_masters(self, folder: Path, masters: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        save_file({k: v.detach().clone().contiguous() for k, v in masters.items()}, str(folder / MASTERS_FILE))

    def _save_adapters(self, folder: Path, masters: dict[str, torch.Tensor], prefix: str = "") -> None:
        """The LoRA adapters among `masters` (the names under `prefix`: the module peft wraps) in
        PEFT format under ADAPTER_DIR; PeftModel's names are the wrapped module's under base_model.model."""
        assert self.peft is not None
        adapters = {f"base_model.model.{k[len(prefix) :]}": v for k, v in masters.items() if k.startswith(prefix)}
        self.peft.save_pretrained(str(folder / ADAPTER_DIR), safe_serialization=True, state_dict=adapters)

    def _save_states(self, folder: Path, optimizer_state: Any) -> None:
        """Optimizer, scheduler and torch RNG state as state files (STATE_FILES)."""
        states = {"optimizer": optimizer_state, "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state()}
        for key, stem in STATE_FILES.items():
            save_state(states[key], folder, stem)

    def _restore_states(self, states: dict[str, Any], optimizer: bool = True) -> None:
        """`read_states`' state back (the optimizer's unless it was loaded already, as FSDP2's
        scatter does); the optimizer config's values win over the checkpoint's (apply_optimizer_config)."""
        if optimizer:
            self.optimizer.load_state_dict(states["optimizer"])
        self.scheduler.load_state_dict(states["scheduler"])
        apply_optimizer_config(self.optimizer, self.scheduler, self.cfg.optimizer)
        torch.set_rng_state(states["rng"])

    # -------------------------------------------------------- Ray actor and process group
    def ping(self) -> int:
        return os.getpid()

    def free_address(self) -> tuple[str, int]:
        # refit.buckets: loaded when a process group or the collective transport is set up
        from grpo_train.refit.buckets import free_address

        return free_address()

    def whereabouts(self) -> dict[str, object]:
        """Where this rank runs: Ray node id, IP and pid."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "rank": self.rank,
        }

    def _join_process_group(self, master_addr: str, port: int, backend: str) -> None:
        """Join the workers' process group (NCCL on GPUs, gloo on CPU); every rank calls it at once."""
        import torch.distributed as dist

        dist.init_process_group(
            backend, init_method=f"tcp://{master_addr}:{port}", rank=self.rank, world_size=self.world_size
        )
