"""The value model and its worker: a causal LM backbone with a scalar head, trained on [B, S] batches.

Like `PolicyWorker`, a plain class run as a Ray actor (tests may drive it in-process); N of them
form a data-parallel `ValueGroup` (value_group.py). What it shares with the policy's ranks (fp32
masters, optimizer and scheduler, the micro-batch loops, checkpoint state files, the process
group) is `policy.core.WorkerCore`'s; it keeps the value model, its planners' keys, the value loss
and its checkpoint's model files. It knows nothing of generation, environments or the policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from grpo_train.actor_group import run_optimizer_steps
from grpo_train.config.schema import ValueConfig, ValueLossConfig
from grpo_train.policy import microbatch
from grpo_train.policy.core import ADAPTER_DIR, MASTERS_FILE, WorkerCore, read_states
from grpo_train.policy.logprobs import packed_hidden_states
from grpo_train.ppo.value_loss import value_loss_fn

# MASTERS_FILE and ADAPTER_DIR (value.lora_cfg: the backbone's adapters in PEFT format) are the core's.
__all__ = ["ADAPTER_DIR", "HEAD_FILE", "LORA_KEY", "MASTERS_FILE", "ValueModel", "ValueWorker", "value_planner"]
HEAD_FILE = "value_head.safetensors"
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
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state[
            :, :-1
        ]  # [B, S-1, H]
        values = self.head(hidden).squeeze(-1).float()  # [B, S-1]
        return F.pad(values, (1, 0)) * attention_mask  # [B, S]

    def forward_packed(self, packed: microbatch.PackedRows) -> torch.Tensor:
        """The same values for a packed stream's rows: [n, longest row], 0 past each row's end."""
        hidden = packed_hidden_states(
            self.backbone, packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen
        )  # [T, H]
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
        return microbatch.SequencePacking(
            getattr(packing, field), packing.sequence_length_round, f"value.sequence_packing.{field}", packing.algorithm
        )
    if dynamic.enabled:
        return microbatch.DynamicBatching(
            getattr(dynamic, field), dynamic.sequence_length_round, f"value.dynamic_batching.{field}"
        )
    return microbatch.PaddedRows(cfg.train_micro_batch_size if purpose == "train" else cfg.inference_batch_size)


class ValueWorker(WorkerCore):
    """The value's own part of a rank (the rest is `WorkerCore`'s): the value model, its values and
    the clipped value loss; plain data parallelism (no FSDP2 or TP)."""

    metric_prefix, step_name = "value_", "value"
    # No collectives inside the value model's forward/backward: ranks need not agree on micro-batch counts.
    lockstep_microbatches = False
    cfg: ValueConfig

    def __init__(
        self,
        model_path: str,
        cfg: ValueConfig,
        loss_cfg: ValueLossConfig,
        global_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        num_threads: int | None = None,
        device: str = "cpu",
    ):
        super().__init__(
            cfg, seed, rank, world_size, num_threads
        )  # the same seed on every rank: replicas start identical
        self.loss_cfg = loss_cfg
        self.global_batch_size = global_batch_size  # samples per optimizer step, over all ranks
        # The device comes from the caller (the cluster config), not from what is visible: Ray
        # leaves GPUs visible to actors that asked for none.
        self.device = torch.device(device)
        # fp32 masters, compute in value.precision: the policy's mixed precision (precision.py).
        self.model = ValueModel(model_path, torch.float32).to(self.device)
        self.model.train()
        # value.lora_cfg: peft adapters injected into the backbone in place (its base weights frozen);
        # the head is outside peft and trains in full. self.peft wraps the backbone for save_pretrained.
        if cfg.lora_cfg.enabled:
            from grpo_train.policy.lora import apply_lora  # peft: imported only for a LoRA value model

            self.peft = apply_lora(self.model.backbone, cfg.lora_cfg, seed, task_type=None, key=LORA_KEY)
        self._build_optimizer(self.dtype)

    def _planner(self, purpose: microbatch.Purpose) -> microbatch.Planner:
        return value_planner(self.cfg, purpose)

    def _microbatch_values(self, batch: dict[str, torch.Tensor], mb: microbatch.MicroBatch) -> torch.Tensor:
        """[len(mb.rows), W] values of one micro-batch's rows (W: its width, or its longest row packed)."""
        if mb.packed:
            return self.model.forward_packed(microbatch.pack_rows(batch["input_ids"], mb, self.device))
        inputs = microbatch.rows_of(
            {k: batch[k] for k in ("input_ids", "attention_mask")}, mb.rows, mb.width, self.device
        )
        return self.model(inputs["input_ids"], inputs["attention_mask"])

    _train_forward = _microbatch_values

    @torch.no_grad()
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, S] V(x_<t) under the current weights, in inference micro-batches (eval mode: no
        dropout, e.g. value.lora_cfg.dropout, in the rollout's values)."""
        self.model.eval()
        try:
            return self._forward_rows(batch, self._microbatch_values)
        finally:
            self.model.train()

    def train(
        self,
        batch: dict[str, torch.Tensor],
        global_valid_tokens: list[float] | None = None,
        global_valid_seqs: list[float] | None = None,
    ) -> dict[str, float]:
        """Optimizer steps over `batch`, which holds `values` (at rollout time) and `returns`.

        The global counts are per optimizer step over all data-parallel ranks (this rank holds
        global_batch_size / world_size rows of each step); computed locally for one worker.
        """
        per_step = max(1, self.global_batch_size // self.world_size)
        return run_optimizer_steps(batch, per_step, global_valid_tokens, global_valid_seqs, self._optimizer_step)

    def _microbatch_loss(
        self, batch: dict[str, torch.Tensor], mb: microbatch.MicroBatch, global_tokens: float, global_seqs: float
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        values = self._microbatch_values(batch, mb)  # [rows, W]
        x = microbatch.rows_of(batch, mb.rows, values.shape[1], self.device)
        loss, m = value_loss_fn(
            values,
            x["values"],
            x["returns"],
            x["token_mask"],
            x["sample_mask"],
            self.loss_cfg,
            global_tokens,
            global_seqs,
        )
        return loss, {"value_loss": loss.detach(), **m}

    # ------------------------------------------------------------------- weights and state
    def save(self, folder: str | Path) -> None:
        """Weights (HF backbone + head safetensors in the compute dtype, and the fp32 masters
        when they differ; under value.lora_cfg the trained parameters only: `_save_lora`),
        optimizer, scheduler, RNG. One rank saves."""
        folder = Path(folder)
        if self.peft is not None:
            self._save_lora(folder)
        else:
            self.model.backbone.save_pretrained(folder / "model", safe_serialization=True)
            self._save_head(folder)
            if self.master.mixed:
                self._save_masters(folder, self.master.state())
        self._save_states(folder, self.optimizer.state_dict())

    def _save_head(self, folder: Path) -> None:
        from safetensors.torch import save_file

        (folder / "model").mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in self.model.head.state_dict().items()}, str(folder / "model" / HEAD_FILE)
        )

    def _save_lora(self, folder: Path) -> None:
        """value.lora_cfg: the trained parameters only (the base backbone is the model path's):
        their fp32 masters (`MASTERS_FILE`, what resume reads: adapters and head), the adapters in
        PEFT format (`ADAPTER_DIR`, `PeftModel.from_pretrained(AutoModel..., folder/ADAPTER_DIR)`)
        and the head in the compute dtype under model/."""
        masters = self.master.state()
        self._save_masters(folder, masters)
        self._save_adapters(folder, masters, prefix="backbone.")
        self._save_head(folder)

    def load(self, folder: str | Path) -> None:
        """What `save` wrote; every rank loads the same files."""
        from safetensors.torch import load_file

        folder = Path(folder)
        if self.peft is not None:
            if not (folder / ADAPTER_DIR).is_dir():
                raise RuntimeError(
                    f"value checkpoint {folder} has no {ADAPTER_DIR}/ but {LORA_KEY}.enabled is true: "
                    "it was saved without LoRA"
                )
            error = self.master.load(load_file(folder / MASTERS_FILE))
            if error:
                raise RuntimeError(f"value checkpoint {folder} does not match the model: {error}")
            self._restore_states(read_states(folder))
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
            error = self.master.load(
                {f"backbone.{k}": v for k, v in backbone.items()}
                | {f"head.{k}": v for k, v in self.model.head.state_dict().items()}
            )
        if error:
            raise RuntimeError(f"value checkpoint {folder} does not match the model: {error}")
        self._restore_states(read_states(folder))

    def weights(self) -> dict[str, torch.Tensor]:
        """Every parameter by name (the fp32 masters), on CPU."""
        return self.master_weights()

    # ------------------------------------------------------------------ data parallelism
    def init_distributed(self, master_addr: str, port: int) -> None:
        """Join the value ranks' group (NCCL on CUDA, gloo on CPU); every rank calls it at once."""
        if self.world_size > 1:
            self._join_process_group(master_addr, port, "nccl" if self.device.type == "cuda" else "gloo")
