"""What a run must save to resume exactly, and how it is saved and restored.

A checkpoint folder holds the policy (weights, optimizer, scheduler, its torch RNG), PPO's
value model likewise (`value/`, via `extra_workers`), the dataloader position, the driver's
RNG states and `trainer_state.json`. The generator's weights are not saved: they are the
policy's, pushed again on resume. Every state file is a safetensors + JSON pair (`state_io`):
nothing in a checkpoint is unpickled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from grpo_train.checkpoint import CheckpointManager, load_rng_state, save_rng_state
from grpo_train.state_io import load_state, save_state


@dataclass
class TrainerState:
    step: int = 0  # GRPO steps completed
    weight_version: int = 0  # refits pushed to the generator
    consumed_prompts: int = 0
    epoch: int = 0
    best_metric: float | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TrainerState:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def save_checkpoint(
    manager,
    parts,
    state: TrainerState,
    metrics: dict[str, float] | None,
    extra_workers: dict | None = None,
    extra_files: dict | None = None,
) -> Path:
    """`extra_workers` (folder name -> actor with save/load, e.g. PPO's {"value": ...}) are saved beside the policy.
    `extra_files` (file stem -> object) are saved as state files `<stem>.{json,safetensors}`; the async loop's
    replay buffer and collector, whose "dataloader" (the collector's position) replaces the driver's."""

    def write(folder: Path) -> None:
        parts.policy.save(str(folder / "policy"))
        for name, group in (extra_workers or {}).items():
            group.save(str(folder / name))
        for stem, obj in {"dataloader": parts.train_data.state_dict(), **(extra_files or {})}.items():
            save_state(obj, folder, stem)
        save_rng_state(folder)

    return manager.save(state.step, write, state.to_json(), metrics)


def restore_checkpoint(folder: Path, parts, extra_workers: dict | None = None) -> TrainerState:
    """Load checkpoint `folder` (already checked against its manifest) into the run's parts."""
    parts.policy.load(str(folder / "policy"))
    for name, group in (extra_workers or {}).items():
        group.load(str(folder / name))
    parts.train_data.load_state_dict(load_state(folder, "dataloader"))
    load_rng_state(folder)
    return TrainerState.from_json(CheckpointManager.load_trainer_state(folder))
