"""PGLossConfig: NeMo RL's defaults, and the combinations refused at config time."""

import dataclasses
import subprocess
import sys

import pytest

from grpo_kernels.loss_config import PGLossConfig


def test_defaults_are_nemo_rl_defaults():
    cfg = PGLossConfig()
    assert (cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c) == (0.2, 0.2, None)
    assert (cfg.reference_policy_kl_penalty, cfg.reference_policy_kl_type) == (0.01, "k3")
    assert (cfg.kl_input_clamp_value, cfg.kl_output_clamp_value) == (20.0, 10.0)
    assert cfg.token_level_loss and not cfg.sequence_level_importance_ratios
    assert not (cfg.use_importance_sampling_correction or cfg.disable_ppo_ratio)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ratio_clip_min = 0.3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(sequence_level_importance_ratios=True), "sequence_level_importance_ratios"),
        (dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0),
         "truncated_importance_sampling_type"),
        (dict(ratio_clip_c=1.0), "ratio_clip_c"),
        (dict(ratio_clip_c=0.5), "ratio_clip_c"),
        (dict(reference_policy_kl_type="k4"), "reference_policy_kl_type"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="clip",
              truncated_importance_sampling_ratio=2.0), "truncated_importance_sampling_type"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0),
         "truncated_importance_sampling_ratio"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio_min=0.5),
         "truncated_importance_sampling_ratio_min"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis"),
         "truncated_importance_sampling_ratio"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
              truncated_importance_sampling_ratio=0.5, truncated_importance_sampling_ratio_min=2.0),
         "truncated_importance_sampling_ratio_min"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="seq-mask-tis",
              truncated_importance_sampling_ratio=2.0, token_level_loss=False,
              sequence_level_importance_ratios=True), "truncated_importance_sampling_type"),
        (dict(ratio_clip_min=1.0), "ratio_clip_min"),
        (dict(reference_policy_kl_penalty=-0.1), "reference_policy_kl_penalty"),
        (dict(kl_output_clamp_value=0.0), "kl_output_clamp_value"),
    ],
)
def test_refusals_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"PGLossConfig.{field}="):
        PGLossConfig(**kwargs)


def test_accepted_combinations():
    PGLossConfig(token_level_loss=False, sequence_level_importance_ratios=True)
    PGLossConfig(ratio_clip_c=3.0, reference_policy_kl_penalty=0.0, disable_ppo_ratio=True)
    PGLossConfig(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                 truncated_importance_sampling_ratio=5.0, truncated_importance_sampling_ratio_min=0.5)
    PGLossConfig(kl_input_clamp_value=None, kl_output_clamp_value=None)


def test_config_module_imports_no_torch():
    code = "import sys, grpo_kernels.loss_config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_package_import_does_not_import_triton():
    code = (
        "import sys, grpo_kernels; grpo_kernels.PGLossConfig(); grpo_kernels.clipped_pg_loss; "
        "assert 'triton' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
