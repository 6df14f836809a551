"""A policy worker: one HF causal LM replica that scores and trains on [B, S] batches.

It runs as a Ray actor (see `group.py`) but is a plain class, so tests can also drive it
in-process. It knows nothing of generation or environments: batches arrive as tensors.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import torch

import grpo_kernels
from grpo_train.batch import batch_size, select_rows
from grpo_train.config.schema import LossConfig, PolicyConfig
from grpo_train.policy.logprobs import sequence_logprobs
from grpo_train.policy.optim import build_optimizer, build_scheduler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Metrics of clipped_pg_loss that are min/max rather than partial sums.
_MIN_METRICS = ("ratio_min", "clipped_ratio_min")
_MAX_METRICS = ("ratio_max", "clipped_ratio_max")


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the optimizer step was not taken."""


def pg_loss_config(cfg: LossConfig) -> grpo_kernels.PGLossConfig:
    return grpo_kernels.PGLossConfig(**cfg.model_dump())


class PolicyWorker:
    def __init__(self, model_path: str, policy_cfg: PolicyConfig, loss_cfg: LossConfig, seed: int,
                 rank: int = 0, world_size: int = 1, num_threads: int | None = None):
        from transformers import AutoModelForCausalLM

        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed + rank)
        self.cfg = policy_cfg
        self.loss_cfg = pg_loss_config(loss_cfg)
        self.rank, self.world_size = rank, world_size
        self.temperature = policy_cfg.generation.temperature
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[policy_cfg.precision])
        self.model.train()
        self.reference = None
        if loss_cfg.reference_policy_kl_penalty > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = build_optimizer(self.model.parameters(), policy_cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, policy_cfg.scheduler)

    # ----------------------------------------------------------------------------- scoring
    def _logprobs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], self.temperature,
                                 fused=self.cfg.use_fused_kernels, chunk_size=self.cfg.logprob_chunk_size)

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor], reference: bool = False) -> torch.Tensor:
        """[B, S] logprobs under the current (or the reference) weights, in logprob micro-batches."""
        model = self.reference if reference else self.model
        if model is None:
            raise ValueError("reference logprobs requested but loss_fn.reference_policy_kl_penalty is 0")
        n, S = batch_size(batch), batch["input_ids"].shape[1]
        out = torch.zeros(n, S)
        step = self.cfg.logprob_batch_size
        for start in range(0, n, step):
            rows = slice(start, min(start + step, n))
            mb = select_rows(batch, rows)
            lp = self._logprobs(model, mb)
            out[rows, : lp.shape[1]] = lp
        return out

    @torch.no_grad()
    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """Logprobs of sequences[i][prompt_lens[i]:] under the current weights (refit probe)."""
        S = max(len(s) for s in sequences)
        input_ids = torch.zeros(len(sequences), S, dtype=torch.long)
        attention_mask = torch.zeros(len(sequences), S, dtype=torch.long)
        for i, seq in enumerate(sequences):
            input_ids[i, : len(seq)] = torch.tensor(seq)
            attention_mask[i, : len(seq)] = 1
        lp = self._logprobs(self.model, {"input_ids": input_ids, "attention_mask": attention_mask})
        return [lp[i, plen : len(seq)].tolist() for i, (seq, plen) in enumerate(zip(sequences, prompt_lens))]

    # ---------------------------------------------------------------------------- training
    def train(self, batch: dict[str, torch.Tensor], global_valid_tokens: list[float] | None = None,
              global_valid_seqs: list[float] | None = None) -> dict[str, float]:
        """Optimizer steps over `batch` (train_global_batch_size samples each, in micro-batches).

        `batch` must hold prev_logprobs (and ref_logprobs when beta > 0). The global counts are
        per optimizer step over all data-parallel ranks; computed locally for one worker.
        """
        n = batch_size(batch)
        per_step = self.cfg.train_global_batch_size // self.world_size
        num_steps = max(1, n // per_step)
        metrics: dict[str, float] = {}
        for k in range(num_steps):
            rows = slice(k * per_step, min((k + 1) * per_step, n))
            step_batch = {key: v[rows] for key, v in batch.items()}
            valid = step_batch["token_mask"] * step_batch["sample_mask"].unsqueeze(1)
            tokens = global_valid_tokens[k] if global_valid_tokens else float(valid.sum())
            seqs = global_valid_seqs[k] if global_valid_seqs else float(step_batch["sample_mask"].sum())
            step_metrics = self._optimizer_step(step_batch, max(tokens, 1.0), max(seqs, 1.0))
            for key, value in step_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value / num_steps
        return metrics

    def _optimizer_step(self, batch: dict[str, torch.Tensor], global_tokens: float, global_seqs: float) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        lr = self.scheduler.get_last_lr()[0]
        n = batch_size(batch)
        for start in range(0, n, self.cfg.train_micro_batch_size):
            mb = select_rows(batch, slice(start, min(start + self.cfg.train_micro_batch_size, n)))
            curr = self._logprobs(self.model, mb)
            loss, m = grpo_kernels.clipped_pg_loss(
                curr, mb["prev_logprobs"], mb["gen_logprobs"], mb.get("ref_logprobs"), mb["advantages"],
                mb["token_mask"], mb["sample_mask"], self.loss_cfg, global_tokens, global_seqs,
            )
            loss.backward()
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            for key, value in m.items():
                value = float(value)
                if key in _MIN_METRICS:
                    sums[key] = min(sums.get(key, math.inf), value)
                elif key in _MAX_METRICS:
                    sums[key] = max(sums.get(key, -math.inf), value)
                else:
                    sums[key] = sums.get(key, 0.0) + value
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if not (math.isfinite(sums["loss"]) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"non-finite training step: loss={sums['loss']}, grad_norm={grad_norm}; "
                                     "the optimizer step was skipped and the last checkpoint is intact")
        self.optimizer.step()
        self.scheduler.step()
        sums.update(grad_norm=grad_norm, lr=lr)
        return sums

    # ------------------------------------------------------------------- weights and state
    def weights(self) -> dict[str, torch.Tensor]:
        """HF-named contiguous CPU tensors for the generator (tied weights appear once)."""
        from grpo_train import weight_sync

        return weight_sync.state_dict_for_refit(self.model)

    def save(self, folder: str) -> None:
        from grpo_train.checkpoint import atomic_torch_save

        folder = Path(folder)
        self.model.save_pretrained(folder / "model", safe_serialization=True)
        atomic_torch_save(self.optimizer.state_dict(), folder / "optimizer.pt")
        atomic_torch_save(self.scheduler.state_dict(), folder / "scheduler.pt")
        atomic_torch_save(torch.get_rng_state(), folder / "torch_rng.pt")

    def load(self, folder: str) -> None:
        from safetensors.torch import load_file

        folder = Path(folder)
        state = {}
        for shard in sorted((folder / "model").glob("*.safetensors")):
            state.update(load_file(shard))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {k for k in missing if self.model.config.tie_word_embeddings and k.endswith("lm_head.weight")}
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"checkpoint {folder} does not match the model: missing {missing}, unexpected {unexpected}")
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
        self.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))
        torch.set_rng_state(torch.load(folder / "torch_rng.pt"))

    def ping(self) -> int:
        return os.getpid()
