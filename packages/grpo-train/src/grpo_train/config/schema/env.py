"""`env`: one section per environment (registered name, `class` or `reward_fn`, plus its own settings)."""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator, model_validator

from grpo_train.config.schema.base import Section

ENV_RESOURCE_NAMES = ("CPU", "GPU")
"""Ray resources an env actor may ask for by name on a local Ray; a cluster (cluster.address) may
also define custom ones."""


class EnvConfig(Section):
    """One environment. Its name is a registered environment (grpo_envs.names()) unless `class` or
    `reward_fn` says what to run; every key not declared here is a keyword setting of its class."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)
    num_workers: int = Field(default=1, ge=1)
    """Ray actors running this environment."""
    step_timeout_s: float | None = Field(default=None, gt=0)
    """Wall-clock budget of one env call (a worker's chunk of a batch): a worker that overruns it
    is replaced and its chunk retried, then its samples one at a time; a sample that still overruns
    gets reward 0 (env/<name>/env/step_timeouts counts overruns). null: no budget."""
    resources: dict[str, float] | None = None
    """Ray resources of each of its actors, e.g. {GPU: 1} for a reward model (CPU defaults to 1); other
    names are custom Ray resources, accepted only with cluster.address. null: one CPU. `grpo plan`
    shows where they land."""
    class_: str | None = Field(default=None, alias="class", pattern=r"^[\w.]+:[\w.]+$")
    """`package.module:Class`, an Environment subclass (grpo_envs.base) outside grpo; found on PYTHONPATH
    or in the directory `grpo train` runs from. Its other keys are its constructor's settings."""
    reward_fn: str | None = Field(default=None, pattern=r"^[\w.]+:[\w.]+$")
    """`package.module:function`, a reward function `(response: str) -> float` or `(response: str,
    env_info: dict) -> float` (env_info: the sample's ground_truth and extra_env_info), run in the env
    pool like any environment (grpo_envs.reward_fn); found like `class`."""

    @field_validator("resources")
    @classmethod
    def _resource_names(cls, resources: dict[str, float] | None) -> dict[str, float] | None:
        for name, amount in (resources or {}).items():
            if name.lower() in ("num_cpus", "num_gpus", "cpu", "gpu") and name not in ENV_RESOURCE_NAMES:
                raise ValueError(
                    f"resource {name!r}: write {name.upper().removeprefix('NUM_').rstrip('S')!r} (Ray's resource name)"
                )
            if amount < 0:
                raise ValueError(f"resource {name!r}: {amount} is negative")
        return resources

    @model_validator(mode="after")
    def _one_source(self) -> EnvConfig:
        if self.class_ is not None and self.reward_fn is not None:
            raise ValueError("give either `class` (an Environment) or `reward_fn` (a function), not both")
        if self.reward_fn is not None and self.model_extra:
            raise ValueError(
                f"a reward_fn environment takes no settings of its own; unknown key(s) "
                f"{', '.join(sorted(self.model_extra))}"
            )
        return self
