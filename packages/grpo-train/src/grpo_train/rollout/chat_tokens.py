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
Boundary: tokenizer in, ids out; no generation, no environments.
"""

from __future__ import annotations

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

    @classmethod
    def of(cls, tokenizer, chat_template_kwargs: dict | None = None) -> ChatTokens:
        kwargs = dict(chat_template_kwargs or {})
        text = tokenizer.apply_chat_template(_BASE, tokenize=False, **kwargs)
        after = text[text.rindex(_MARK) + len(_MARK):]
        specials = sorted(tokenizer.all_special_tokens + list(tokenizer.get_added_vocab()), key=len, reverse=True)
        end = next((s for s in specials if s and after.startswith(s)), None)
        end_id = tokenizer.convert_tokens_to_ids(end) if end else None
        prefix = text[: text.rindex(_MARK) + len(_MARK) + len(end or "")]
        return cls(tokenizer, end_id, prefix, kwargs)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The prompt of a conversation with ``tools`` rendered by the template, ready to generate."""
        return list(self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                                       add_generation_prompt=True, return_dict=False, **self.kwargs))

    def between_turns_ids(self, generated_ids: list[int], messages: list[dict]) -> list[int]:
        """Ids to append after a turn's ``generated_ids``: the end-of-turn token when the turn
        lacks it, then ``messages`` and the next assistant header as the template renders them."""
        text = self.tokenizer.apply_chat_template([*_BASE, *messages], tokenize=False, add_generation_prompt=True,
                                                  **self.kwargs)
        if not text.startswith(self._prefix):
            raise ValueError("the chat template renders the earlier turns differently after these messages; "
                             "cannot append them without re-tokenising")
        ids = self.tokenizer(text[len(self._prefix):], add_special_tokens=False)["input_ids"]
        end = self.end_of_turn_id
        if end is None or (generated_ids and generated_ids[-1] == end):
            return list(ids)
        return [end, *ids]

    def fresh_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The whole conversation rendered at once (the reference the carried ids are measured against)."""
        return list(self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                                       return_dict=False, **self.kwargs))


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
