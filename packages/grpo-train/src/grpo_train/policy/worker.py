"""A policy worker: one HF causal LM replica that scores and trains on [B, S] batches.

It runs as a Ray actor (see `group.py`) but is a plain class, so tests can also drive it
in-process. It knows nothing of generation or environments: batches arrive as tensors.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

import grpo_kernels
from grpo_train.actor_group import run_optimizer_steps
from grpo_train.batch import batch_size, seq_mult_prob_error
from grpo_train.config.schema import LossConfig, PolicyConfig
from grpo_train.errors import NonFiniteLossError  # re-exported: its old home
from grpo_train.policy import fsdp, microbatch, reference_ahead
from grpo_train.policy.core import ADAPTER_DIR, MASTERS_FILE, STATE_FILES, WorkerCore, read_states
from grpo_train.policy.logprobs import packed_logprobs, sequence_logprobs
from grpo_train.policy.lora import apply_lora
from grpo_train.policy.moe_aux import RouterLogits
from grpo_train.policy.offload import move_parts
from grpo_train.policy.precision import cast_parameters, compute_tensors
from grpo_train.policy.tensor_parallel import apply_tensor_parallel

# Metrics of clipped_pg_loss that are min/max rather than partial sums.
_MIN_METRICS = ("ratio_min", "clipped_ratio_min")
_MAX_METRICS = ("ratio_max", "clipped_ratio_max", "max_seq_mult_prob_error")
# Tokenizer files of the source model that a checkpoint's model folder carries along, so that the
# folder loads alone (vLLM in `grpo eval --checkpoint` reads its tokenizer from the model folder).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Re-exported: checkpoint names the core (core.py) owns; MASTERS_FILE holds the fp32 masters of a
# mixed-precision run (model/ holds the compute dtype).
__all__ = [
    "ADAPTER_DIR",
    "MASTERS_FILE",
    "STATE_FILES",
    "TOKENIZER_FILES",
    "NonFiniteLossError",
    "PolicyWorker",
    "export_merged",
    "pg_loss_config",
    "read_checkpoint",
]


def export_merged(model: torch.nn.Module, merged: dict[str, torch.Tensor], folder: Path) -> None:
    """The merged weights (`refit.tensors.iter_refit_tensors` of a LoRA model: base names, tied
    weights once) as an HF model folder: config.json, generation config and safetensors."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for part in ("config", "generation_config"):  # the HF model's PretrainedConfig / GenerationConfig
        if (config := getattr(model, part, None)) is not None:
            config.save_pretrained(str(folder))
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in merged.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )


def read_checkpoint(folder: Path) -> dict:
    """A policy checkpoint folder (written by `PolicyWorker.save`) in memory: model weights
    (the fp32 masters of a mixed-precision run, else the HF safetensors), optimizer, scheduler
    and torch RNG state (state files, no pickle)."""
    from safetensors.torch import load_file

    model: dict[str, torch.Tensor] = {}
    if (folder / MASTERS_FILE).is_file():
        model = load_file(folder / MASTERS_FILE)
    else:
        for shard in sorted((folder / "model").glob("*.safetensors")):
            model.update(load_file(shard))
    return {"model": model, **read_states(folder)}


def pg_loss_config(cfg: LossConfig) -> grpo_kernels.PGLossConfig:
    """The kernel's loss config (LossConfig.loss_op_config: beta 0 when the KL is in the reward)."""
    return cfg.loss_op_config()


