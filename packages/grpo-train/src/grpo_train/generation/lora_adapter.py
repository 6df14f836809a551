"""Engine side of `policy.dtensor_cfg.lora_cfg.refit: adapter`: pushed adapter tensors become a PEFT folder.

Job: the vLLM engine runs the checkpoint's base weights (never reloaded under this mode) with LoRA enabled;
each refit brings only the adapter tensors (`refit.tensors.iter_adapter_tensors`: peft's saved names,
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`). `AdapterFolders.write` checks them and writes
`adapter_config.json` + `adapter_model.safetensors` into a per-engine temporary folder, one sub-folder per
weight version (the previous one removed), because vLLM 0.32's `LoRARequest` carries a path only.
The generator then registers `LoRARequest(name, lora_int_id, path)` and passes it with every request.
Boundary: no vLLM import (the generator builds the request), no Ray; knows peft's file layout.

The adapter config is derived from what arrives, not from the trainer's peft object: `r` is lora_A's row
count, `target_modules` the module leaf names that carry an adapter (e.g. q_proj), `lora_alpha` the run's
configured alpha (given at engine start). The LoRA id is the weight version + 1 (vLLM needs ids > 0; the
first push of a run may be version 0 on an engine restart).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_train.config.schema.generation import VLLM_MAX_LORA_RANKS

if TYPE_CHECKING:
    import torch

PREFIX = "base_model.model."  # peft's saved names: the injected model under PeftModel's base_model.model
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def vllm_max_lora_rank(dim: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds a rank-`dim` adapter."""
    for rank in VLLM_MAX_LORA_RANKS:
        if rank >= dim:
            return rank
    raise ValueError(
        f"policy.dtensor_cfg.lora_cfg.dim: {dim} exceeds vLLM's largest max_lora_rank "
        f"{VLLM_MAX_LORA_RANKS[-1]}; set a smaller dim or refit: merged"
    )


def lora_int_id(version: int) -> int:
    return int(version) + 1


def adapter_config(named_tensors: dict[str, torch.Tensor], alpha: float, base_model: str) -> dict:
    """peft's adapter_config.json for these adapter tensors (see the module docstring); raises
    ValueError when they are not a LoRA adapter's A/B pairs in peft's saved names."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors.items():
        owner, _, leaf = name.removesuffix(".weight").rpartition(".")
        if not name.startswith(PREFIX) or leaf not in ("lora_A", "lora_B") or not name.endswith(".weight"):
            raise ValueError(
                f"refit: adapter got {name!r}, not a peft adapter tensor "
                f"({PREFIX}<module>.lora_A.weight / .lora_B.weight): a full-weight push reached an "
                "engine started for adapters"
            )
        modules.setdefault(owner, {})[leaf] = tensor
    if not modules:
        raise ValueError("refit: adapter got no adapter tensors")
    ranks = set()
    for owner, pair in modules.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"refit: adapter got {sorted(pair)} of {owner!r}; lora_A and lora_B come in pairs")
        ranks.update({int(pair["lora_A"].shape[0]), int(pair["lora_B"].shape[1])})
    if len(ranks) != 1:
        raise ValueError(f"refit: adapter got adapters of ranks {sorted(ranks)}; one rank expected")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": ranks.pop(),
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "target_modules": sorted({owner.rpartition(".")[2] for owner in modules}),
    }


class AdapterFolders:
    """One temporary folder per engine holding the current version's PEFT folder (older ones removed)."""

    def __init__(self, alpha: float, base_model: str) -> None:
        self.alpha, self.base_model = alpha, base_model
        self.root = Path(tempfile.mkdtemp(prefix="grpo-lora-adapter-"))
        self.current: Path | None = None

    def write(self, named_tensors: dict[str, torch.Tensor], version: int) -> Path:
        """The PEFT folder of this push; the previous version's folder is removed (vLLM has loaded it
        or will never ask for it again: every request after this push names the new id)."""
        from safetensors.torch import save_file

        config = adapter_config(named_tensors, self.alpha, self.base_model)
        target = self.root / f"v{int(version)}"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir()
        (target / CONFIG_FILE).write_text(json.dumps(config, indent=1))
        save_file({k: v.detach().to("cpu").contiguous() for k, v in named_tensors.items()}, str(target / WEIGHTS_FILE))
        if self.current is not None and self.current != target:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = target
        return target

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
