"""PGLossConfig: NeMo RL's defaults, and the combinations refused at config time."""

import dataclasses
import subprocess
import sys

import pytest

from grpo_kernels.loss_config import LossOptionError, PGLossConfig


def test_defaults_are_nemo_rl_defaults():
    cfg = PGLossConfig()
    assert (cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c) == (0.2, 0.2, None)
    assert (cfg.reference_policy_kl_penalty, cfg.reference_policy_kl_type) == (0.01, "k3")
    assert (cfg.kl_input_clamp_value, cfg.kl_output_clamp_value) == (20.0, 10.0)
    assert cfg.token_level_loss and not cfg.sequence_level_importance_ratios
    assert cfg.loss_aggregation == "token-mean" and cfg.kl_true_gradient  # NeMo RL >= 0.7
    assert not (cfg.use_importance_sampling_correction or cfg.disable_ppo_ratio)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ratio_clip_min = 0.3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(sequence_level_importance_ratios=True), "sequence_level_importance_ratios"),
        (
            dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0),
            "truncated_importance_sampling_type",
        ),
        (dict(ratio_clip_c=1.0), "ratio_clip_c"),
        (dict(ratio_clip_c=0.5), "ratio_clip_c"),
        (dict(reference_policy_kl_type="k4"), "reference_policy_kl_type"),
        (
            dict(
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type="clip",
                truncated_importance_sampling_ratio=2.0,
            ),
            "truncated_importance_sampling_type",
        ),
        (
            dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0),
            "truncated_importance_sampling_ratio",
        ),
        (
            dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio_min=0.5),
            "truncated_importance_sampling_ratio_min",
        ),
        (
            dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis"),
            "truncated_importance_sampling_ratio",
        ),
        (
            dict(
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type="icepop",
                truncated_importance_sampling_ratio=0.5,
                truncated_importance_sampling_ratio_min=2.0,
            ),
            "truncated_importance_sampling_ratio_min",
        ),
        (
            dict(
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type="seq-mask-tis",
                truncated_importance_sampling_ratio=2.0,
                token_level_loss=False,
                sequence_level_importance_ratios=True,
            ),
            "truncated_importance_sampling_type",
        ),
        (dict(ratio_clip_min=1.0), "ratio_clip_min"),
        (dict(reference_policy_kl_penalty=-0.1), "reference_policy_kl_penalty"),
        (dict(kl_output_clamp_value=0.0), "kl_output_clamp_value"),
        # loss_aggregation and its normaliser
        (dict(loss_aggregation="seq-sum"), "loss_aggregation"),
        (dict(loss_aggregation="seq-mean-token-sum", token_level_loss=True), "loss_aggregation"),
        (dict(loss_aggregation="token-mean", token_level_loss=False), "loss_aggregation"),
        (dict(loss_aggregation="seq-mean-token-sum-norm"), "loss_scale_factor"),
        (dict(loss_aggregation="seq-mean-token-sum-norm", loss_scale_factor=0), "loss_scale_factor"),
        (dict(loss_scale_factor=512), "loss_scale_factor"),
        # GSPO is a mean over sequences of one term each
        (
            dict(sequence_level_importance_ratios=True, loss_aggregation="seq-mean-token-sum"),
            "sequence_level_importance_ratios",
        ),
        (
            dict(sequence_level_importance_ratios=True, loss_aggregation="token-mean"),
            "sequence_level_importance_ratios",
        ),
        # ratio variants
        (dict(use_cispo=True, ratio_clip_c=3.0), "use_cispo"),
        (dict(use_cispo=True, disable_ppo_ratio=True), "use_cispo"),
        (dict(use_cispo=True, token_level_loss=False, sequence_level_importance_ratios=True), "use_cispo"),
        (dict(force_on_policy_ratio=True, disable_ppo_ratio=True), "force_on_policy_ratio"),
        (dict(force_on_policy_ratio=True, use_cispo=True), "force_on_policy_ratio"),
        (
            dict(force_on_policy_ratio=True, token_level_loss=False, sequence_level_importance_ratios=True),
            "force_on_policy_ratio",
        ),
        (dict(force_on_policy_ratio=True, ratio_clip_c=3.0), "force_on_policy_ratio"),
        (dict(positive_example_nll_weight=-0.1), "positive_example_nll_weight"),
    ],
)
def test_refusals_name_the_field(kwargs, field):
    with pytest.raises(LossOptionError, match=f"PGLossConfig.{field}=") as info:
        PGLossConfig(**kwargs)
    assert info.value.field == field


def test_accepted_combinations():
    PGLossConfig(token_level_loss=False, sequence_level_importance_ratios=True)
    PGLossConfig(ratio_clip_c=3.0, reference_policy_kl_penalty=0.0, disable_ppo_ratio=True)
    PGLossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=5.0,
        truncated_importance_sampling_ratio_min=0.5,
    )
    PGLossConfig(kl_input_clamp_value=None, kl_output_clamp_value=None)
    PGLossConfig(loss_aggregation="seq-mean-token-sum-norm", loss_scale_factor=512, token_level_loss=False)
    PGLossConfig(use_cispo=True, loss_aggregation="seq-mean-token-sum-norm", loss_scale_factor=8)
    PGLossConfig(force_on_policy_ratio=True, use_importance_sampling_correction=True)
    PGLossConfig(positive_example_nll_weight=0.1, kl_true_gradient=False)


def test_config_module_imports_no_torch():
    code = "import sys, grpo_kernels.loss_config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_package_import_does_not_import_triton():
    code = (
        "import sys, grpo_kernels; grpo_kernels.PGLossConfig(); grpo_kernels.clipped_pg_loss; "
        "assert 'triton' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
