"""Bad rows are found when the dataset is built, never at the step that draws them.

Each class of bad input sits on line 3 of a 4-line JSONL file between good rows. Under
`bad_rows: refuse` (the default) the build stops with one DataError naming the file and line;
under `skip` the three good rows remain, with the expected tokens, and the skip is counted and
logged in one line.
"""

from __future__ import annotations

import json
import logging

import pytest

from grpo_data.bad_rows import MAX_ROW_DEPTH, BadRows, row_problem
from grpo_data.config import DataConfig, DatasetEntry
from grpo_data.datasets import ProcessedDataset, build_data, build_dataset
from grpo_data.errors import DataError
from grpo_data.records import TaskSpec
from grpo_data.sources import Rows
from grpo_data.testing import token_id

GOOD = [{"input": "1+2=", "output": "3"}, {"input": "4+4=", "output": "8"}, {"input": "9+0=", "output": "9"}]


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


# (name, raw JSON text of line 3, words the refusal names)
BAD_LINES = [
    ("prompt is a list", json.dumps({"input": ["1+2="], "output": "3"}), "expected text, got list"),
    ("prompt is a dict", json.dumps({"input": {"q": "1+2="}, "output": "3"}), "expected text, got dict"),
    ("prompt is null", json.dumps({"input": None, "output": "3"}), "key 'input': missing"),
    ("prompt is a bool", json.dumps({"input": True, "output": "3"}), "expected text, got bool"),
    ("answer is a list", json.dumps({"input": "1+2=", "output": [3]}), "expected text, got list"),
    ("answer is missing", json.dumps({"input": "1+2="}), "key 'output': missing"),
    ("lone surrogate in the prompt", '{"input": "1+\\ud800=", "output": "3"}', "lone surrogate U+D800 at character 2"),
    ("lone surrogate in the answer", '{"input": "1+2=", "output": "\\udfff"}', "lone surrogate U+DFFF"),
    ("answer nested too deep", '{"input": "1+2=", "output": %s}' % _nested(MAX_ROW_DEPTH + 5), "nested deeper than"),
    ("JSON too deep to parse", '{"input": "1+2=", "output": %s}' % _nested(100_000), "nested too deeply to parse"),
    ("empty prompt", json.dumps({"input": "", "output": "3"}), "the prompt has no tokens"),
    ("not a JSON object", json.dumps(["1+2=", "3"]), "expected a JSON object, got list"),
    ("not JSON", '{"input": "1+2=", "output": ', "not valid JSON"),
]


