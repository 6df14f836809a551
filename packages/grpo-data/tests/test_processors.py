import textwrap

import pytest
import torch

from grpo_data.errors import DataError
from grpo_data.processors import (
    PROCESSORS,
    check_processor_options,
    get_processor,
    math_processor,
    plain_processor,
    register_processor,
    render_chat,
)
from grpo_data.records import TaskSpec
from grpo_data.testing import make_char_tokenizer, token_id

SYS, USER, ASSISTANT, END, NOTHINK = 4, 5, 6, 7, 8


def ids(text: str) -> list[int]:
    return [token_id(c) for c in text]


def test_plain_exact_token_ids(tokenizer):
    datum = plain_processor({"problem": "37+5=", "answer": "42"}, TaskSpec("arithmetic"), tokenizer, 64, 7)
    assert [m["role"] for m in datum.message_log] == ["user"]
    assert datum.message_log[0]["token_ids"].tolist() == [12, 16, 19, 14, 22]
    assert datum.message_log[0]["token_ids"].dtype == torch.long
    assert datum.message_log[0]["content"] == "37+5="
    assert datum.length == 5 and datum.loss_multiplier == 1.0 and not datum.truncated
    assert datum.extra_env_info == {"ground_truth": "42"}
    assert (datum.idx, datum.task_name, datum.env_name) == (7, "arithmetic", "math")


def test_plain_template_system_prompt_and_keys(tokenizer):
    spec = TaskSpec("t", system_prompt="calc\n", prompt_template="Q: {}")
    row = {"q": "1+2=", "a": 3, "extra_env_info": {"level": 1}}
    datum = plain_processor(row, spec, tokenizer, 64, 0, input_key="q", output_key="a")
    assert [m["role"] for m in datum.message_log] == ["system", "user"]
    assert datum.message_log[0]["token_ids"].tolist() == ids("calc\n")
    assert datum.message_log[1]["token_ids"].tolist() == ids("Q: 1+2=")
    assert datum.token_ids.tolist() == ids("calc\nQ: 1+2=")
    assert datum.length == len("calc\nQ: 1+2=")
    assert datum.extra_env_info == {"level": 1, "ground_truth": "3"}


def test_math_renders_the_chat_template_per_message(tokenizer):
    spec = TaskSpec("math", system_prompt="hi", prompt_template="{} ?")
    datum = math_processor({"problem": "1+1=", "answer": "2"}, spec, tokenizer, 64, 0)
    system, user = datum.message_log
    assert system["content"] == "<|system|>hi<|end|>"
    assert system["token_ids"].tolist() == [SYS, *ids("hi"), END]
    assert user["content"] == "<|user|>1+1= ?<|end|><|assistant|>"
    assert user["token_ids"].tolist() == [USER, *ids("1+1= ?"), END, ASSISTANT]
    assert datum.length == 4 + 9
    assert datum.extra_env_info["ground_truth"] == "2"
    # The pieces together are exactly the rendered conversation.
    full = tokenizer.apply_chat_template(
        [{"role": "system", "content": "hi"}, {"role": "user", "content": "1+1= ?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert system["content"] + user["content"] == full
    assert datum.token_ids.tolist() == tokenizer(full, add_special_tokens=False)["input_ids"]


def test_math_passes_chat_template_kwargs(tokenizer):
    datum = math_processor(
        {"problem": "2=", "answer": "2"},
        TaskSpec("math"),
        tokenizer,
        64,
        0,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert datum.message_log[0]["token_ids"].tolist() == [USER, *ids("2="), END, ASSISTANT, NOTHINK]


def test_math_alias_and_missing_chat_template():
    assert PROCESSORS["math_hf_data_processor"] is PROCESSORS["math"]
    bare = make_char_tokenizer(chat_template=None)
    with pytest.raises(DataError, match="chat template"):
        math_processor({"problem": "1=", "answer": "1"}, TaskSpec("m"), bare, 64, 0)


def test_chat_processor_takes_trailing_assistant_as_ground_truth(tokenizer):
    row = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    datum = PROCESSORS["chat"](row, TaskSpec("c", system_prompt="s", prompt_template="{}!"), tokenizer, 64, 3)
    assert [m["role"] for m in datum.message_log] == ["system", "user"]
    assert datum.message_log[1]["token_ids"].tolist() == [USER, *ids("1+1=!"), END, ASSISTANT]
    assert datum.extra_env_info == {"ground_truth": "2"}


def test_chat_processor_rejects_malformed_messages(tokenizer):
    with pytest.raises(DataError, match=r"messages\[0\]"):
        PROCESSORS["chat"]({"messages": [{"role": "user"}]}, TaskSpec("c"), tokenizer, 64, 0)


def test_overlong_prompt_is_truncated_masked_and_kept(tokenizer):
    spec = TaskSpec("math", system_prompt="hi")
    datum = math_processor({"problem": "12345", "answer": "1"}, spec, tokenizer, 6, 0)
    assert datum.truncated and datum.loss_multiplier == 0.0 and datum.length == 6
    assert datum.message_log[0]["token_ids"].tolist() == [SYS, *ids("hi"), END]
    assert datum.message_log[1]["token_ids"].tolist() == [USER, *ids("1")]
    assert datum.token_ids.numel() == 6


def test_overlong_prompt_strict_mode_errors(tokenizer):
    with pytest.raises(DataError, match=r"item 4 .*6 tokens.*max_input_seq_length=5"):
        plain_processor({"problem": "123456", "answer": "1"}, TaskSpec("t"), tokenizer, 5, 4, on_overlong="error")


def test_missing_key_names_key_and_row(tokenizer):
    with pytest.raises(DataError, match=r"item 9: no key 'problem'"):
        plain_processor({"question": "1="}, TaskSpec("t"), tokenizer, 64, 9)
    with pytest.raises(DataError, match=r"key 'answer'"):
        plain_processor({"problem": "1="}, TaskSpec("t"), tokenizer, 64, 9)


def test_registry_and_import_paths(tmp_path, monkeypatch):
    assert get_processor("plain") is plain_processor
    assert get_processor("grpo_data.processors:plain_processor") is plain_processor
    with pytest.raises(DataError, match="built-in processors"):
        get_processor("nope")
    with pytest.raises(DataError, match="cannot import"):
        get_processor("no_such_module_xyz:f")
    (tmp_path / "my_processors.py").write_text(
        textwrap.dedent(
            """
            from grpo_data.processors import plain_processor
            def shout(row, task_spec, tokenizer, max_seq_length, idx):
                return plain_processor({"problem": row["problem"].upper(), "answer": row["answer"]},
                                       task_spec, tokenizer, max_seq_length, idx)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    shout = get_processor("my_processors:shout")
    with pytest.raises(DataError, match="does not accept"):
        check_processor_options(shout, {"on_overlong": "error"}, "my_processors:shout")
    check_processor_options(plain_processor, {"on_overlong": "error"})
    with pytest.raises(DataError, match="chat_template_kwargs"):
        check_processor_options(plain_processor, {"chat_template_kwargs": {}}, "plain")


def test_register_processor_refuses_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        register_processor("plain")(lambda *a: None)


def test_render_chat_falls_back_when_prefixes_cannot_render():
    strict = make_char_tokenizer(
        chat_template="{% if messages[-1]['role'] != 'user' %}{{ raise_exception('need user') }}{% endif %}"
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    pieces = render_chat(strict, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert pieces == ["", "[s][u]"]
