"""Config loading: inheritance, overrides, interpolation, and every bad-input case."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from grpo_train.config import ConfigError, load_config, validate_config_dict
from grpo_train.config.loader import load_config_dict


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_merge_later_wins_and_child_wins(tmp_path):
    write(tmp_path, "base/a.yaml", "grpo: {seed: 1, val_period: 5}\npolicy: {max_grad_norm: 2.0}\n")
    write(tmp_path, "base/b.yaml", "grpo: {seed: 2}\n")
    child = write(tmp_path, "child.yaml", "defaults: [base/a.yaml, base/b.yaml]\ngrpo: {val_period: 7}\n")
    _, cfg = load_config_dict(child)
    assert cfg["grpo"] == {"seed": 2, "val_period": 7}
    assert cfg["policy"] == {"max_grad_norm": 2.0}


def test_defaults_are_relative_to_the_child_and_chain(tmp_path):
    write(tmp_path, "root.yaml", "grpo: {seed: 1}\n")
    write(tmp_path, "sub/mid.yaml", "defaults: ../root.yaml\ngrpo: {val_period: 3}\n")
    leaf = write(tmp_path, "sub/deeper/leaf.yaml", "defaults: ../mid.yaml\n")
    _, cfg = load_config_dict(leaf)
    assert cfg["grpo"] == {"seed": 1, "val_period": 3}


def test_override_marker_replaces_subtree(tmp_path):
    write(tmp_path, "a.yaml", "policy: {optimizer: {name: torch.optim.SGD, kwargs: {lr: 0.1, momentum: 0.9}}}\n")
    child = write(tmp_path, "c.yaml", "defaults: a.yaml\npolicy: {optimizer: {kwargs: {_override_: true, lr: 0.5}}}\n")
    _, cfg = load_config_dict(child)
    assert cfg["policy"]["optimizer"] == {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}}


def test_cli_overrides_set_add_delete_and_parse_types(tmp_path):
    path = write(tmp_path, "a.yaml", "grpo: {seed: 1, val_period: 5}\npolicy: {generation: {stop_strings: [x]}}\n")
    _, cfg = load_config_dict(
        path,
        [
            "grpo.seed=7",
            "+grpo.max_num_steps=3",
            "~grpo.val_period",
            "policy.generation.stop_strings=[a, b]",
            "+policy.generation.top_k=null",
            "+policy.optimizer.kwargs.lr=1e-4",
        ],
    )
    assert cfg["grpo"] == {"seed": 7, "max_num_steps": 3}
    assert cfg["policy"]["generation"] == {"stop_strings": ["a", "b"], "top_k": None}
    assert cfg["policy"]["optimizer"]["kwargs"]["lr"] == pytest.approx(1e-4)


def test_interpolation_keeps_types_and_computes(tmp_path):
    path = write(
        tmp_path,
        "a.yaml",
        """
        policy:
          max_total_sequence_length: 128
          train_micro_batch_size: 4
          dynamic_batching: {train_mb_tokens: "${mul:${policy.max_total_sequence_length}, ${policy.train_micro_batch_size}}"}
          generation: {max_new_tokens: "${policy.max_total_sequence_length}"}
        logger: {log_dir: "runs/len${policy.max_total_sequence_length}"}
        grpo: {val_period: "${floordiv:${policy.max_total_sequence_length}, 10}"}
        """,
    )
    _, cfg = load_config_dict(path, ["policy.max_total_sequence_length=256"])
    assert cfg["policy"]["dynamic_batching"]["train_mb_tokens"] == 1024
    assert cfg["policy"]["generation"]["max_new_tokens"] == 256
    assert cfg["logger"]["log_dir"] == "runs/len256"
    assert cfg["grpo"]["val_period"] == 25


def test_validated_model_is_frozen_and_typed(tmp_path):
    path = write(
        tmp_path,
        "a.yaml",
        "grpo: {num_prompts_per_step: 4, num_generations_per_prompt: 2}\npolicy: {train_global_batch_size: 8, train_micro_batch_size: 2}\n",
    )
    cfg, _ = load_config(path)
    assert cfg.grpo.num_prompts_per_step == 4
    with pytest.raises(ValidationError, match="frozen"):
        cfg.grpo.seed = 3  # frozen


@pytest.mark.parametrize(
    "yaml_text, overrides, expect_key, expect_words",
    [
        ("grpo: {sed: 1}\n", [], "grpo.sed", "unknown key"),
        ("grpo: {num_prompts_per_step: many}\n", [], "grpo.num_prompts_per_step", "'many'"),
        ("policy: {generation: {temperature: -1}}\n", [], "policy.generation.temperature", "greater than 0"),
        ("loss_fn: {ratio_clip_c: 0.5}\n", [], "loss_fn", "ratio_clip_c must be > 1"),
        (
            "loss_fn: {sequence_level_importance_ratios: true}\n",
            [],
            "loss_fn.sequence_level_importance_ratios",
            "token_level_loss",
        ),
        ("loss_fn: {use_cispo: true, ratio_clip_c: 3}\n", [], "loss_fn.use_cispo", "undefined together"),
        ("loss_fn: {loss_aggregation: seq-mean-token-sum-norm}\n", [], "loss_fn.loss_scale_factor", "constant length"),
        (
            "loss_fn: {token_level_loss: true, loss_aggregation: seq-mean-token-sum}\n",
            [],
            "loss_fn.loss_aggregation",
            "contradicts token_level_loss",
        ),
        (
            "loss_fn: {force_on_policy_ratio: true}\ngrpo: {num_prompts_per_step: 64}\n",
            [],
            "<root>",
            "one optimizer step per rollout",
        ),
        (
            "loss_fn: {truncated_importance_sampling_type: tis, truncated_importance_sampling_ratio: 2}\n",
            [],
            "loss_fn",
            "use_importance_sampling_correction",
        ),
        (
            "policy: {dynamic_batching: {enabled: true}, sequence_packing: {enabled: true}}\n",
            [],
            "policy",
            "mutually exclusive",
        ),
        ("grpo: {async_grpo: {enabled: true}}\n", [], "<root>", "importance_sampling"),
        ("data: {train: [{dataset_name: a}, {dataset_nam: b}]}\n", [], "data.train.1.dataset_nam", "unknown key"),
    ],
)
def test_schema_errors_name_the_key_path(tmp_path, yaml_text, overrides, expect_key, expect_words):
    path = write(tmp_path, "bad.yaml", yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert info.value.key == expect_key
    assert expect_words in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "override, words",
    [
        ("grpo.nope=1", "unknown key in override"),
        ("+grpo.seed=1", "already exists"),
        ("~grpo.nope", "no such key"),
        ("grpo.seed", "must look like key=value"),
        ("grpo..seed=1", "bad key"),
        ("grpo.seed.x=1", "is not a mapping"),
    ],
)
def test_bad_overrides(tmp_path, override, words):
    path = write(tmp_path, "a.yaml", "grpo: {seed: 1}\n")
    with pytest.raises(ConfigError) as info:
        load_config_dict(path, [override])
    assert words in str(info.value)
    assert "command line" in str(info.value)


def test_missing_file_lists_builtins(tmp_path):
    write(tmp_path, "known.yaml", "{}\n")
    with pytest.raises(ConfigError) as info:
        load_config_dict("nope.yaml", [], [tmp_path])
    assert "not found" in str(info.value) and "known.yaml" in str(info.value)


def test_missing_parent_and_circular_defaults(tmp_path):
    path = write(tmp_path, "a.yaml", "defaults: missing.yaml\n")
    with pytest.raises(ConfigError, match="parent config 'missing.yaml' not found"):
        load_config_dict(path)
    write(tmp_path, "x.yaml", "defaults: y.yaml\n")
    write(tmp_path, "y.yaml", "defaults: x.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config_dict(tmp_path / "x.yaml")
    assert "circular defaults" in str(info.value) and info.value.key == "defaults"


def test_invalid_yaml_and_bad_interpolation(tmp_path):
    path = write(tmp_path, "a.yaml", "grpo: {seed: [1\n")
    with pytest.raises(ConfigError, match="invalid YAML at line"):
        load_config_dict(path)
    path = write(tmp_path, "b.yaml", "grpo: {seed: '${grpo.nothing}'}\n")
    with pytest.raises(ConfigError) as info:
        load_config_dict(path)
    assert info.value.key == "grpo.seed" and "missing key" in str(info.value)
    path = write(tmp_path, "c.yaml", "grpo: {seed: '${pow:2,3}'}\n")
    with pytest.raises(ConfigError, match="unknown resolver 'pow'"):
        load_config_dict(path)
    path = write(tmp_path, "d.yaml", "grpo: {seed: '${grpo.val_period}', val_period: '${grpo.seed}'}\n")
    with pytest.raises(ConfigError, match="deeper than"):
        load_config_dict(path)


def test_defaults_all_validate():
    cfg = validate_config_dict({})
    assert cfg.loss_fn.reference_policy_kl_type == "k3"


def test_override_may_set_a_schema_key_the_file_leaves_out(tmp_path):
    path = write(tmp_path, "a.yaml", "grpo: {seed: 1}\n")
    cfg, raw = load_config(path, ["grpo.val_period=3", "policy.generation.vllm_cfg.max_model_len=99"])
    assert cfg.grpo.val_period == 3 and cfg.policy.generation.vllm_cfg.max_model_len == 99
    assert raw["policy"]["generation"]["vllm_cfg"]["max_model_len"] == 99
    with pytest.raises(ConfigError, match="unknown key in override"):
        load_config(path, ["grpo.val_perod=3"])


def test_every_loss_op_option_is_a_loss_fn_key():
    """loss_fn reaches every option of grpo_kernels.PGLossConfig, with the same defaults."""
    import dataclasses

    from grpo_kernels import PGLossConfig
    from grpo_train.config.schema import LossConfig

    fields = {f.name: f.default for f in dataclasses.fields(PGLossConfig)}
    assert set(fields) <= set(LossConfig.model_fields)
    assert {name: LossConfig.model_fields[name].default for name in fields} == fields