def _write(path, bad_line: str | bytes):
    lines = [json.dumps(r).encode() for r in GOOD[:2]] + [
        bad_line if isinstance(bad_line, bytes) else bad_line.encode()
    ]
    lines.append(json.dumps(GOOD[2]).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _fields(path, **extra):
    return {"dataset_name": "ResponseDataset", "data_path": str(path), "processor": "plain", **extra}


def _entry(path, **extra):
    return DatasetEntry(**_fields(path, **extra))


def _expected_tokens(text: str) -> list[int]:
    return [token_id(c) for c in text]


CASES = BAD_LINES + [
    ("invalid UTF-8 bytes", b'{"input": "1+2=\xff\xfe", "output": "3"}', "not UTF-8 text (byte 0xff at column 16)")
]


@pytest.mark.parametrize("name, line, words", CASES, ids=[c[0] for c in CASES])
def test_refuse_names_file_line_and_reason(name, line, words, tokenizer, tmp_path):
    path = _write(tmp_path / "rows.jsonl", line)
    with pytest.raises(DataError) as info:
        build_dataset(_entry(path), tokenizer)
    message = str(info.value)
    assert "rows.jsonl, line 3" in message and words in message, message
    assert "\n" not in message and len(message) < 500  # one line, even for a 100,000-deep row


@pytest.mark.parametrize("name, line, words", CASES, ids=[c[0] for c in CASES])
def test_skip_keeps_the_good_rows_and_counts_the_bad_one(name, line, words, tokenizer, tmp_path, caplog):
    path = _write(tmp_path / "rows.jsonl", line)
    with caplog.at_level(logging.WARNING, logger="grpo_data.bad_rows"):
        ds = build_dataset(_entry(path), tokenizer, bad_rows="skip")
    assert len(ds) == 3 and ds.num_skipped == 1
    for i, row in enumerate(GOOD):
        assert ds[i].token_ids.tolist() == _expected_tokens(row["input"])
        assert ds[i].extra_env_info == {"ground_truth": row["output"]}
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo_data.bad_rows"]
    assert len(lines) == 1 and "skipped 1 bad row(s) of 4" in lines[0] and "line 3" in lines[0] and words in lines[0]


def test_numbers_are_text_not_bad_rows(tokenizer, tmp_path):
    path = _write(tmp_path / "rows.jsonl", json.dumps({"input": 12, "output": 3.5}))
    ds = build_dataset(_entry(path), tokenizer)
    assert ds[2].token_ids.tolist() == _expected_tokens("12") and ds[2].extra_env_info == {"ground_truth": "3.5"}


def test_chat_rows_of_the_wrong_shape(tokenizer):
    good = {"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]}
    bad = {"messages": [{"role": "user", "content": 7}]}
    rows = Rows([good, bad, good], "chat.jsonl", [1, 2, 3])
    with pytest.raises(DataError, match=r"chat\.jsonl, line 2: item 1, key 'messages\[0\]'"):
        ProcessedDataset(rows, "chat", TaskSpec("t"), tokenizer, None)
    kept = ProcessedDataset(rows, "chat", TaskSpec("t"), tokenizer, None, bad_rows=BadRows("skip"))
    assert len(kept) == 2 and kept.num_skipped == 1 and kept[1].extra_env_info == {"ground_truth": "3"}


def test_a_whole_json_file_that_is_not_utf8_is_refused_as_a_file(tokenizer, tmp_path):
    path = tmp_path / "rows.json"
    path.write_bytes(b'[{"input": "1+2=", "output": "3"},\n {"input": "\xff", "output": "3"}]')
    with pytest.raises(DataError, match=r"rows\.json: not UTF-8 text \(byte 0xff at line 2\)"):
        build_dataset(_entry(path), tokenizer, bad_rows="skip")
    deep = tmp_path / "deep.json"
    deep.write_text(_nested(100_000))
    with pytest.raises(DataError, match=r"deep\.json: JSON nested too deeply to parse"):
        build_dataset(_entry(deep), tokenizer)


def test_a_file_of_only_bad_rows_is_refused_even_when_skipping(tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\xff\n\xfe\n")
    with pytest.raises(DataError, match=r"bad\.jsonl: the file has no rows \(2 bad row\(s\) skipped\)"):
        build_dataset(_entry(path), tokenizer, bad_rows="skip")


class CountingTokenizer:
    """The test tokenizer, counting the calls that tokenise a long text."""

    def __init__(self, tokenizer, long: int) -> None:
        self.tokenizer, self.long, self.long_calls = tokenizer, long, 0

    def __call__(self, text, **kwargs):
        texts = [text] if isinstance(text, str) else text
        self.long_calls += sum(len(t) > self.long for t in texts)
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_huge_prompt_is_tokenised_once_and_masked(tokenizer, tmp_path):
    huge = "1+1=" * 64_000  # 256 kB (the char tokenizer takes ~6 s per MB)
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"input": t, "output": "2"}) for t in ("1+1=", huge, "2+2=")) + "\n")
    counting = CountingTokenizer(tokenizer, long=1000)
    ds = build_dataset(_entry(path, max_input_seq_length=6), counting)
    assert counting.long_calls == 1
    for _ in range(3):
        datum = ds[1]
        assert datum.truncated and datum.loss_multiplier == 0.0 and datum.length == 6
        assert datum.token_ids.tolist() == _expected_tokens("1+1=1+")
    assert counting.long_calls == 1 and ds.num_truncated == 1


def test_draws_are_copies(tokenizer, tmp_path):
    path = _write(tmp_path / "rows.jsonl", json.dumps(GOOD[0]))
    ds = build_dataset(_entry(path), tokenizer)
    first = ds[0]
    first.message_log.append({"role": "assistant", "content": "3"})
    first.extra_env_info["ground_truth"] = "changed"
    assert len(ds[0].message_log) == 1 and ds[0].extra_env_info == {"ground_truth": "3"}


def test_data_section_policy_and_skip_counts(tokenizer, tmp_path):
    bad = _write(tmp_path / "bad.jsonl", json.dumps({"input": [1], "output": "3"}))
    good = _write(tmp_path / "good.jsonl", json.dumps(GOOD[0]))
    section = {"train": [_fields(good), _fields(bad)], "bad_rows": "skip"}
    splits = build_data(DataConfig.from_mapping(section), tokenizer)
    assert [len(d) for d in splits.train] == [4, 3] and splits.skipped_rows == {"data.train[1]": 1}
    with pytest.raises(DataError, match=r"data\.train\[1\]: .*bad\.jsonl, line 3"):
        build_data(DataConfig.from_mapping({**section, "bad_rows": "refuse"}), tokenizer)
    with pytest.raises(DataError, match=r"data\.bad_rows='drop': expected one of \('refuse', 'skip'\)"):
        build_data(DataConfig.from_mapping({**section, "bad_rows": "drop"}), tokenizer)


def test_row_problem_walks_without_recursion():
    deep: list = []
    node = deep
    for _ in range(50_000):
        node.append([])
        node = node[0]
    assert "nested deeper than" in row_problem({"a": deep})
    assert row_problem({"a": {"\udc80": 1}}) == "key 'a': a key is not valid Unicode"
    assert row_problem({"a": ["ok", {"b": "fine"}]}) is None
    assert BadRows("skip").summary(10) == "data: skipped 0 bad row(s) of 10: "
