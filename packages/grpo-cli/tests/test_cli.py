"""The `grpo` command as a user runs it: real subprocesses, exit codes, stderr, imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_cli.configs import CONFIG_DIR


def grpo(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grpo_cli.main", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
def test_every_builtin_config_validates_from_any_folder(name, tmp_path, monkeypatch, capsys):
    # In-process through the CLI's own entry point (one torch import for all configs, not one
    # subprocess each); the subprocess path is covered by the next test.
    from grpo_cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["config", "validate", name]) == 0, capsys.readouterr().err
    assert f"{name}: OK" in capsys.readouterr().out


def test_builtin_config_validates_in_a_subprocess_from_another_folder(tmp_path):
    result = grpo("config", "validate", "grpo_math_1B.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "grpo_math_1B.yaml: OK" in result.stdout


def test_builtin_configs_exist():
    names = {p.name for p in CONFIG_DIR.glob("*.yaml")}
    assert {"grpo_math_1B.yaml", "grpo_arith_tiny.yaml"} <= names


def test_show_prints_resolved_yaml_with_overrides(tmp_path):
    result = grpo("config", "show", "grpo_math_1B.yaml", "policy.max_total_sequence_length=1024", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    # prompts get half the context, the response what is left after one scoring position
    assert shown["data"]["max_input_seq_length"] == 512
    assert shown["policy"]["generation"]["max_new_tokens"] == 1024 - 512 - 1
    assert shown["policy"]["dynamic_batching"]["train_mb_tokens"] == 4096


@pytest.mark.parametrize(
    "args, words",
    [
        (["config", "validate", "grpo_math_1B.yaml", "grpo.sed=1"], "grpo.sed: unknown key in override"),
        (["config", "validate", "grpo_math_1B.yaml", "grpo.seed=[1"], "grpo.seed"),
        (["config", "validate", "no_such_config.yaml"], "config file not found"),
        (
            ["config", "validate", "grpo_math_1B.yaml", "policy.generation.temperature=hot"],
            "policy.generation.temperature",
        ),
        (["train", "--config", "grpo_math_1B.yaml", "loss_fn.ratio_clip_c=0.5"], "ratio_clip_c must be > 1"),
        (
            ["config", "validate", "grpo_math_1B.yaml", "loss_fn.use_cispo=true", "loss_fn.ratio_clip_c=3"],
            "loss_fn.use_cispo: the dual clip",
        ),
    ],
)
def test_config_errors_are_one_line_exit_2(args, words, tmp_path):
    result = grpo(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo: config error:")
    assert words in lines[0]


def test_bad_yaml_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  seed: [1\n")
    result = grpo("config", "validate", str(bad), cwd=tmp_path)
    assert result.returncode == 2 and "bad.yaml" in result.stderr and "line" in result.stderr


def test_circular_defaults_exit_2(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\n")
    result = grpo("config", "validate", "a.yaml", cwd=tmp_path)
    assert result.returncode == 2 and "circular defaults" in result.stderr


# `config validate` builds the optimizer and scheduler on a dummy parameter (grpo_train.config.checks),
# so it imports torch; nothing else heavy.
@pytest.mark.parametrize(
    "args, allowed",
    [(["--help"], ""), (["config", "validate", "grpo_math_1B.yaml"], "torch"), (["config", "show"], "")],
)
def test_help_and_validation_import_nothing_heavy(args, allowed):
    code = (
        "import sys\nfrom grpo_cli.main import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules]\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"HEAVY={allowed}\n" in result.stdout, result.stdout
