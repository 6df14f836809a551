"""Each built-in dataset loads from small local files that the tests write in its real schema."""

import pytest

from grpo_data.builtin_datasets import BUILTIN_DATASETS, find_builtin, gsm8k_final_answer, load_builtin
from grpo_data.config import DataConfig, DatasetEntry
from grpo_data.datasets import build_data, build_dataset
from grpo_data.errors import DataError


def openmath_rows(n):
    return [
        {
            "problem": f"What is {i} + {i}?",
            "generated_solution": f"We add: {i} + {i} = \\boxed{{{2 * i}}}",
            "expected_answer": str(2 * i),
            "problem_source": "augmented_math",
        }
        for i in range(n)
    ]


def dapo_rows(n):
    instruction = (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": instruction.format(f"Compute {i}*3."), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(3 * i), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"id-{i}"},
        }
        for i in range(n)
    ]


def test_openmathinstruct2_parquet_with_default_validation_carve(tmp_path, parquet):
    path = parquet(tmp_path / "train_1M.parquet", openmath_rows(40))
    ds = load_builtin("OpenMathInstruct-2", data_path=path, seed=3)
    assert (len(ds.train), len(ds.validation)) == (38, 2)  # 5 % carved, as in NeMo RL
    row = ds.train[0]
    assert set(row) == {"problem", "answer"}
    assert row["answer"] == str(2 * int(row["problem"].split()[2]))
    assert ds.task_name == "OpenMathInstruct-2"
    sft = load_builtin("openmathinstruct2", data_path=path, output_key="generated_solution", split_validation_size=0)
    assert "\\boxed" in sft.train[0]["answer"]


def test_deepscaler_jsonl(tmp_path, jsonl):
    rows = [
        {"problem": "Find x if x+1=3.", "solution": "x = 2", "answer": "2"},
        {"problem": "1+1", "solution": "", "answer": "2"},
    ]
    ds = load_builtin("DeepScaler", data_path=jsonl(tmp_path / "deepscaler.jsonl", rows))
    assert ds.train.rows == [{"problem": "Find x if x+1=3.", "answer": "2"}, {"problem": "1+1", "answer": "2"}]
    assert ds.validation is None


def test_dapo_math_nested_parquet(tmp_path, parquet):
    ds = load_builtin("DAPO-Math-17k", data_path=parquet(tmp_path / "dapo.parquet", dapo_rows(3)))
    assert ds.train[2]["answer"] == "6"
    assert ds.train[2]["problem"].startswith("Solve the following math problem")
    assert "Compute 2*3." in ds.train[2]["problem"]
    broken = dapo_rows(2)
    del broken[1]["reward_model"]["ground_truth"]
    path = parquet(tmp_path / "broken.parquet", broken)
    with pytest.raises(DataError, match=r"broken\.parquet, row 2, key 'reward_model\.ground_truth': missing"):
        load_builtin("DAPOMath17K", data_path=path)


def test_aime2024_repeats(tmp_path, jsonl):
    rows = [
        {"id": i, "problem": f"AIME problem {i}", "solution": "...", "answer": str(100 + i), "url": "u", "year": "2024"}
        for i in range(3)
    ]
    path = jsonl(tmp_path / "aime.jsonl", rows)
    ds = load_builtin("AIME2024", data_path=path)
    assert len(ds) == 3 * 16
    assert [r["answer"] for r in ds.train.rows[:4]] == ["100", "101", "102", "100"]
    assert len(load_builtin("aime24", data_path=path, repeat=1)) == 3


def test_gsm8k_answer_after_hashes(tmp_path, jsonl):
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "Big number?", "answer": "It is 1,000 + 234.\n#### 1,234"},
    ]
    ds = load_builtin("GSM8K", data_path=jsonl(tmp_path / "test.jsonl", rows), split="test")
    assert [r["answer"] for r in ds.train.rows] == ["7", "1234"]
    assert ds.train[0]["problem"].startswith("Tom has")
    bad = jsonl(tmp_path / "bad.jsonl", [rows[0], {"question": "q", "answer": "no final answer"}])
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2, key 'answer': expected a GSM8K solution"):
        load_builtin("gsm8k", data_path=bad)
    assert gsm8k_final_answer("x\n#### -5 ") == "-5"


def test_math500_folder(tmp_path, parquet):
    folder = tmp_path / "MATH-500"
    folder.mkdir()
    rows = [
        {
            "problem": "Compute $1+1$.",
            "solution": "$2$",
            "answer": "2",
            "subject": "Algebra",
            "level": 1,
            "unique_id": "test/a.json",
        }
    ]
    parquet(folder / "test.parquet", rows)
    ds = load_builtin("MATH500", data_path=folder)
    assert ds.train.rows == [{"problem": "Compute $1+1$.", "answer": "2"}]


def test_names_aliases_and_hub_names():
    assert find_builtin("nvidia/OpenMathInstruct-2").name == "OpenMathInstruct-2"
    assert find_builtin("dapo_math_17k").name == "DAPOMath17K"
    assert find_builtin("math-500").name == "MATH-500"
    assert find_builtin("nope") is None
    assert set(BUILTIN_DATASETS) == {"OpenMathInstruct-2", "DeepScaler", "DAPOMath17K", "AIME2024", "GSM8K", "MATH-500"}


def test_unknown_split_and_offline_hub_message():
    with pytest.raises(DataError, match=r"split 'train_3M' does not exist"):
        load_builtin("OpenMathInstruct-2", split="train_3M")
    with pytest.raises(DataError) as info:
        load_builtin("GSM8K")
    message = str(info.value)
    assert "'openai/gsm8k'" in message and "subset 'main'" in message and "split 'train'" in message
    assert "set data_path" in message and "columns 'question' and 'answer'" in message


def test_builtin_from_config_with_math_processor(tmp_path, jsonl, tokenizer):
    rows = [{"problem": "2+2?", "solution": "", "answer": "4"}] * 4
    path = jsonl(tmp_path / "ds.jsonl", rows)
    entry = DatasetEntry(dataset_name="DeepScaler", data_path=str(path), prompt_file="Q {}", env_name="math")
    ds = build_dataset(entry, tokenizer)
    datum = ds[0]
    assert datum.message_log[0]["content"] == "<|user|>Q 2+2?<|end|><|assistant|>"
    assert datum.extra_env_info == {"ground_truth": "4"} and datum.task_name == "DeepScaler"
    splits = build_data(
        DataConfig(train=DatasetEntry(dataset_name="DeepScaler", data_path=str(path)),
                   validation=DatasetEntry(dataset_name="AIME2024", data_path=str(path), repeat=2)),
        tokenizer,
    )  # fmt: skip
    assert [len(d) for d in splits.validation] == [8]
