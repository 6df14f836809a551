"""Processors: one raw row (a dict) → one tokenised prompt (`DatumSpec`).

Every processor has the signature
`processor(row, task_spec, tokenizer, max_seq_length, idx, **options) -> DatumSpec`; built-in
ones accept the keyword options `input_key`, `output_key`, `on_overlong` (and
`chat_template_kwargs` where a chat template is used). A user processor is named by import
path, "package.module:function", anywhere a processor name is accepted.

Built-ins:
- "plain": the problem text through the prompt template, tokenised as is (no chat template).
  This is the offline demo's format: the tiny model sees "37+5=" and answers "42".
- "math" (alias "math_hf_data_processor"): system prompt + templated problem rendered with the
  tokenizer's chat template; the gold answer goes to `extra_env_info["ground_truth"]`.
- "chat": rows that already hold a conversation in "messages"; a trailing assistant message is
  taken as the ground truth, not as part of the prompt.

A prompt longer than `max_seq_length` is cut to its first `max_seq_length` tokens and gets
`loss_multiplier = 0.0` and `truncated = True` (kept, so nothing is silently dropped), or
raises a `DataError` when `on_overlong="error"`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from grpo_data.errors import DataError
from grpo_data.records import DatumSpec, TaskSpec
from grpo_data.registry import register, resolve

Processor = Callable[..., DatumSpec]

PROCESSORS: dict[str, Processor] = {}

OVERLONG_POLICIES = ("truncate", "error")
DEFAULT_ENV_NAME = "math"
DEFAULT_INPUT_KEY = "problem"
DEFAULT_OUTPUT_KEY = "answer"


def register_processor(name: str) -> Callable[[Processor], Processor]:
    """Decorator: make `fn` available under `name` in `PROCESSORS` (names are unique)."""
    return register(PROCESSORS, name, "processor")


def get_processor(name_or_import_path: str | Processor) -> Processor:
    """A registered processor by name, or a user processor by "module.sub:function"."""
    return resolve(name_or_import_path, PROCESSORS, "processor")


def check_processor_options(processor: Processor, options: Mapping[str, Any], name: str = "") -> None:
    """Raise a `DataError` if `processor` cannot take the keyword `options` the config sets."""
    if not options:
        return
    params = inspect.signature(processor).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise DataError(
            f"processor {name or processor.__name__!r} does not accept the option(s) {unknown}; "
            f"it accepts {sorted(accepted)}"
        )


# ---------------------------------------------------------------------------------------------
# Shared steps


def encode(tokenizer, text: str) -> torch.Tensor:
    """Token ids of `text` without added special tokens, `[L]` int64."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def _text_field(row: Mapping, key: str, idx: int) -> str:
    if key not in row:
        raise DataError(f"item {idx}: no key {key!r} (the row has keys {sorted(row)})")
    value = row[key]
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"item {idx}, key {key!r}: expected text, got {type(value).__name__}")


def _env_info(row: Mapping, output_key: str | None, idx: int, required: bool) -> dict:
    info = dict(row.get("extra_env_info") or {})
    if output_key is not None and (required or output_key in row):
        info["ground_truth"] = _text_field(row, output_key, idx)
    return info


