import pytest

from grpo_data.errors import DataError
from grpo_data.response_dataset import ResponseDataset


@pytest.fixture
def qa_file(tmp_path, jsonl):
    return jsonl(tmp_path / "qa.jsonl", [{"input": f"{i}+0=", "output": i} for i in range(40)])


def test_defaults_and_canonical_rows(qa_file):
    ds = ResponseDataset(qa_file)
    assert len(ds) == 40 and ds.validation is None
    assert ds[5] == {"problem": "5+0=", "answer": "5"}
    assert ds.task_name == "qa"


def test_validation_carving_is_deterministic_and_disjoint(qa_file):
    a = ResponseDataset(qa_file, split_validation_size=0.25, seed=1)
    b = ResponseDataset(qa_file, split_validation_size=0.25, seed=1)
    c = ResponseDataset(qa_file, split_validation_size=0.25, seed=2)
    assert (len(a.train), len(a.validation)) == (30, 10)
    val = [r["problem"] for r in a.validation.rows]
    assert val == [r["problem"] for r in b.validation.rows]
    assert val != [r["problem"] for r in c.validation.rows]
    train = [r["problem"] for r in a.train.rows]
    assert not set(train) & set(val) and len(set(train) | set(val)) == 40
    assert train == sorted(train, key=lambda p: int(p.split("+")[0]))  # original order kept
    assert a.validation.location(0).startswith(str(qa_file))
    assert len(ResponseDataset(qa_file, split_validation_size=7).validation) == 7


@pytest.mark.parametrize("size", [40, 1.5, -1])
def test_bad_validation_sizes(qa_file, size):
    with pytest.raises(DataError, match="split_validation_size"):
        ResponseDataset(qa_file, split_validation_size=size)


def test_val_data_path_repeat_and_keys(tmp_path, jsonl, qa_file):
    val = jsonl(tmp_path / "val.jsonl", [{"input": "v", "output": "1"}])
    ds = ResponseDataset(qa_file, val_data_path=val, repeat=2)
    assert len(ds.train) == 80 and [r["problem"] for r in ds.validation.rows] == ["v", "v"]
    with pytest.raises(DataError, match="either split_validation_size or val_data_path"):
        ResponseDataset(qa_file, split_validation_size=0.1, val_data_path=val)
    with pytest.raises(DataError, match=r"qa\.jsonl, line 1, key 'question'"):
        ResponseDataset(qa_file, input_key="question")


def test_conversations_pass_through(tmp_path, jsonl, tokenizer):
    from grpo_data.processors import chat_processor
    from grpo_data.records import TaskSpec

    path = jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "1+1="}], "gt": "2"}])
    ds = ResponseDataset(path, input_key="messages", output_key="gt")
    datum = chat_processor(ds[0], TaskSpec("c"), tokenizer, 64, 0)
    assert datum.message_log[0]["content"] == "<|user|>1+1=<|end|><|assistant|>"
    assert datum.extra_env_info == {"ground_truth": "2"}


def test_hub_name_offline_says_to_set_data_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"could not load the dataset 'grpo-test/does-not-exist'.*set data_path"):
        ResponseDataset("grpo-test/does-not-exist", input_key="q", output_key="a")
