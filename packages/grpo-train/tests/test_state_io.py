"""State files (safetensors + JSON, no pickle) and the checkpoint manifest."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_data.records import DatumSpec
from grpo_train.batch import Rollout
from grpo_train.replay_buffer import GroupEntry
from grpo_train.state_io import StateFileError, load_state, save_state, verify_manifest, write_manifest


def test_nested_values_come_back_with_their_types(tmp_path):
    value = {
        "tuple": (1, 2.5, None, True),
        7: torch.arange(3),
        "nan": float("nan"),
        "neg0": -0.0,
        "nested": {0: {"step": torch.tensor(3.0)}},
        "__tensor__": "a key that looks like a tag",
        "bf16": torch.ones(2, dtype=torch.bfloat16),
        "empty": [],
        "big": 2**70,
    }
    save_state(value, tmp_path, "s")
    back = load_state(tmp_path, "s")
    assert back.keys() == value.keys() and back["tuple"] == (1, 2.5, None, True) and isinstance(back["tuple"], tuple)
    assert torch.equal(back[7], value[7]) and back[7].dtype == torch.int64
    assert back["bf16"].dtype == torch.bfloat16 and back["nested"][0]["step"].item() == 3.0
    assert math.isnan(back["nan"]) and math.copysign(1, back["neg0"]) == -1
    assert back["__tensor__"] == "a key that looks like a tag" and back["big"] == 2**70


def test_an_optimizer_state_round_trips_bitwise(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).square().sum().backward()
    optimizer.step()
    save_state(optimizer.state_dict(), tmp_path, "optimizer")
    twin = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=5.0)
    twin.load_state_dict(load_state(tmp_path, "optimizer"))
    assert twin.param_groups[0]["lr"] == 1e-3 and twin.param_groups[0]["betas"] == (0.8, 0.9)
    for a, b in zip(optimizer.state.values(), twin.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_dataclasses_only_come_back_when_allow_listed(tmp_path):
    datum = DatumSpec(
        message_log=[{"role": "user", "content": "1+1", "token_ids": torch.tensor([4, 5, 6])}],
        length=3,
        extra_env_info={"ground_truth": "2"},
    )
    rollout = Rollout(
        prompt_index=0,
        prompt_ids=[4, 5, 6],
        response_ids=[7],
        gen_logprobs=[-0.5],
        text="2",
        truncated=False,
        reward=1.0,
    )
    entry = GroupEntry(target_step=3, weight_version=2, prompt_index=0, datum=datum, rollouts=[rollout])
    save_state({"entries": [entry]}, tmp_path, "buffer")
    back = load_state(tmp_path, "buffer", types=(GroupEntry, Rollout, DatumSpec))["entries"][0]
    assert back.rollouts == [rollout] and back.target_step == 3
    assert torch.equal(back.datum.token_ids, torch.tensor([4, 5, 6])) and back.datum.extra_env_info == {
        "ground_truth": "2"
    }
    with pytest.raises(StateFileError, match="GroupEntry' is not a type this state file may hold"):
        load_state(tmp_path, "buffer", types=(Rollout, DatumSpec))


def test_numpy_scalars_are_stored_as_python_numbers(tmp_path):
    import numpy as np

    save_state({"x": np.float32(0.5), "n": np.int64(3), "b": np.bool_(True)}, tmp_path, "s")
    assert load_state(tmp_path, "s") == {"x": 0.5, "n": 3, "b": True}


def test_values_that_cannot_be_stored_are_refused_at_save(tmp_path):
    with pytest.raises(TypeError, match=r"s\.f: cannot store a function"):
        save_state({"f": lambda: None}, tmp_path, "s")


def test_manifest_catches_edits_additions_do_not_matter(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(b"\x00" * 100)
    (tmp_path / "b.json").write_text('{"step": 4}')
    write_manifest(tmp_path)
    assert verify_manifest(tmp_path) is None
    (tmp_path / "unlisted").write_text("never read by a resume")
    assert verify_manifest(tmp_path) is None
    (tmp_path / "b.json").write_text('{"step": 5}')  # same size, other content
    assert verify_manifest(tmp_path) == "b.json: content hash mismatch"
    (tmp_path / "sub" / "a.bin").write_bytes(b"\x00" * 99)
    assert verify_manifest(tmp_path) == "b.json: content hash mismatch"  # the first problem, in path order
    (tmp_path / "manifest.json").write_text("{")
    assert "unreadable" in verify_manifest(tmp_path)
