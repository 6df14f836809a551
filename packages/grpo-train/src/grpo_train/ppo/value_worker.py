"""The value model and its worker: a causal LM backbone with a scalar head, trained on [B, S] batches.

Like `PolicyWorker`, a plain class run as a Ray actor (tests may drive it in-process). It reuses
the policy's optimizer/scheduler builders and save/load conventions; it knows nothing of
generation, environments or the policy.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from grpo_train.batch import batch_size, select_rows
from grpo_train.config.schema import ValueConfig, ValueLossConfig
from grpo_train.policy.optim import build_optimizer, build_scheduler
from grpo_train.policy.worker import DTYPES, NonFiniteLossError
from grpo_train.ppo.value_loss import value_loss_fn

HEAD_FILE = "value_head.safetensors"


class ValueModel(torch.nn.Module):
    """values[:, t] = head(h[:, t-1]) = V(x_<t), aligned with the batch's logprobs; 0 at t = 0."""

    def __init__(self, model_path: str, dtype: torch.dtype):
        from transformers import AutoModel

        super().__init__()
        self.backbone = AutoModel.from_pretrained(model_path, dtype=dtype)
        # A zero head starts every value at 0 (the reward scale's neutral point) instead of at noise.
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1, dtype=dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]  # [B, S-1, H]
        values = self.head(hidden).squeeze(-1).float()  # [B, S-1]
        return F.pad(values, (1, 0)) * attention_mask  # [B, S]


class ValueWorker:
    def __init__(self, model_path: str, cfg: ValueConfig, loss_cfg: ValueLossConfig, global_batch_size: int, seed: int,
                 num_threads: int | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.cfg, self.loss_cfg = cfg, loss_cfg
        self.global_batch_size = global_batch_size  # samples per optimizer step
        # The device comes from the config, not from what is visible: Ray leaves GPUs visible to
        # actors that asked for none.
        self.device = torch.device("cuda") if cfg.num_gpus > 0 else torch.device("cpu")
        self.model = ValueModel(model_path, DTYPES[cfg.precision]).to(self.device)
        self.model.train()
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.scheduler)

    @torch.no_grad()
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, S] V(x_<t) under the current weights, in inference micro-batches."""
        n, S = batch_size(batch), batch["input_ids"].shape[1]
        out = torch.zeros(n, S)
        for start in range(0, n, self.cfg.inference_batch_size):
            rows = slice(start, min(start + self.cfg.inference_batch_size, n))
            mb = select_rows(batch, rows)
            v = self.model(mb["input_ids"].to(self.device), mb["attention_mask"].to(self.device))
            out[rows, : v.shape[1]] = v.cpu()
        return out

    def train(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Optimizer steps over `batch`, which holds `values` (at rollout time) and `returns`."""
        n = batch_size(batch)
        num_steps = max(1, n // self.global_batch_size)
        metrics: dict[str, float] = {}
        for k in range(num_steps):
            rows = slice(k * self.global_batch_size, min((k + 1) * self.global_batch_size, n))
            step_batch = {key: v[rows] for key, v in batch.items()}
            for key, value in self._optimizer_step(step_batch).items():
                metrics[key] = metrics.get(key, 0.0) + value / num_steps
        return metrics

    def _optimizer_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        valid = batch["token_mask"] * batch["sample_mask"].unsqueeze(1)
        tokens, seqs = max(float(valid.sum()), 1.0), max(float(batch["sample_mask"].sum()), 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        sums: dict[str, float] = {}
        n, mb_size = batch_size(batch), self.cfg.train_micro_batch_size
        for start in range(0, n, mb_size):
            mb = {k: v.to(self.device) for k, v in select_rows(batch, slice(start, min(start + mb_size, n))).items()}
            values = self.model(mb["input_ids"], mb["attention_mask"])
            loss, m = value_loss_fn(values, mb["values"], mb["returns"], mb["token_mask"], mb["sample_mask"],
                                    self.loss_cfg, tokens, seqs)
            loss.backward()
            for key, value in {"value_loss": loss.detach(), **m}.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if not (math.isfinite(sums["value_loss"]) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"non-finite value step: loss={sums['value_loss']}, grad_norm={grad_norm}; "
                                     "the optimizer step was skipped and the last checkpoint is intact")
        self.optimizer.step()
        self.scheduler.step()
        return sums | {"value_grad_norm": grad_norm, "value_lr": lr}

    # ------------------------------------------------------------------- weights and state
    def save(self, folder: str) -> None:
        from safetensors.torch import save_file

        from grpo_train.checkpoint import atomic_torch_save

        folder = Path(folder)
        self.model.backbone.save_pretrained(folder / "model", safe_serialization=True)
        save_file({k: v.contiguous() for k, v in self.model.head.state_dict().items()}, str(folder / "model" / HEAD_FILE))
        atomic_torch_save(self.optimizer.state_dict(), folder / "optimizer.pt")
        atomic_torch_save(self.scheduler.state_dict(), folder / "scheduler.pt")
        atomic_torch_save(torch.get_rng_state(), folder / "torch_rng.pt")

    def load(self, folder: str) -> None:
        from safetensors.torch import load_file

        folder = Path(folder)
        backbone = {}
        for shard in sorted((folder / "model").glob("*.safetensors")):
            if shard.name != HEAD_FILE:
                backbone.update(load_file(shard))
        self.model.backbone.load_state_dict(backbone, strict=True)
        self.model.head.load_state_dict(load_file(folder / "model" / HEAD_FILE, device=str(self.device)), strict=True)
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
        self.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))
        torch.set_rng_state(torch.load(folder / "torch_rng.pt"))

    def ping(self) -> int:
        return os.getpid()
