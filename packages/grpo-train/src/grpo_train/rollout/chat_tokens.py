"""Chat-template tokens of a tool conversation: prompts with tools, tool messages between turns.

A multi-turn sequence is built by carrying token ids forward: the prompt, then each turn's
generated ids as sampled, then the ids of the environment's messages. Earlier turns are never
re-tokenised (the trainer must score exactly the ids that were sampled). The environment's
messages are rendered through the tokenizer's chat template by difference: the template renders
a fixed conversation ending in an assistant turn, then the same conversation with the new
messages and the next assistant header; the text past the assistant turn's end-of-turn token is
what the new messages add. If a turn did not end with that token (a stop string, out of
tokens), it is appended first so that the turn is closed as the template closes it.

Where a template renders earlier turns differently once later ones exist (e.g. it drops the
reasoning of earlier turns), the carried stream cannot equal a fresh render of the whole
conversation; :func:`drift` counts the tokens where they part. Every render (the prompt with
tools, the messages between turns, the fresh reference) passes the dataset's
`chat_template_kwargs` (e.g. `enable_thinking`), as the prompt's own render did.

Environment text is data, never markup: a tool result holding the text of one of the tokenizer's
added tokens (`<|im_end|>`, `<|im_start|>user`, or a non-special added marker such as `<end>`)
would otherwise be tokenised as that token and could close the turn or forge a role. Such text is
tokenised as plain text (the tokenizer's normalizer, pre-tokenizer and model, without its added
tokens), while the template's own markers around it stay single tokens; a fresh render treats the
same messages the same way, so carried ids still equal it. Text without any added-token text
takes the ordinary path unchanged. The model's own turns are carried as sampled ids and never
re-tokenised.
Boundary: tokenizer in, ids out; no generation, no environments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_MARK = "QZXJMARK"
_BASE = [{"role": "user", "content": "QZXJU"}, {"role": "assistant", "content": _MARK}]


@dataclass
class ChatTokens:
    """How one tokenizer's chat template turns messages into ids between turns."""

    tokenizer: Any
    end_of_turn_id: int | None
    """The special token that closes an assistant turn in this template (None: the template has none)."""
    _prefix: str = ""
    kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of every `apply_chat_template` call (the data's `chat_template_kwargs`)."""
    added: dict[str, int] = field(default_factory=dict)
    """The tokenizer's added tokens (special or not), text -> id: markup that environment text must not produce."""

    @classmethod
    def of(cls, tokenizer, chat_template_kwargs: dict | None = None) -> ChatTokens:
        kwargs = dict(chat_template_kwargs or {})
        text = tokenizer.apply_chat_template(_BASE, tokenize=False, **kwargs)
        after = text[text.rindex(_MARK) + len(_MARK) :]
        specials = sorted(tokenizer.all_special_tokens + list(tokenizer.get_added_vocab()), key=len, reverse=True)
        end = next((s for s in specials if s and after.startswith(s)), None)
        end_id = tokenizer.convert_tokens_to_ids(end) if end else None
        prefix = text[: text.rindex(_MARK) + len(_MARK) + len(end or "")]
        return cls(tokenizer, end_id, prefix, kwargs, added_tokens(tokenizer))

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The prompt of a conversation with ``tools`` rendered by the template, ready to generate."""
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
                **self.kwargs,
            )
        )

    def between_turns_ids(self, generated_ids: list[int], messages: list[dict]) -> list[int]:
        """Ids to append after a turn's ``generated_ids``: the end-of-turn token when the turn
        lacks it, then ``messages`` and the next assistant header as the template renders them."""
        convo = [*_BASE, *messages]
        text = self._render(convo, None, add_generation_prompt=True)
        if not text.startswith(self._prefix):
            raise ValueError(
                "the chat template renders the earlier turns differently after these messages; "
                "cannot append them without re-tokenising"
            )
        ids = self._encode(convo, None, range(len(_BASE), len(convo)), len(self._prefix), add_generation_prompt=True)
        end = self.end_of_turn_id
        if end is None or (generated_ids and generated_ids[-1] == end):
            return list(ids)
        return [end, *ids]

    def fresh_ids(self, messages: list[dict], tools: list[dict] | None, prompt_messages: int = 0) -> list[int]:
        """The whole conversation rendered at once (the reference the carried ids are measured
        against). The messages past the first ``prompt_messages`` that are not the model's own
        turns are environment text, tokenised as `between_turns_ids` tokenises it."""
        env = [i for i in range(prompt_messages, len(messages)) if messages[i].get("role") != "assistant"]
        return self._encode(messages, tools, env, 0)

    def holds_markup(self, text: str) -> bool:
        """Whether ``text`` holds the text of an added token (and is tokenised as plain text)."""
        return any(token in text for token in self.added)

    def _render(self, messages: list[dict], tools: list[dict] | None, **render: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, **render, **self.kwargs
        )

    def _encode(self, messages: list[dict], tools: list[dict] | None, env: Any, skip: int, **render: Any) -> list[int]:
        """Ids of the render of ``messages`` past its first ``skip`` characters; the contents of
        the messages at the indices ``env`` are tokenised as plain text."""
        text = self._render(messages, tools, **render)
        contents = {f"{_MARK}{i}C": str(messages[i].get("content", "")) for i in env}
        if not any(self.holds_markup(c) for c in contents.values()):
            return list(self.tokenizer(text[skip:], add_special_tokens=False)["input_ids"])
        marked = [{**m, "content": f"{_MARK}{i}C"} if f"{_MARK}{i}C" in contents else m for i, m in enumerate(messages)]
        pieces = re.split("(" + "|".join(map(re.escape, contents)) + ")", self._render(marked, tools, **render))
        if "".join(contents.get(p, p) for p in pieces) != text:
            raise ValueError(
                "the chat template rewrites environment message text; cannot keep the added-token "
                "text in it from being tokenised as markup"
            )
        markup = re.compile("(" + "|".join(map(re.escape, sorted(self.added, key=len, reverse=True))) + ")")
        ids: list[int] = []
        plain, seen = "", 0
        for piece in pieces:  # template text split at its own added tokens; contents stay plain text
            parts = [piece] if piece in contents else markup.split(piece)
            for k, part in enumerate(parts):
                start, seen = seen, seen + len(contents.get(part, part))
                if seen <= skip:
                    continue
                if piece not in contents and k % 2 == 1:
                    ids += plain_ids(self.tokenizer, plain) + [self.added[part]]
                    plain = ""
                else:
                    plain += contents.get(part, part)[max(skip - start, 0) :]
        return ids + plain_ids(self.tokenizer, plain)


def added_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's added tokens, special or not (text -> id), without empty ones."""
    return {text: i for text, i in tokenizer.get_added_vocab().items() if text}


def plain_ids(tokenizer, text: str) -> list[int]:
    """``text`` tokenised without matching any added token: the fast tokenizer's normalizer,
    pre-tokenizer and model, as it tokenises the text between added tokens (a slow tokenizer:
    with its special tokens split)."""
    if not text:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
    return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


def drift(carried: list[int], fresh: list[int]) -> int:
    """Tokens of ``carried`` past the point where it parts from ``fresh`` (0: a prefix of it).

    The fresh render may add what follows the last turn's end-of-turn token (a newline), which
    the carried stream never generates; that is not drift."""
    common = 0
    for a, b in zip(carried, fresh):
        if a != b:
            break
        common += 1
    return len(carried) - common
