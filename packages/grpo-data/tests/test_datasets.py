import pytest

from grpo_data.arithmetic import ArithmeticDataset
from grpo_data.config import DataConfig, DatasetEntry
from grpo_data.datasets import ProcessedDataset, build_data, build_dataset
from grpo_data.errors import DataError
from grpo_data.records import TaskSpec
from grpo_data.testing import token_id


def test_processed_dataset_processes_every_row_once_at_build(tokenizer):
    calls = []

    def spy(row, task_spec, tok, max_seq_length, idx):
        calls.append(idx)
        return build_dataset(DatasetEntry(dataset_name="arithmetic", size=1), tok)[0]

    ds = ProcessedDataset(ArithmeticDataset(5, seed=0), spy, TaskSpec("t"), tokenizer, 16)
    assert len(ds) == 5 and calls == [0, 1, 2, 3, 4]
    ds[3], ds[3]
    assert calls == [0, 1, 2, 3, 4]
    lazy = ProcessedDataset(ArithmeticDataset(5, seed=0), spy, TaskSpec("t"), tokenizer, 16, preprocess=False)
    lazy[3]
    assert calls[5:] == [3]


def test_build_dataset_arithmetic_demo(tokenizer, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("{} ", encoding="utf-8")
    cfg = {
        "dataset_name": "arithmetic",
        "size": 50,
        "seed": 7,
        "digits": 1,
        "operations": ["+", "*"],
        "prompt_file": str(prompt),
        "env_name": "arithmetic_env",
        "max_input_seq_length": 32,
    }
    ds = build_dataset(DatasetEntry(**cfg), tokenizer)
    rows = ArithmeticDataset(50, seed=7, digits=1, operations=("+", "*"))
    assert len(ds) == 50
    datum = ds[4]
    assert datum.message_log[0]["content"] == rows[4]["problem"] + " "
    assert datum.token_ids.tolist() == [token_id(c) for c in rows[4]["problem"] + " "]
    assert datum.extra_env_info == {"ground_truth": rows[4]["answer"]}
    assert (datum.env_name, datum.task_name, datum.dataset_name) == ("arithmetic_env", "arithmetic", "arithmetic")


def test_truncations_are_counted(tokenizer):
    ds = build_dataset(DatasetEntry(dataset_name="arithmetic", size=8, max_input_seq_length=3), tokenizer)
    batch = [ds[i] for i in range(len(ds))]
    assert all(d.truncated and d.loss_multiplier == 0.0 and d.length == 3 for d in batch)
    assert ds.num_truncated == 8


def test_strict_truncation_names_the_row(tokenizer, tmp_path, jsonl):
    path = jsonl(tmp_path / "t.jsonl", [{"input": "1", "output": "1"}, {"input": "1234567", "output": "1"}])
    cfg = {
        "dataset_name": "ResponseDataset",
        "data_path": str(path),
        "processor": "plain",
        "max_input_seq_length": 4,
        "on_overlong": "error",
    }
    with pytest.raises(DataError, match=r"t\.jsonl, line 2: item 1 .*7 tokens"):
        build_dataset(DatasetEntry(**cfg), tokenizer)
    kept = build_dataset(
        DatasetEntry(**cfg), tokenizer, bad_rows="skip"
    )  # on_overlong: error + skip drops overlong prompts
    assert len(kept) == 1 and kept.num_skipped == 1 and kept[0].token_ids.tolist() == [token_id("1")]


def test_build_data_lists_defaults_and_carved_validation(tokenizer, tmp_path, jsonl):
    path = jsonl(tmp_path / "qa.jsonl", [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(20)])
    data_cfg = {
        "max_input_seq_length": 64,
        "default": {"processor": "plain", "env_name": "math", "input_key": "ignored-for-arithmetic"},
        "train": [
            {"dataset_name": "arithmetic", "size": 40, "seed": 1, "split_validation_size": 0.25},
            {"dataset_name": "ResponseDataset", "data_path": str(path), "input_key": "q", "output_key": "a",
             "task_name": "qa", "env_name": "other"},
        ],
        "validation": {"dataset_name": "arithmetic", "size": 8, "seed": 99},
    }  # fmt: skip
    splits = build_data(DataConfig.from_mapping(data_cfg), tokenizer)
    assert [len(d) for d in splits.train] == [30, 20]
    assert [len(d) for d in splits.validation] == [10, 8]
    assert [d.name for d in splits.validation] == ["arithmetic", "arithmetic#2"]
    assert splits.train[1][0].env_name == "other" and splits.train[0][0].env_name == "math"
    assert splits.train[1][3].extra_env_info == {"ground_truth": "4"}
    train_problems = {splits.train[0][i].message_log[0]["content"] for i in range(30)}
    val_problems = {splits.validation[0][i].message_log[0]["content"] for i in range(10)}
    all_problems = {r["problem"] for r in (ArithmeticDataset(40, seed=1)[i] for i in range(40))}
    assert train_problems | val_problems == all_problems
    # Deterministic carving.
    again = build_data(DataConfig.from_mapping(data_cfg), tokenizer)
    assert [d.idx for d in (again.validation[0][i] for i in range(10))] == list(range(10))
    assert [again.validation[0][i].token_ids.tolist() for i in range(10)] == [
        splits.validation[0][i].token_ids.tolist() for i in range(10)
    ]


@pytest.mark.parametrize(
    "data_cfg, message",
    [
        ({"train": [{"dataset_name": "arithmetic"}, {"dataset_name": "arithmetic", "inptu_key": "x"}]},
         r"data\.train\[1\]\.inptu_key: unknown key"),
        ({"train": {"dataset_name": "nope"}}, r"data\.train\.dataset_name: unknown dataset 'nope'"),
        ({"train": {"input_key": "x"}}, r"data\.train\.dataset_name: missing"),
        ({"train": {"dataset_name": "arithmetic"}, "default": {"sise": 3}}, r"data\.default\.sise"),
        ({"train": {"dataset_name": "arithmetic", "processor": "math", "on_overlong": "error",
                    "chat_template_kwargs": {}, "processor_kwargs": {"bogus": 1}}}, r"data\.train: .*bogus"),
        ({"train": {"dataset_name": "arithmetic", "size": 0}}, "size=0"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key_path(tokenizer, data_cfg, message):
    with pytest.raises(DataError, match=message):
        build_data(DataConfig.from_mapping(data_cfg), tokenizer)


def test_validation_part_requires_a_carve(tokenizer):
    with pytest.raises(DataError, match="no validation part"):
        build_dataset(DatasetEntry(dataset_name="arithmetic", size=4), tokenizer, part="validation")
    val = build_dataset(
        DatasetEntry(dataset_name="arithmetic", size=10, split_validation_size=3), tokenizer, "validation"
    )
    assert len(val) == 3
