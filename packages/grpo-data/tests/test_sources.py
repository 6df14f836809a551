import json

import pytest

from grpo_data.errors import DataError
from grpo_data.sources import Field, get_field, is_local, load_rows, local_files

QA = {"problem": "q", "answer": "a"}


def test_jsonl_rows_keep_line_numbers_across_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"q": "1", "a": "2"}\n\n{"q": "3", "a": 4}\n', encoding="utf-8")
    rows = load_rows(path, QA)
    assert rows.rows == [{"problem": "1", "answer": "2"}, {"problem": "3", "answer": 4}]
    assert rows.row_numbers == [1, 3]
    assert rows.location(1) == f"{path}, line 3"


def test_missing_key_names_file_line_and_key(tmp_path, jsonl):
    path = jsonl(tmp_path / "d.jsonl", [{"q": "1", "a": "1"}, {"q": "2", "a": "2"}, {"a": "3"}])
    with pytest.raises(DataError, match=r"d\.jsonl, line 3, key 'q': missing \(the row has keys \['a'\]\)"):
        load_rows(path, QA)


def test_null_value_is_missing(tmp_path, jsonl):
    path = jsonl(tmp_path / "d.jsonl", [{"q": "1", "a": None}])
    with pytest.raises(DataError, match=r"line 1, key 'a': missing"):
        load_rows(path, QA)


def test_non_json_line_names_file_and_line(tmp_path, jsonl):
    path = jsonl(tmp_path / "d.jsonl", [{"q": "1", "a": "1"}] * 3, raw_lines={2: '{"q": "1", "a": '})
    with pytest.raises(DataError, match=r"d\.jsonl, line 2: not valid JSON"):
        load_rows(path, QA)
    array = jsonl(tmp_path / "e.jsonl", [{"q": "1", "a": "1"}], raw_lines={1: "[1, 2]"})
    with pytest.raises(DataError, match=r"e\.jsonl, line 1: expected a JSON object, got list"):
        load_rows(array, QA)


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(DataError, match=r"data file not found: '.*nope\.jsonl'"):
        load_rows(tmp_path / "nope.jsonl", QA)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"empty\.jsonl: the file has no rows"):
        load_rows(empty, QA)


def test_json_array_and_json_lines_named_json(tmp_path):
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"q": "1", "a": "2"}, {"q": "3"}]), encoding="utf-8")
    with pytest.raises(DataError, match=r"a\.json, row 2, key 'a'"):
        load_rows(array, QA)
    lines = tmp_path / "l.json"
    lines.write_text('{"q": "1", "a": "2"}\n{"q": "3", "a": "4"}\n', encoding="utf-8")
    assert len(load_rows(lines, QA)) == 2


def test_parquet_columns_rows_and_nulls(tmp_path, parquet):
    path = parquet(tmp_path / "d.parquet", [{"q": "1", "a": "2", "other": 1}, {"q": "3", "a": None, "other": 2}])
    with pytest.raises(DataError, match=r"d\.parquet, row 2, key 'a': missing"):
        load_rows(path, QA)
    with pytest.raises(
        DataError, match=r"d\.parquet, key 'question': no such column; the file has columns \['q', 'a', 'other'\]"
    ):
        load_rows(path, {"problem": "question", "answer": "a"})
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable Parquet file"):
        load_rows(bad, QA)


def test_folders_globs_and_split_selection(tmp_path, jsonl, parquet):
    folder = tmp_path / "data"
    folder.mkdir()
    jsonl(folder / "train-0.jsonl", [{"q": "t0", "a": "0"}])
    parquet(folder / "train-1.parquet", [{"q": "t1", "a": "1"}])
    jsonl(folder / "test-0.jsonl", [{"q": "s0", "a": "0"}])
    assert [r["problem"] for r in load_rows(folder, QA, split="train")] == ["t0", "t1"]
    assert [r["problem"] for r in load_rows(folder, QA, split="test")] == ["s0"]
    assert len(load_rows(folder, QA)) == 3
    assert [p.name for p in local_files(str(folder / "train-*"))] == ["train-0.jsonl", "train-1.parquet"]
    with pytest.raises(DataError, match="unsupported file type"):
        (folder / "x.csv").write_text("q,a\n")
        local_files(folder / "x.csv")


def test_nested_keys_and_transforms(tmp_path, jsonl):
    row = {"prompt": [{"role": "user", "content": "P"}], "reward_model": {"ground_truth": "7"}}
    assert get_field(row, "prompt[0].content") == "P"
    assert get_field(row, "prompt.0.content") == "P"
    assert get_field({"a.b": 1}, "a.b") == 1
    path = jsonl(tmp_path / "n.jsonl", [row])

    def double(v):
        if not v.isdigit():
            raise ValueError("not a number")
        return str(2 * int(v))

    rows = load_rows(path, {"problem": "prompt[0].content", "answer": Field("reward_model.ground_truth", double)})
    assert rows[0] == {"problem": "P", "answer": "14"}
    bad = jsonl(tmp_path / "b.jsonl", [row, {**row, "reward_model": {"ground_truth": "x"}}])
    with pytest.raises(DataError, match=r"b\.jsonl, line 2, key 'reward_model\.ground_truth': not a number"):
        load_rows(bad, {"problem": "prompt[0].content", "answer": Field("reward_model.ground_truth", double)})


def test_local_paths_versus_hub_names(tmp_path):
    assert is_local(tmp_path)
    assert is_local("data/train.jsonl") and is_local("./x") and is_local("/abs/path")
    assert not is_local("nvidia/OpenMathInstruct-2")


def test_hub_reader_path_through_datasets_load_dataset(tmp_path, jsonl, monkeypatch):
    # A local folder given straight to datasets.load_dataset exercises the same code as a hub
    # name (load, column check, select, to rows) without any network.
    import datasets

    from grpo_data.sources import read_hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "hubcopy"
    folder.mkdir()
    jsonl(
        folder / "train.jsonl",
        [{"question": "1+1", "answer": "2", "extra": 0}, {"question": "2+2", "answer": "4", "extra": 1}],
    )
    rows = list(read_hub(str(folder), None, "train", ["question", "answer"], hint=""))
    assert rows == [(1, {"question": "1+1", "answer": "2"}), (2, {"question": "2+2", "answer": "4"})]
    with pytest.raises(DataError, match=r"key 'problem': no such column; the dataset has columns"):
        list(read_hub(str(folder), None, "train", ["problem"], hint=""))
