"""Start-up builds the datasets from the config's data section: bad rows per data.bad_rows, and
rows that route prompts to an environment the config does not configure stop the start-up."""

from __future__ import annotations

import json

import pytest

from grpo_data.testing import make_char_tokenizer
from grpo_train.config import validate_config_dict
from grpo_train.setup import StartupError, build_datasets


def _config(path, envs=("math",), **data):
    entry = {"dataset_name": "ResponseDataset", "data_path": str(path), "processor": "plain"}
    return validate_config_dict({"data": {"train": entry, **data}, "env": {name: {} for name in envs}})


def _rows(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompts_routed_to_an_unconfigured_environment_stop_the_start_up(tmp_path):
    # no env_name on the dataset: the built-in processors route to "math", which is not configured
    path = _rows(tmp_path, [{"input": "1+1=", "output": "2"}])
    with pytest.raises(
        StartupError,
        match=r"routes prompts to environment\(s\) \['math'\], which the env section "
        r"does not configure \(configured: \['arithmetic'\]\)",
    ):
        build_datasets(_config(path, envs=("arithmetic",)), make_char_tokenizer())
    train, _ = build_datasets(_config(path), make_char_tokenizer())
    assert train[0].env_names() == {"math"}


def test_bad_rows_policy_reaches_the_datasets(tmp_path):
    path = _rows(tmp_path, [{"input": "1+1=", "output": "2"}, {"input": ["x"], "output": "4"}])
    with pytest.raises(StartupError, match=r"rows\.jsonl, line 2: item 1, key 'problem': expected text, got list"):
        build_datasets(_config(path), make_char_tokenizer())
    train, _ = build_datasets(_config(path, bad_rows="skip"), make_char_tokenizer())
    assert len(train[0]) == 1 and train[0].num_skipped == 1
