"""`logger`, `cluster`, `checkpointing`: where the run happens and what it leaves behind."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from grpo_train.config.schema.base import Section


class WandbConfig(Section):
    project: str = "grpo"
    name: str | None = None
    """Run name; null: derived from the run folder."""


class LoggerConfig(Section):
    log_dir: str = "runs"
    """Parent folder of run folders (logs, plots, checkpoints)."""
    console_enabled: bool = True
    """Progress bar and one compact line per step."""
    wandb_enabled: bool = False
    """wandb (offline mode when there is no network)."""
    tensorboard_enabled: bool = False
    plot_enabled: bool = True
    """Write a PNG of reward, accuracy and KL at the end of the run."""
    num_val_samples_to_print: int = Field(default=0, ge=0)
    wandb: WandbConfig = WandbConfig()
    tensorboard: dict[str, Any] = {}


class ClusterConfig(Section):
    gpus_per_node: int = Field(default=0, ge=0)
    """GPUs per node (0 on CPU machines)."""
    num_nodes: int = Field(default=1, ge=1)
    address: str | None = None
    """Ray cluster address; null: RAY_ADDRESS or a local Ray."""
    num_cpus: int | None = None
    """CPUs the local Ray may use; null: all."""
    gpu_memory_gb: float | None = Field(default=None, gt=0)
    """Memory of each GPU: `grpo train` refuses a placement plan that does not fit it (grpo_train.plan;
    `grpo plan` prints the plan); null: the plan's GPU count is checked, its memory is not."""


class CheckpointingConfig(Section):
    enabled: bool = True
    checkpoint_dir: str | None = None
    """Folder of step_N checkpoints; null: <run folder>/checkpoints."""
    metric_name: str | None = "val_accuracy"
    higher_is_better: bool = True
    keep_top_k: int | None = Field(default=3, ge=1)
    save_period: int = Field(default=10, ge=1)
    checkpoint_must_save_by: str | None = None
    """Time budget of the training loop, "DD:HH:MM:SS" or "HH:MM:SS" (NeMo RL's semantics: counted from
    the start of the loop; a Slurm job's limit minus start-up). After each step, when the next step
    (estimated as the longest step so far) would end past it, a checkpoint is saved and the run exits 0;
    the same command resumes it. null: no budget."""

    @field_validator("checkpoint_must_save_by")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None:
            parse_duration(value)
        return value

    @model_validator(mode="after")
    def _deadline_saves(self) -> CheckpointingConfig:
        if self.checkpoint_must_save_by is not None and not self.enabled:
            raise ValueError(
                "checkpoint_must_save_by saves a checkpoint before the budget ends; it needs "
                "checkpointing.enabled: true (or set checkpoint_must_save_by: null)"
            )
        return self


def parse_duration(text: str) -> float:
    """Seconds of "DD:HH:MM:SS", "HH:MM:SS" (or fewer fields: "MM:SS", "SS"); ValueError otherwise."""
    parts = str(text).split(":")
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        numbers = []
    if not 1 <= len(parts) <= 4 or len(numbers) != len(parts) or any(n < 0 for n in numbers):
        raise ValueError(f'expected a duration "DD:HH:MM:SS" or "HH:MM:SS", got {text!r}')
    seconds = 0.0
    for unit, n in zip((86400, 3600, 60, 1)[-len(numbers) :], numbers):
        seconds += unit * n
    return seconds
