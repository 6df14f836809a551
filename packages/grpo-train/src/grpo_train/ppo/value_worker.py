"""The value model and its worker: a causal LM backbone with a scalar head, trained on [B, S] batches.

Like `PolicyWorker`, a plain class run as a Ray actor (tests may drive it in-process); N of them
form a data-parallel `ValueGroup` (value_group.py). It reuses the policy's optimizer/scheduler
builders, micro-batch planners (padded, dynamic, packed) and save/load conventions; it knows
nothing of generation, environments or the policy.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from grpo_train.actor_group import run_optimizer_steps, sum_gradients
from grpo_train.batch import batch_size
from grpo_train.config.schema import ValueConfig, ValueLossConfig
from grpo_train.errors import NonFiniteLossError
from grpo_train.policy import microbatch
from grpo_train.policy.logprobs import packed_hidden_states
from grpo_train.policy.optim import apply_optimizer_config, build_optimizer, build_scheduler
from grpo_train.policy.precision import DTYPES, MasterWeights
from grpo_train.ppo.value_loss import value_loss_fn
from grpo_train.state_io import load_state, save_state

MASTERS_FILE = "master_weights.safetensors"  # fp32 masters of a mixed-precision run (always, under LoRA)
HEAD_FILE = "value_head.safetensors"
ADAPTER_DIR = "adapter"  # value.lora_cfg: the backbone's adapters in PEFT format
LORA_KEY = "value.lora_cfg"


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
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               use_cache=False).last_hidden_state[:, :-1]  # [B, S-1, H]
        values = self.head(hidden).squeeze(-1).float()  # [B, S-1]
        return F.pad(values, (1, 0)) * attention_mask  # [B, S]

    def forward_packed(self, packed: microbatch.PackedRows) -> torch.Tensor:
        """The same values for a packed stream's rows: [n, longest row], 0 past each row's end."""
        hidden = packed_hidden_states(self.backbone, packed.input_ids, packed.position_ids, packed.cu_seqlens,
                                      packed.max_seqlen)  # [T, H]
        rows = microbatch.unpack_rows(self.head(hidden).squeeze(-1).float(), packed)  # [n, L]: head(h_t) at t
        L = rows.shape[1]
        lengths = packed.cu_seqlens[: packed.num_rows + 1].diff().to(rows.device)  # [n]
        inside = torch.arange(L, device=rows.device)[None, :] < lengths[:, None]  # [n, L]
        return F.pad(rows, (1, 0))[:, :L] * inside  # [n, L]: head(h_{t-1}) at t


def value_planner(cfg: ValueConfig, purpose: microbatch.Purpose) -> microbatch.Planner:
    """The policy's micro-batch planners on the value section's keys: value.sequence_packing,
    value.dynamic_batching, else value.train_micro_batch_size / value.inference_batch_size rows."""
    field = "train_mb_tokens" if purpose == "train" else "logprob_mb_tokens"
    packing, dynamic = cfg.sequence_packing, cfg.dynamic_batching
    if packing.enabled:
        return microbatch.SequencePacking(getattr(packing, field), packing.sequence_length_round,
                                          f"value.sequence_packing.{field}", packing.algorithm)
    if dynamic.enabled:
        return microbatch.DynamicBatching(getattr(dynamic, field), dynamic.sequence_length_round,
                                          f"value.dynamic_batching.{field}")
    return microbatch.PaddedRows(cfg.train_micro_batch_size if purpose == "train" else cfg.inference_batch_size)


class ValueWorker:
    def __init__(self, model_path: str, cfg: ValueConfig, loss_cfg: ValueLossConfig, global_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, num_threads: int | None = None, device: str = "cpu"):
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)  # the same on every rank: replicas start identical
        self.cfg, self.loss_cfg = cfg, loss_cfg
        self.global_batch_size = global_batch_size  # samples per optimizer step, over all ranks
        self.rank, self.world_size = rank, world_size
        # The device comes from the caller (the cluster config), not from what is visible: Ray
        # leaves GPUs visible to actors that asked for none.
        self.device = torch.device(device)
        # fp32 masters, compute in value.precision: the policy's mixed precision (precision.py).
        self.model = ValueModel(model_path, torch.float32).to(self.device)
        self.model.train()
        # value.lora_cfg: peft adapters injected into the backbone in place (its base weights frozen);
        # the head is outside peft and trains in full. self.peft wraps the backbone for save_pretrained.
        self.peft = None
        if cfg.lora_cfg.enabled:
            # policy.lora (peft): only value.lora_cfg runs load it
            from grpo_train.policy.lora import apply_lora

            self.peft = apply_lora(self.model.backbone, cfg.lora_cfg, seed, task_type=None, key=LORA_KEY)
        self.master = MasterWeights(self.model, DTYPES[cfg.precision])
        self.optimizer = build_optimizer(self.master.parameters(), cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.scheduler)

    def _microbatch_values(self, batch: dict[str, torch.Tensor], mb: microbatch.MicroBatch) -> torch.Tensor:
        """[len(mb.rows), W] values of one micro-batch's rows (W: its width, or its longest row packed)."""
        if mb.packed:
            return self.model.forward_packed(microbatch.pack_rows(batch["input_ids"], mb, self.device))
        inputs = microbatch.rows_of({k: batch[k] for k in ("input_ids", "attention_mask")}, mb.rows, mb.width, self.device)
        return self.model(inputs["input_ids"], inputs["attention_mask"])

    def _plan(self, batch: dict[str, torch.Tensor], purpose: microbatch.Purpose) -> list[microbatch.MicroBatch]:
        """Micro-batches of this rank's rows (none for a rank that got no rows). The value model has
        no collectives inside forward/backward, so ranks need not agree on their counts."""
        if batch_size(batch) == 0:
            return []
        lengths = microbatch.row_lengths(batch["attention_mask"])
        return value_planner(self.cfg, purpose).plan(lengths, batch["input_ids"].shape[1])

    @torch.no_grad()
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, S] V(x_<t) under the current weights, in inference micro-batches (eval mode: no
        dropout, e.g. value.lora_cfg.dropout, in the rollout's values)."""
        out = torch.zeros(batch_size(batch), batch["input_ids"].shape[1])
        self.model.eval()
        try:
            for mb in self._plan(batch, "logprob"):
                v = self._microbatch_values(batch, mb)  # [rows, W]
                out[torch.tensor(mb.rows), : v.shape[1]] = v.cpu()
        finally:
            self.model.train()
        return out

    def train(self, batch: dict[str, torch.Tensor], global_valid_tokens: list[float] | None = None,
              global_valid_seqs: list[float] | None = None) -> dict[str, float]:
        """Optimizer steps over `batch`, which holds `values` (at rollout time) and `returns`.

        The global counts are per optimizer step over all data-parallel ranks (this rank holds
        global_batch_size / world_size rows of each step); computed locally for one worker.
        """
        per_step = max(1, self.global_batch_size // self.world_size)
        return run_optimizer_steps(batch, per_step, global_valid_tokens, global_valid_seqs, self._optimizer_step)

    def _optimizer_step(self, batch: dict[str, torch.Tensor], tokens: float, seqs: float) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        sums: dict[str, float] = {"value_loss": 0.0}
        for mb in self._plan(batch, "train"):
            values = self._microbatch_values(batch, mb)  # [rows, W]
            x = microbatch.rows_of(batch, mb.rows, values.shape[1], self.device)
            loss, m = value_loss_fn(values, x["values"], x["returns"], x["token_mask"], x["sample_mask"],
                                    self.loss_cfg, tokens, seqs)
            loss.backward()
            self.master.accumulate()
            for key, value in {"value_loss": loss.detach(), **m}.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        if self.world_size > 1:
            sum_gradients(self.master.parameters())  # fp32
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.master.parameters(), max_norm))
        if not (math.isfinite(sums["value_loss"]) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"non-finite value step: loss={sums['value_loss']}, grad_norm={grad_norm}; "
                                     "the optimizer step was skipped and the last checkpoint is intact")
        self.optimizer.step()
        self.master.refresh()
        self.scheduler.step()
        return sums | {"value_grad_norm": grad_norm, "value_lr": lr}

    # ------------------------------------------------------------------- weights and state
    def save(self, folder: str | Path) -> None:
        """Weights (HF backbone + head safetensors in the compute dtype, and the fp32 masters
        when they differ; under value.lora_cfg the trained parameters only: `_save_lora`),
        optimizer, scheduler, RNG. One rank saves."""
        from safetensors.torch import save_file

        folder = Path(folder)
        if self.peft is not None:
            self._save_lora(folder)
        else:
            self.model.backbone.save_pretrained(folder / "model", safe_serialization=True)
            save_file({k: v.contiguous() for k, v in self.model.head.state_dict().items()},
                      str(folder / "model" / HEAD_FILE))
            if self.master.mixed:
                save_file({k: v.contiguous() for k, v in self.master.state().items()}, str(folder / MASTERS_FILE))
        save_state(self.optimizer.state_dict(), folder, "optimizer")
        save_state(self.scheduler.state_dict(), folder, "scheduler")
        save_state(torch.get_rng_state(), folder, "torch_rng")

    def _save_lora(self, folder: Path) -> None:
        """value.lora_cfg: the trained parameters only (the base backbone is the model path's):
        their fp32 masters (`MASTERS_FILE`, what resume reads: adapters and head), the adapters in
        PEFT format (`ADAPTER_DIR`, `PeftModel.from_pretrained(AutoModel..., folder/ADAPTER_DIR)`)
        and the head in the compute dtype under model/."""
        from safetensors.torch import save_file

        assert self.peft is not None
        masters = self.master.state()
        save_file({k: v.contiguous() for k, v in masters.items()}, str(folder / MASTERS_FILE))
        prefix = "backbone."  # PeftModel's names are the injected backbone's under base_model.model.
        adapters = {f"base_model.model.{k[len(prefix):]}": v for k, v in masters.items() if k.startswith(prefix)}
        self.peft.save_pretrained(str(folder / ADAPTER_DIR), safe_serialization=True, state_dict=adapters)
        (folder / "model").mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.model.head.state_dict().items()}, str(folder / "model" / HEAD_FILE))

    def load(self, folder: str | Path) -> None:
        """What `save` wrote; every rank loads the same files."""
        from safetensors.torch import load_file

        folder = Path(folder)
        if self.peft is not None:
            if not (folder / ADAPTER_DIR).is_dir():
                raise RuntimeError(f"value checkpoint {folder} has no {ADAPTER_DIR}/ but {LORA_KEY}.enabled is true: "
                                   "it was saved without LoRA")
            error = self.master.load(load_file(folder / MASTERS_FILE))
            if error:
                raise RuntimeError(f"value checkpoint {folder} does not match the model: {error}")
            self._load_state(folder)
            return
        if (folder / ADAPTER_DIR).is_dir():
            raise RuntimeError(f"value checkpoint {folder} holds LoRA adapters but {LORA_KEY}.enabled is false")
        backbone = {}
        for shard in sorted((folder / "model").glob("*.safetensors")):
            if shard.name != HEAD_FILE:
                backbone.update(load_file(shard))
        self.model.backbone.load_state_dict(backbone, strict=True)
        self.model.head.load_state_dict(load_file(folder / "model" / HEAD_FILE, device=str(self.device)), strict=True)
        if (folder / MASTERS_FILE).is_file():
            error = self.master.load(load_file(folder / MASTERS_FILE))
        else:  # an fp32 checkpoint: its weights are the masters
            error = self.master.load({f"backbone.{k}": v for k, v in backbone.items()}
                                     | {f"head.{k}": v for k, v in self.model.head.state_dict().items()})
        if error:
            raise RuntimeError(f"value checkpoint {folder} does not match the model: {error}")
        self._load_state(folder)

    def _load_state(self, folder: Path) -> None:

        self.optimizer.load_state_dict(load_state(folder, "optimizer"))
        self.scheduler.load_state_dict(load_state(folder, "scheduler"))
        apply_optimizer_config(self.optimizer, self.scheduler, self.cfg.optimizer)
        torch.set_rng_state(load_state(folder, "torch_rng"))

    def weights(self) -> dict[str, torch.Tensor]:
        """Every parameter by name (the fp32 masters), on CPU."""
        return self.master.state()

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last optimizer step's (summed, fp32) gradients by parameter name, on CPU."""
        return {name: m.grad.detach().to("cpu").clone()
                for name, m in zip(self.master.names, self.master.parameters()) if m.grad is not None}

    def ping(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ data parallelism
    def free_address(self) -> tuple[str, int]:
        # refit.buckets: loaded when the process group is set up
        from grpo_train.refit.buckets import free_address

        return free_address()

    def whereabouts(self) -> dict[str, object]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "rank": self.rank}

    def init_distributed(self, master_addr: str, port: int) -> None:
        """Join the value ranks' group (NCCL on CUDA, gloo on CPU); every rank calls it at once."""
        import torch.distributed as dist

        if self.world_size == 1:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{port}", rank=self.rank,
                                world_size=self.world_size)