def render_chat(
    tokenizer, messages: Sequence[Mapping[str, str]], chat_template_kwargs: Mapping | None = None
) -> list[str]:
    """Render `messages` with the chat template and split the text into one piece per message.

    The whole conversation is rendered once with the generation prompt; message k's piece is
    the difference between the renderings of messages[:k+1] and messages[:k]. Rendering each
    message alone instead would let templates insert their default system prompt into every
    piece. If a template cannot render a prefix (some require a user turn), the whole prompt
    becomes the last message's piece and the earlier pieces are empty.
    """
    kwargs = dict(chat_template_kwargs or {})
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the tokenizer has no chat template; set tokenizer.chat_template or use the 'plain' processor")

    def apply(msgs: Sequence[Mapping[str, str]], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            list(msgs), tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    full = apply(messages, True)
    pieces: list[str] = []
    previous = ""
    try:
        for k in range(len(messages) - 1):
            prefix = apply(messages[: k + 1], False)
            if not (prefix.startswith(previous) and full.startswith(prefix)):
                raise ValueError("prefix rendering is not a prefix of the full prompt")
            pieces.append(prefix[len(previous) :])
            previous = prefix
    except Exception:  # noqa: BLE001 - any template failure falls back to one piece, documented above
        return [""] * (len(messages) - 1) + [full]
    pieces.append(full[len(previous) :])
    return pieces


def _tokenise_pieces(tokenizer, messages: Sequence[Mapping[str, str]], pieces: Sequence[str]) -> list[dict]:
    """One message-log entry per rendered piece; `raw_content` keeps the message's own text, for
    renders after the prompt's (the multi-turn rollout renders tools into the prompt again)."""
    ids = tokenizer(list(pieces), add_special_tokens=False)["input_ids"]
    return [
        {
            "role": m["role"],
            "content": piece,
            "token_ids": torch.tensor(tok, dtype=torch.long),
            "raw_content": m["content"],
        }
        for m, piece, tok in zip(messages, pieces, ids)
    ]


def finish_datum(
    message_log: list[dict],
    extra_env_info: dict,
    max_seq_length: int | None,
    idx: int,
    task_name: str,
    env_name: str = DEFAULT_ENV_NAME,
    on_overlong: str = "truncate",
) -> DatumSpec:
    """Count the prompt tokens and apply the overlong policy; the last step of every processor."""
    if on_overlong not in OVERLONG_POLICIES:
        raise DataError(f"on_overlong={on_overlong!r}; expected one of {OVERLONG_POLICIES}")
    length = sum(len(m["token_ids"]) for m in message_log)
    truncated = max_seq_length is not None and length > max_seq_length
    if max_seq_length is not None and truncated:
        if on_overlong == "error":
            raise DataError(
                f"item {idx} ({task_name}): the prompt has {length} tokens, more than "
                f"max_input_seq_length={max_seq_length}; raise the limit or set on_overlong: truncate"
            )
        budget = max_seq_length
        for message in message_log:
            keep = min(budget, len(message["token_ids"]))
            message["token_ids"] = message["token_ids"][:keep]
            budget -= keep
        length = max_seq_length
    return DatumSpec(
        message_log=message_log,
        length=length,
        extra_env_info=extra_env_info,
        loss_multiplier=0.0 if truncated else 1.0,
        idx=idx,
        task_name=task_name,
        env_name=env_name,
        truncated=truncated,
    )


def _task_name(row: Mapping, task_spec: TaskSpec) -> str:
    return row.get("task_name") or task_spec.task_name


def _env_name(row: Mapping) -> str:
    return row.get("env_name") or DEFAULT_ENV_NAME


# ---------------------------------------------------------------------------------------------
# Built-in processors


@register_processor("plain")
def plain_processor(
    row: Mapping,
    task_spec: TaskSpec,
    tokenizer,
    max_seq_length: int | None,
    idx: int,
    *,
    input_key: str = DEFAULT_INPUT_KEY,
    output_key: str = DEFAULT_OUTPUT_KEY,
    on_overlong: str = "truncate",
) -> DatumSpec:
    """Problem text through the template, tokenised without a chat template or special tokens.

    A system prompt, if any, is its own message, tokenised verbatim before the problem.
    """
    message_log = []
    if task_spec.system_prompt:
        message_log.append(
            {
                "role": "system",
                "content": task_spec.system_prompt,
                "token_ids": encode(tokenizer, task_spec.system_prompt),
            }
        )
    text = task_spec.render(_text_field(row, input_key, idx))
    message_log.append({"role": "user", "content": text, "token_ids": encode(tokenizer, text)})
    return finish_datum(
        message_log,
        _env_info(row, output_key, idx, required=True),
        max_seq_length,
        idx,
        _task_name(row, task_spec),
        _env_name(row),
        on_overlong,
    )


@register_processor("math")
@register_processor("math_hf_data_processor")
def math_processor(
    row: Mapping,
    task_spec: TaskSpec,
    tokenizer,
    max_seq_length: int | None,
    idx: int,
    *,
    input_key: str = DEFAULT_INPUT_KEY,
    output_key: str = DEFAULT_OUTPUT_KEY,
    chat_template_kwargs: Mapping | None = None,
    on_overlong: str = "truncate",
) -> DatumSpec:
    """System prompt + templated problem through the chat template, with the generation prompt."""
    messages = []
    if task_spec.system_prompt:
        messages.append({"role": "system", "content": task_spec.system_prompt})
    messages.append({"role": "user", "content": task_spec.render(_text_field(row, input_key, idx))})
    pieces = render_chat(tokenizer, messages, chat_template_kwargs)
    message_log = _tokenise_pieces(tokenizer, messages, pieces)
    return finish_datum(
        message_log,
        _env_info(row, output_key, idx, required=True),
        max_seq_length,
        idx,
        _task_name(row, task_spec),
        _env_name(row),
        on_overlong,
    )


def _conversation(row: Mapping, input_key: str, idx: int) -> list[dict]:
    messages = row.get(input_key)
    if messages is None and isinstance(row.get(DEFAULT_INPUT_KEY), list):
        messages = row[DEFAULT_INPUT_KEY]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"item {idx}, key {input_key!r}: expected a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        if (
            not isinstance(message, Mapping)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DataError(f"item {idx}, key '{input_key}[{i}]': expected {{'role': str, 'content': str}}")
        out.append({"role": message["role"], "content": message["content"]})
    return out


@register_processor("chat")
def chat_processor(
    row: Mapping,
    task_spec: TaskSpec,
    tokenizer,
    max_seq_length: int | None,
    idx: int,
    *,
    input_key: str = "messages",
    output_key: str = DEFAULT_OUTPUT_KEY,
    chat_template_kwargs: Mapping | None = None,
    on_overlong: str = "truncate",
) -> DatumSpec:
    """A conversation already in the row; a trailing assistant turn is the ground truth.

    The task's system prompt is prepended when the conversation has none, and the prompt
    template is applied to the last user message.
    """
    messages = _conversation(row, input_key, idx)
    extra_env_info = _env_info(row, output_key, idx, required=False)
    if messages[-1]["role"] == "assistant":
        extra_env_info.setdefault("ground_truth", messages.pop()["content"])
    if not messages:
        raise DataError(f"item {idx}, key {input_key!r}: the conversation has no prompt before the assistant turn")
    if task_spec.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": task_spec.system_prompt})
    if task_spec.prompt_template is not None:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is not None:
            messages[last_user]["content"] = task_spec.render(messages[last_user]["content"])
    pieces = render_chat(tokenizer, messages, chat_template_kwargs)
    message_log = _tokenise_pieces(tokenizer, messages, pieces)
    return finish_datum(
        message_log, extra_env_info, max_seq_length, idx, _task_name(row, task_spec), _env_name(row), on_overlong
    )
