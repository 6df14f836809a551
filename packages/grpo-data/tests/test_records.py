import dataclasses

import pytest
import torch

from grpo_data.errors import DataError
from grpo_data.records import DatumSpec, TaskSpec, load_prompt_text


def test_task_spec_reads_files_and_literal_strings(tmp_path):
    prompt = tmp_path / "cot.txt"
    prompt.write_text("Solve: {}\nAnswer:", encoding="utf-8")
    system = tmp_path / "system.txt"
    system.write_text("You are a calculator.", encoding="utf-8")
    from_files = TaskSpec.from_files("math", prompt, str(system))
    assert from_files.prompt_template == "Solve: {}\nAnswer:"
    assert from_files.system_prompt == "You are a calculator."
    literal = TaskSpec.from_files("math", "Q: {}", "be brief")
    assert literal.prompt_template == "Q: {}" and literal.system_prompt == "be brief"
    assert TaskSpec.from_files("math").prompt_template is None


def test_task_spec_is_frozen_and_renders():
    spec = TaskSpec("math", None, "Put the answer in \\boxed{{}}: {}")
    assert spec.render("1+1=") == "Put the answer in \\boxed{}: 1+1="
    assert TaskSpec("math").render("1+1=") == "1+1="
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.task_name = "x"


def test_missing_prompt_file_is_an_error_naming_it():
    with pytest.raises(DataError, match="prompts/cot.txt"):
        load_prompt_text("prompts/cot.txt", "prompt_file")


@pytest.mark.parametrize("template", ["no placeholder", "two {} {}", "bad {name}"])
def test_template_needs_exactly_one_placeholder(template):
    with pytest.raises(DataError, match="placeholder"):
        TaskSpec("math", None, template)


def test_datum_spec_token_ids_concatenates_messages():
    datum = DatumSpec(
        message_log=[
            {"role": "system", "content": "a", "token_ids": torch.tensor([1, 2])},
            {"role": "user", "content": "b", "token_ids": torch.tensor([3])},
        ],
        length=3,
        extra_env_info={"ground_truth": "46"},
    )
    assert datum.token_ids.tolist() == [1, 2, 3]
    assert datum.loss_multiplier == 1.0 and not datum.truncated


def test_datum_spec_pickles_token_ids_as_arrays_and_rebuilds_tensors():
    import copy
    import pickle

    datum = DatumSpec(
        message_log=[{"role": "user", "content": "1+1=", "token_ids": torch.tensor([10, 19, 10, 22])}],
        length=4,
        extra_env_info={"ground_truth": "2"},
        loss_multiplier=0.0,
        idx=3,
        truncated=True,
        dataset_name="d",
    )
    payload = pickle.dumps(datum)
    assert b"torch" not in payload  # no tensor storage (shared memory across processes)
    for clone in (pickle.loads(payload), copy.deepcopy(datum)):
        assert clone.message_log[0]["token_ids"].dtype == torch.long
        assert clone.token_ids.tolist() == [10, 19, 10, 22]
        assert (clone.length, clone.loss_multiplier, clone.idx, clone.truncated, clone.dataset_name) == (
            4,
            0.0,
            3,
            True,
            "d",
        )
