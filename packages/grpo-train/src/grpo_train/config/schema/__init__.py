"""The typed GRPO configuration: frozen pydantic models, one per section.

Key names follow NeMo RL's `grpo_math_1B.yaml` where the concept is the same. Defaults live
here and nowhere else; components receive their own section, never the root. No torch import.

One module per section (`grpo`, `loss` for loss_fn, `policy`, `generation` for policy.generation,
`data`, `env`, `runtime` for logger/cluster/checkpointing, `ppo` for ppo/value/value_loss_fn) and
`root` for GRPOMasterConfig and its cross-section checks; every name is importable from here.
"""

from __future__ import annotations

# The leaf packages' own configs that sections take their fields from (each key declared once).
from grpo_data.config import DatasetEntry
from grpo_kernels.loss_config import PGLossConfig
from grpo_train.config.schema.base import Section, section_of
from grpo_train.config.schema.data import DataConfig, DatasetConfig
from grpo_train.config.schema.env import ENV_RESOURCE_NAMES, EnvConfig
from grpo_train.config.schema.generation import ColocatedConfig, ColocatedResources, GenerationConfig, VllmConfig
from grpo_train.config.schema.grpo import (
    ESTIMATOR_KEYS,
    AsyncGRPOConfig,
    GroupAdvEstimatorConfig,
    GroupEstimatorName,
    GRPOConfig,
    RefitCheckConfig,
    RewardScalingConfig,
    RewardShapingConfig,
)
from grpo_train.config.schema.loss import LossConfig
from grpo_train.config.schema.policy import (
    DTensorConfig,
    LoRAConfig,
    MicroBatchingConfig,
    OptimizerConfig,
    PolicyConfig,
    SchedulerEntry,
    SequencePackingConfig,
    TokenizerConfig,
)
from grpo_train.config.schema.ppo import (
    GROUP_RELATIVE_ESTIMATORS,
    AdvEstimatorConfig,
    PPOConfig,
    ValueConfig,
    ValueLossConfig,
)
from grpo_train.config.schema.root import GRPOMasterConfig
from grpo_train.config.schema.runtime import (
    CheckpointingConfig,
    ClusterConfig,
    LoggerConfig,
    WandbConfig,
    parse_duration,
)

__all__ = [
    "AdvEstimatorConfig",
    "AsyncGRPOConfig",
    "CheckpointingConfig",
    "ClusterConfig",
    "ColocatedConfig",
    "ColocatedResources",
    "DTensorConfig",
    "DataConfig",
    "DatasetConfig",
    "DatasetEntry",
    "ENV_RESOURCE_NAMES",
    "ESTIMATOR_KEYS",
    "EnvConfig",
    "GROUP_RELATIVE_ESTIMATORS",
    "GRPOConfig",
    "GRPOMasterConfig",
    "GenerationConfig",
    "GroupAdvEstimatorConfig",
    "GroupEstimatorName",
    "LoRAConfig",
    "LoggerConfig",
    "LossConfig",
    "MicroBatchingConfig",
    "OptimizerConfig",
    "PGLossConfig",
    "PPOConfig",
    "PolicyConfig",
    "RefitCheckConfig",
    "RewardScalingConfig",
    "RewardShapingConfig",
    "SchedulerEntry",
    "Section",
    "SequencePackingConfig",
    "TokenizerConfig",
    "ValueConfig",
    "ValueLossConfig",
    "VllmConfig",
    "WandbConfig",
    "parse_duration",
    "section_of",
]