class PolicyWorker(WorkerCore):
    """The policy's own part of a rank (the rest is `WorkerCore`'s): logprobs of the current and
    the reference weights, the clipped policy-gradient loss (with the MoE auxiliary loss), FSDP2
    and tensor parallelism, offload for a colocated engine, and the refit senders."""

    metric_prefix, step_name = "", "training"
    min_metrics, max_metrics = _MIN_METRICS, _MAX_METRICS
    cfg: PolicyConfig

    def __init__(
        self,
        model_path: str,
        policy_cfg: PolicyConfig,
        loss_cfg: LossConfig,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        num_threads: int | None = None,
    ):
        from transformers import AutoModelForCausalLM

        super().__init__(policy_cfg, seed + rank, rank, world_size, num_threads)
        self.loss_cfg = pg_loss_config(loss_cfg)
        # Tensor parallelism (policy/tensor_parallel.py): rank = dp_rank * tp_size + tp_rank (a dp x tp mesh);
        # the tp ranks of one dp group see the same rows, and gradients are reduced over dp only.
        # Context parallelism (policy/context_parallel.py), never with TP: a dp x cp mesh laid out alike; the
        # cp ranks of a dp group see the same rows and shard each row's tokens; gradients sum over cp, then dp.
        self.tp_size = policy_cfg.dtensor_cfg.tensor_parallel_size
        self.cp_size = policy_cfg.dtensor_cfg.context_parallel_size
        group = self.tp_size * self.cp_size
        self.dp_size, self.dp_rank = world_size // group, rank // group
        self.model_path = model_path
        self.temperature = policy_cfg.generation.temperature
        # fp32 masters, compute in policy.precision (precision.py, `WorkerCore._build_optimizer`);
        # the frozen reference computes alike.
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()
        self.reference = None
        # LoRA (policy/lora.py): adapters injected into self.model in place; self.peft wraps it for
        # disable_adapter (the reference: the same base weights, no copy) and save_pretrained.
        if policy_cfg.dtensor_cfg.lora_cfg.enabled:
            self.peft = apply_lora(self.model, policy_cfg.dtensor_cfg.lora_cfg, seed)
        elif loss_cfg.reference_policy_kl_penalty > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
            cast_parameters(self.reference, self.dtype)
        self._build_optimizer(self.dtype)
        self._router = None  # records router logits for the MoE load-balancing loss (moe_aux.py)
        if policy_cfg.moe_aux_loss_coeff > 0:
            self._router = RouterLogits(self.model)
        self._roots: dict[int, torch.nn.Module] = {}  # id(model) -> its FSDP2 root (fsdp.ForwardRoot)
        self._weight_group = None  # the collective weight transport's group (rank 0 only)
        self._home = torch.device("cpu")  # where this rank computes (its GPU once init_distributed moved it)
        self._offloaded: tuple[str, ...] = ()  # parts on the host for a colocated engine (offload)
        self._reusing_prev = False  # train(): prev logprobs taken from the training forward (reuses_prev)
        self._ahead = None  # train(): the reference forward beside training (reference_ahead.ReferenceAhead)

    # ----------------------------------------------------------------------------- scoring
    def _run(self, model: torch.nn.Module, fn, *args, **kwargs):
        """fn(model, *args): under FSDP2 as the forward of the model's root unit."""
        root = self._roots.get(id(model))
        return root(fn, *args, **kwargs) if root is not None else fn(model, *args, **kwargs)

    def _logprobs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self._cp_mesh is not None:  # the row's tokens sharded over cp, ring attention; full logprobs back
            # context_parallel (torch's ring attention internals): loaded only under context_parallel_size > 1
            from grpo_train.policy.context_parallel import cp_sequence_logprobs

            return self._run(
                model,
                cp_sequence_logprobs,
                batch["input_ids"],
                batch["attention_mask"],
                self.temperature,
                self._cp_mesh,
                fused=self.cfg.use_fused_kernels,
                chunk_size=self.cfg.logprob_chunk_size,
            )
        return self._run(
            model,
            sequence_logprobs,
            batch["input_ids"],
            batch["attention_mask"],
            self.temperature,
            fused=self.cfg.use_fused_kernels,
            chunk_size=self.cfg.logprob_chunk_size,
        )

    def _microbatch_logprobs(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], mb: microbatch.MicroBatch
    ) -> torch.Tensor:
        """[len(mb.rows), W] logprobs of one micro-batch's rows (W: its width, or its longest row packed)."""
        device = next(model.parameters()).device
        if not mb.packed:
            inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
            return self._logprobs(model, microbatch.rows_of(inputs, mb.rows, mb.width, device))
        packed = microbatch.pack_rows(batch["input_ids"], mb, device)
        flat = self._run(
            model,
            packed_logprobs,
            packed.input_ids,
            packed.position_ids,
            packed.cu_seqlens,
            packed.max_seqlen,
            self.temperature,
            fused=self.cfg.use_fused_kernels,
            chunk_size=self.cfg.logprob_chunk_size,
        )
        return microbatch.unpack_rows(flat, packed)

    def _planner(self, purpose: microbatch.Purpose) -> microbatch.Planner:
        return microbatch.make_planner(self.cfg, purpose)

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor], reference: bool = False) -> torch.Tensor:
        """[B, S] logprobs under the current (or the reference) weights, in logprob micro-batches.
        Under LoRA the reference is the policy with its adapters disabled."""
        if reference and self.peft is not None:
            with self.peft.disable_adapter():
                return self._logprobs_of(self.model, batch)
        model = self.reference if reference else self.model
        if model is None:
            raise ValueError("reference logprobs requested but loss_fn.reference_policy_kl_penalty is 0")
        return self._logprobs_of(model, batch)

    def _logprobs_of(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._forward_rows(batch, lambda rows, mb: self._microbatch_logprobs(model, rows, mb))

    @torch.no_grad()
    def logprobs_and_reference(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[2, B, S]: `logprobs` under the current weights, then under the reference weights, in
        one call (the step's prev and ref logprobs in one round trip)."""
        return torch.stack([self.logprobs(batch), self.logprobs(batch, reference=True)])

    @torch.no_grad()
    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """Logprobs of sequences[i][prompt_lens[i]:] under the current weights (refit probe),
        through the same micro-batches (padded, dynamic or packed) as training."""
        S = max(len(s) for s in sequences)
        input_ids = torch.zeros(len(sequences), S, dtype=torch.long)
        attention_mask = torch.zeros(len(sequences), S, dtype=torch.long)
        for i, seq in enumerate(sequences):
            input_ids[i, : len(seq)] = torch.tensor(seq)
            attention_mask[i, : len(seq)] = 1
        lp = self.logprobs({"input_ids": input_ids, "attention_mask": attention_mask})
        return [lp[i, plen : len(seq)].tolist() for i, (seq, plen) in enumerate(zip(sequences, prompt_lens))]

    # ---------------------------------------------------------------------------- training
    def train(
        self,
        batch: dict[str, torch.Tensor],
        global_valid_tokens: list[float] | None = None,
        global_valid_seqs: list[float] | None = None,
    ) -> dict[str, float]:
        """Optimizer steps over `batch` (train_global_batch_size samples each, in micro-batches).

        `batch` must hold prev_logprobs (and ref_logprobs when beta > 0). The global counts are
        per optimizer step over all data-parallel ranks; computed locally for one worker.
        """
        per_step = self.cfg.train_global_batch_size // self.dp_size
        self._reusing_prev = False
        if "prev_logprobs" not in batch:  # the driver left prev to us (train_step.reuses_prev_logprobs)
            if self.reuses_prev(batch, per_step):
                self._reusing_prev = True
            else:  # the separate pass, here before any optimizer step: the start-of-step weights
                batch = {**batch, "prev_logprobs": self.logprobs(batch)}
        if self._reference_left_to_us(batch):  # ref too (train_step.add_logprobs): beside training, or first
            self._ahead = self._reference_ahead(batch, per_step)
            if self._ahead is None:
                batch = {**batch, "ref_logprobs": self.logprobs(batch, reference=True)}
        try:
            return run_optimizer_steps(batch, per_step, global_valid_tokens, global_valid_seqs, self._optimizer_step)
        finally:
            self._reusing_prev = False
            if self._ahead is not None:
                self._ahead.close()
                self._ahead = None

    def _reference_left_to_us(self, batch: dict[str, torch.Tensor]) -> bool:
        return "ref_logprobs" not in batch and (
            self.reference is not None or (self.peft is not None and self.loss_cfg.reference_policy_kl_penalty > 0)
        )

    def _reference_ahead(self, batch: dict[str, torch.Tensor], per_step: int):
        """The reference forward in a second thread beside training (policy/reference_ahead.py),
        where policy.reference_beside_training and its conditions allow, else None."""
        reference = self.reference
        if not (self.cfg.reference_beside_training and batch_size(batch) == per_step):
            return None
        plan = self._plan(batch, "logprob")[2]
        if reference is None or not reference_ahead.usable(self.world_size, True, plan, self._plan(batch, "train")[2]):
            return None
        return reference_ahead.start(
            plan,
            lambda mb: self._microbatch_logprobs(reference, batch, mb),
            (batch_size(batch), batch["input_ids"].shape[1]),
        )

    def reuses_prev(self, batch: dict[str, torch.Tensor], per_step: int) -> bool:
        """Whether the training forward's logprobs (detached) are bitwise the `logprobs(batch)` a
        separate pass would give: the whole batch in ONE optimizer step on one rank, so every
        micro-batch runs under the start-of-step weights; the logprob and train planners cut the
        same micro-batches (same rows, widths and packing: the same matmul shapes); and no
        dropout draws a different mask in each forward."""
        if self.world_size != 1 or batch_size(batch) != per_step:
            return False
        if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()):
            return False
        if float(getattr(self.model.config, "attention_dropout", 0.0) or 0.0) > 0:
            return False
        return self._plan(batch, "logprob")[2] == self._plan(batch, "train")[2]

    def _train_forward(self, batch: dict[str, torch.Tensor], mb: microbatch.MicroBatch) -> torch.Tensor:
        return self._microbatch_logprobs(self.model, batch, mb)

    def _microbatch_loss(
        self, batch: dict[str, torch.Tensor], plan: microbatch.MicroBatch, global_tokens: float, global_seqs: float
    ) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        """clipped_pg_loss of one micro-batch (plus the MoE auxiliary loss); metrics in
        `WorkerCore._optimizer_step`'s merge (min / max for _MIN_METRICS / _MAX_METRICS)."""
        with self._router.capture() if self._router is not None else contextlib.nullcontext():
            curr = self._microbatch_logprobs(self.model, batch, plan)  # [rows, W]
        mb = microbatch.rows_of(batch, plan.rows, curr.shape[1], curr.device)
        if self._ahead is not None:  # this micro-batch's reference logprobs, computed beside its forward
            self._ahead.wait_for(plan)
            mb["ref_logprobs"] = microbatch.rows_of({"ref": self._ahead.out}, plan.rows, curr.shape[1], curr.device)[
                "ref"
            ]
        metrics: dict[str, float | torch.Tensor] = {}
        if self._reusing_prev:  # on-policy, one optimizer step: prev is this forward's logprobs
            mb["prev_logprobs"] = curr.detach()  # [rows, W] fp32, as logprobs() stores them
            metrics["max_seq_mult_prob_error"] = self._seq_prob_error(batch, plan, mb["prev_logprobs"])
        loss, m = grpo_kernels.clipped_pg_loss(
            curr,
            mb["prev_logprobs"],
            mb["gen_logprobs"],
            mb.get("ref_logprobs"),
            mb["advantages"],
            mb["token_mask"],
            mb["sample_mask"],
            self.loss_cfg,
            global_tokens,
            global_seqs,
        )
        if self._router is not None:
            aux = self._router.aux_loss(self._router_mask(batch, plan, mb, curr.device))
            # a row-weighted mean over the step's micro-batches (summed over ranks like the loss)
            term = self.cfg.moe_aux_loss_coeff * aux * len(plan.rows) / self.cfg.train_global_batch_size
            loss = loss + term
            m = {**m, "moe_aux_loss": float(term.detach())}
        # m's own "loss" is left out: the step's loss is the one returned (counting both reported 2x the loss)
        return loss, {**metrics, "loss": loss.detach(), **{k: v for k, v in m.items() if k != "loss"}}

    @staticmethod
    def _seq_prob_error(batch: dict[str, torch.Tensor], mb: microbatch.MicroBatch, prev: torch.Tensor) -> float:
        """The largest seq_mult_prob_error of the micro-batch's rows, on the rows at the batch's
        full width (as `train_step.add_advantages` computes it when prev comes from its own pass)."""
        rows = torch.tensor(mb.rows, dtype=torch.long)
        full = torch.zeros(len(mb.rows), batch["input_ids"].shape[1])
        full[:, : prev.shape[1]] = prev.float().cpu()
        err = seq_mult_prob_error(
            {
                "prev_logprobs": full,
                "gen_logprobs": batch["gen_logprobs"].index_select(0, rows),
                "token_mask": batch["token_mask"].index_select(0, rows),
            }
        )
        return float(err.max())

    @staticmethod
    def _router_mask(
        batch: dict[str, torch.Tensor], mb: microbatch.MicroBatch, rows: dict[str, torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        """The attention mask of the forward the router logits came from: the rows' mask, or for a
        packed stream [1, T] with the padding tail left out."""
        if not mb.packed:
            return rows["attention_mask"]
        packed = microbatch.pack_rows(batch["input_ids"], mb, device)
        mask = torch.zeros(1, packed.input_ids.shape[0], dtype=torch.long, device=device)
        mask[:, : int(packed.cu_seqlens[packed.num_rows])] = 1
        return mask

    # ------------------------------------------------------------------- weights and state
    def weights(self) -> dict[str, torch.Tensor]:
        """HF-named contiguous CPU tensors for the generator (tied weights appear once), in the
        compute dtype. Under `lora_cfg.refit: adapter` only the adapter tensors, in peft's saved names
        (`refit.tensors.iter_adapter_tensors`): the engine keeps the checkpoint's base weights."""
        # the object_store transport's code, loaded when that transport pulls the weights
        from grpo_train.refit.object_store import send_object_store

        if self.peft is not None and self.cfg.dtensor_cfg.lora_cfg.refit == "adapter":
            # refit.tensors: loaded at the first refit
            from grpo_train.refit.tensors import iter_adapter_tensors

            return send_object_store(compute_tensors(iter_adapter_tensors(self.model), self.dtype))
        return send_object_store(self._refit_tensors())

    def _refit_tensors(self, gather: bool = True):
        """What a refit pushes: `refit.tensors.iter_refit_tensors` in the compute dtype (under
        FSDP2 the gathered tensors are the fp32 masters; unsharded, the compute copy already is)."""
        # refit.tensors: loaded at the first refit
        from grpo_train.refit.tensors import iter_refit_tensors

        return compute_tensors(iter_refit_tensors(self.model, gather=gather), self.dtype)

    def save(self, folder: str | Path) -> None:
        """Rank 0 writes the full model (HF safetensors in the compute dtype), the fp32 masters
        when they differ from it (`MASTERS_FILE`), optimizer, scheduler and RNG state.
        Every rank calls it: under FSDP2 the ranks gather the full tensors together, so a
        sharded checkpoint has the unsharded format (and `grpo eval --checkpoint` reads it).
        Atomicity is the caller's folder (CheckpointManager writes into a temporary one)."""
        keep = self.rank == 0
        if self.peft is not None:
            return self._save_lora(Path(folder), keep)
        masters = fsdp.full_model_state(self.model) if self._sharded else self.master.state()
        optimizer_state = (
            fsdp.full_optimizer_state(self.optimizer, keep) if self._sharded else self.optimizer.state_dict()
        )
        if not keep:
            return
        folder = Path(folder)
        model_state = dict(compute_tensors(masters.items(), self.dtype)) if self._sharded else None
        self.model.save_pretrained(folder / "model", state_dict=model_state, safe_serialization=True)
        if self.dtype != torch.float32:
            self._save_masters(folder, masters)
        self._copy_tokenizer(folder / "model")
        self._save_states(folder, optimizer_state)

    def _save_lora(self, folder: Path, keep: bool) -> None:
        """A LoRA checkpoint: the adapters in PEFT format (`ADAPTER_DIR`, loadable with
        `PeftModel.from_pretrained` on the base model), their fp32 masters (`MASTERS_FILE`, what
        resume reads), optimizer, scheduler and RNG state, and under model/ the merged HF model
        in the compute dtype (what `grpo eval --checkpoint` and a vLLM engine load: the export)."""
        if self._sharded:
            masters = {k: v for k, v in fsdp.full_model_state(self.model).items() if k in set(self.master.names)}
        else:
            masters = self.master.state()
        optimizer_state = (
            fsdp.full_optimizer_state(self.optimizer, keep) if self._sharded else self.optimizer.state_dict()
        )
        merged = dict(self._refit_tensors())  # collective under FSDP2: every rank iterates
        if not keep:
            return
        self._save_adapters(folder, masters)
        self._save_masters(folder, masters)
        export_merged(self.model, merged, folder / "model")
        self._copy_tokenizer(folder / "model")
        self._save_states(folder, optimizer_state)

    def _copy_tokenizer(self, folder: Path) -> None:
        import shutil

        for name in TOKENIZER_FILES:
            if (Path(self.model_path) / name).is_file():
                shutil.copyfile(Path(self.model_path) / name, folder / name)

    def load(self, folder: str | Path) -> None:
        """Load a checkpoint, whichever layout saved it. Unsharded: every rank reads it. FSDP2:
        rank 0 reads it and scatters it, so only rank 0 needs the folder and holds full tensors."""
        folder = Path(folder)
        if not self._sharded:
            ckpt = read_checkpoint(folder)
            unexpected = sorted(ckpt["model"].keys() - self.model.state_dict().keys())
            error = self.master.load(ckpt["model"]) if not unexpected else f"unexpected {unexpected}"
            if not error:  # persistent buffers, if the model has any (the parameters are the masters' cast)
                self.model.load_state_dict(
                    {k: v for k, v in ckpt["model"].items() if k not in self.master.names}, strict=False
                )
            if error:
                raise RuntimeError(f"checkpoint {folder} does not match the model: {error}")
            self._restore_states(ckpt)
        else:  # the optimizer's shards are loaded by the scatter
            self._restore_states(
                self._scatter_checkpoint(read_checkpoint(folder) if self.rank == 0 else None, folder), optimizer=False
            )

    def _scatter_checkpoint(self, ckpt: dict | None, folder: Path) -> dict:
        """Rank 0's checkpoint (None on the other ranks) into every rank's shards. Rank 0 checks
        it first and broadcasts the verdict, so a bad checkpoint fails on every rank (no rank is
        left waiting in a collective). Returns the small parts (scheduler, RNG) on every rank."""
        header = None
        if ckpt is not None:
            skeleton = fsdp.optimizer_skeleton(self.optimizer, ckpt["optimizer"])
            error = fsdp.model_state_mismatch(self.model, ckpt["model"], self.peft is not None) or (
                skeleton if isinstance(skeleton, str) else None
            )
            header = {"error": error, "optimizer": skeleton, "scheduler": ckpt["scheduler"], "rng": ckpt["rng"]}
        header = fsdp.broadcast_object(header)
        if header["error"]:
            raise RuntimeError(f"checkpoint {folder} does not match the model: {header['error']}")
        fsdp.scatter_model_state(self.model, ckpt["model"] if ckpt is not None else {}, strict=self.peft is None)
        self.optimizer.load_state_dict(
            fsdp.scatter_optimizer_state(
                self.optimizer, header["optimizer"], ckpt["optimizer"] if ckpt is not None else None
            )
        )
        return header

    # ------------------------------------------- colocated memory choreography (colocation.py)
    def offload(self, parts: tuple[str, ...]) -> None:
        """Move `parts` (policy.offload.PARTS) of this rank's state to the host and hand the freed
        blocks back to the driver (`torch.cuda.empty_cache`), so a colocated engine can wake into
        them. A rank that computes on the host (every CPU run) has nothing to move."""
        todo = tuple(p for p in parts if p not in self._offloaded)
        if self._home.type != "cpu":
            move_parts(todo, "cpu", self.model, self.master.parameters(), self.optimizer, self.reference)
            torch.cuda.empty_cache()
        self._offloaded += todo

    def reload(self) -> None:
        """What `offload` moved, back on this rank's device."""
        if self._home.type != "cpu":
            move_parts(
                self._offloaded,
                self._home,
                self.model,
                self.master.parameters(),
                self.optimizer,
                self.reference,
                offloading=False,
            )
        self._offloaded = ()

    # ------------------------------------------------- data parallelism and weight transports
    # Called by grpo_train.policy.group (one Ray actor per rank) and the transports of grpo_train.refit.
    def init_distributed(self, master_addr: str, port: int) -> bool:
        """Join the process group (NCCL on GPUs, gloo on CPU); under `dtensor_cfg.tensor_parallel_size`
        > 1 build the dp x tp mesh and tensor-parallelize the model over tp (`_tensor_parallel`); and,
        as `dtensor_cfg.enabled` says (`fsdp.uses_fsdp`, counted in dp ranks), shard it with FSDP2 over
        dp. Every rank calls it at once; returns whether this rank's parameters are DTensors."""

        if self.cfg.dtensor_cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable()
            if self.peft is not None:  # frozen embeddings: checkpointed layers need an input that requires grad
                self.model.enable_input_require_grads()
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            self._home = torch.device("cuda", torch.cuda.current_device())
        if self.world_size == 1 and not on_gpu:
            return False
        self._join_process_group(master_addr, port, "nccl" if on_gpu else "gloo")
        device_type = "cuda" if on_gpu else "cpu"
        dp_mesh = None
        shards = fsdp.uses_fsdp(self.cfg.dtensor_cfg, on_gpu, self.dp_size)
        if self.tp_size > 1:
            dp_mesh = self._tensor_parallel(device_type, masters_dtype=torch.float32 if shards else self.dtype)
        if self.cp_size > 1:
            dp_mesh = self._context_parallel(device_type, shards)
        if shards:
            self._shard(device_type, dp_mesh)
        elif on_gpu:  # dtensor_cfg.enabled: false on GPUs: full replicas, each on its rank's GPU
            device = torch.device("cuda", torch.cuda.current_device())
            for model in (self.model, self.reference):
                if model is not None:
                    model.to(device)  # in place: the optimizer (no state yet) keeps the same parameters
        return self._sharded

    def _tensor_parallel(self, device_type: str, masters_dtype: torch.dtype):
        """The dp x tp mesh; the model and the reference tensor-parallel over its tp dimension
        (`tensor_parallel.apply_tensor_parallel`, in fp32: the masters are the TP shards). Returns
        the dp sub-mesh (FSDP2 shards over it; without FSDP2 the gradients are summed over its group)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (self.dp_size, self.tp_size), mesh_dim_names=("dp", "tp"))
        self._dp_group = mesh["dp"].get_group()
        dcfg = self.cfg.dtensor_cfg
        self.master.release()  # fp32 parameters: TP shards them as they are
        for model in (self.model, self.reference):
            if model is not None:
                if device_type == "cuda":
                    torch.nn.Module.to(model, torch.device("cuda", torch.cuda.current_device()))
                apply_tensor_parallel(model, mesh["tp"], dcfg.sequence_parallel, dcfg.custom_parallel_plan)
        # fp32 masters over the TP shards; the compute dtype's copy unless FSDP2 follows (its mixed precision)
        self._build_optimizer(masters_dtype)
        self._sharded = True
        return mesh["dp"]

    def _context_parallel(self, device_type: str, shards: bool):
        """The dp x cp mesh (policy/context_parallel.py): the model and the reference keep full
        weights; their forwards shard each row's tokens over cp. Returns the dp sub-mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        # context_parallel (torch's ring attention internals): loaded only under context_parallel_size > 1
        from grpo_train.policy.context_parallel import register_cpu_ring_attention, use_cp_attention

        if shards:  # refused by the config for a set `enabled`; null shards on GPUs
            raise ValueError(
                "policy.dtensor_cfg.context_parallel_size > 1 with FSDP2 is not supported (untested); "
                "set policy.dtensor_cfg.enabled: false"
            )
        mesh = init_device_mesh(device_type, (self.dp_size, self.cp_size), mesh_dim_names=("dp", "cp"))
        self._dp_group, self._cp_mesh = mesh["dp"].get_group(), mesh["cp"]
        register_cpu_ring_attention()
        for model in (self.model, self.reference):
            if model is not None:
                use_cp_attention(model)
        return mesh["dp"]

    def _shard(self, device_type: str, mesh=None) -> None:
        """FSDP2 over a 1-D mesh of all ranks (under TP: the dp sub-mesh), the same on GPUs and
        CPUs (`fsdp.shard`); the reference model is sharded too. Only the device and the mesh's
        backend differ."""
        from torch.distributed.device_mesh import init_device_mesh

        if device_type == "cuda":
            self.model.to(torch.device("cuda", torch.cuda.current_device()))
        if mesh is None:
            mesh = init_device_mesh(device_type, (self.world_size,))
        self.master.release()  # the module back in fp32: FSDP2's shards are the masters
        for model in (self.model, self.reference):
            if model is not None:
                model.to(self.model.device)
                offload = self.cfg.dtensor_cfg.cpu_offload and device_type == "cuda"  # CPU ranks are there already
                self._roots[id(model)] = fsdp.shard(model, mesh, offload, self.dtype)
        # The optimizer must hold the sharded parameters; it has no state yet.
        self._build_optimizer(torch.float32)
        self._sharded = self._fsdp = True

    def collective_backend(self) -> str:
        return "nccl" if torch.cuda.is_available() else "gloo"

    def weight_metadata(self) -> list:
        # the collective/ipc transports' code, loaded when that transport is used
        from grpo_train.refit.metas import tensor_metadata

        return tensor_metadata(self._refit_tensors(gather=False))

    def open_collective(self, host: str, port: int, world_size: int, backend: str) -> None:
        """Rank 0 only: join the collective weight transport's group as its source (rank 0)."""
        # the collective/ipc transports' code, loaded when that transport is used
        from grpo_train.refit import collective

        self._weight_group = collective.open_collective_sender(host, port, world_size, backend)

    def send_collective(self, bucket_bytes: int) -> int:
        """Broadcast the weights in buckets (rank 0); under FSDP2 the other ranks call it too, to
        take part in gathering each full tensor. Returns the number of buckets sent."""
        # the collective/ipc transports' code, loaded when that transport is used
        from grpo_train.refit import collective

        device = self.model.device if self.collective_backend() == "nccl" else torch.device("cpu")
        return collective.send_collective(self._weight_group, self._refit_tensors, bucket_bytes, device)

    def send_ipc(self) -> dict[str, list]:
        """GPU-only (colocated): CUDA IPC handles of the full weights on this rank's device, keyed
        by the device's UUID so that the vLLM worker on the same GPU picks them."""
        # the collective/ipc transports' code, loaded when that transport is used
        from grpo_train.refit import ipc

        self._ipc_tensors, handles = ipc.send_ipc(self._refit_tensors())  # kept alive while engines map them
        return handles
