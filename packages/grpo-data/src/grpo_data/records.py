"""Typed records that flow out of grpo-data: one `DatumSpec` per prompt, one `TaskSpec` per task.

grpo-data speaks tokens and tensors; it knows nothing about rewards. A `DatumSpec` carries the
tokenised prompt (per message, so a trainer can rebuild the conversation), the information an
environment needs to score a response (`extra_env_info`, e.g. the ground-truth answer) and the
name of the environment that should score it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from grpo_data.errors import DataError

# A prompt value that looks like this is meant as a file; if the file is missing that is an
# error rather than a literal one-line prompt "prompts/cot.txt".
_PATH_LIKE = re.compile(r"^[^\n{}]*\.(txt|md|jinja|prompt|tmpl)$")


@dataclass
class DatumSpec:
    """One tokenised prompt, ready for generation.

    `message_log` holds the prompt messages in order; each is
    `{"role": str, "content": str, "token_ids": torch.LongTensor}` with `token_ids` of shape
    `[L_i]`. `content` is the exact text that `token_ids` encode (with a chat template, the
    rendered piece of the template, special tokens included), so the contents joined equal the
    prompt text. `length = sum(L_i)` is the number of prompt tokens.

    `loss_multiplier` is 0.0 for a prompt that was truncated to fit `max_seq_length`: it is
    kept in the batch so nothing is silently dropped, but it must not contribute to the loss.
    """

    message_log: list[dict]
    length: int
    extra_env_info: dict
    loss_multiplier: float = 1.0
    idx: int = 0
    task_name: str = "default"
    env_name: str = "math"
    # Additions after the first interface (all defaulted, so older call sites keep working).
    truncated: bool = False
    dataset_name: str = ""
    chat_template_kwargs: dict | None = None
    """The dataset entry's `chat_template_kwargs` (e.g. `enable_thinking`): the multi-turn rollout
    renders this prompt's tools and tool messages with them too."""

    def __reduce__(self):
        # Pickled token ids travel as numpy arrays. Sent as tensors between dataloader worker
        # processes, every tiny tensor would become its own shared-memory segment, which made
        # num_workers=2 five times slower than no workers at all.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["message_log"] = [
            {**m, "token_ids": m["token_ids"].detach().cpu().numpy()}
            if isinstance(m.get("token_ids"), torch.Tensor)
            else m
            for m in self.message_log
        ]
        return (_rebuild_datum, (fields,))

    @property
    def token_ids(self) -> torch.Tensor:
        """All prompt tokens in order, `[length]` (int64)."""
        if not self.message_log:
            return torch.empty(0, dtype=torch.long)
        return torch.cat([m["token_ids"] for m in self.message_log])


def _rebuild_datum(fields: dict) -> DatumSpec:
    fields["message_log"] = [
        {**m, "token_ids": torch.from_numpy(m["token_ids"])} if isinstance(m.get("token_ids"), np.ndarray) else m
        for m in fields["message_log"]
    ]
    return DatumSpec(**fields)


def load_prompt_text(value: str | Path | None, what: str = "prompt") -> str | None:
    """Read a prompt from a file path, or take `value` itself as the prompt text.

    An existing file is read (UTF-8, verbatim). A value that looks like a file name
    (`*.txt`, `*.md`, ...) but does not exist raises, naming the path. Anything else is the
    prompt text itself.
    """
    if value is None:
        return None
    path = Path(value)
    text = str(value)
    try:
        is_file = "\n" not in text and len(text) < 4096 and path.is_file()
    except OSError:
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    if isinstance(value, Path) or _PATH_LIKE.match(text.strip()):
        raise DataError(f"{what} file not found: {text!r} (give an existing file or the prompt text itself)")
    return text


@dataclass(frozen=True)
class TaskSpec:
    """How raw rows of one task become prompts.

    `prompt_template` contains a `{}` placeholder that the problem text replaces (Python
    `str.format` rules: write literal braces as `{{` and `}}`). `system_prompt` becomes a
    system message where the processor uses a chat template.
    """

    task_name: str
    system_prompt: str | None = None
    prompt_template: str | None = None
    # Where the template came from, for error messages only.
    template_source: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.prompt_template is not None:
            source = self.template_source or "prompt_template"
            try:
                probe = self.prompt_template.format("\x00")
            except (IndexError, KeyError, ValueError) as exc:
                raise DataError(
                    f"{source}: the prompt template must contain exactly one '{{}}' placeholder and "
                    f"write literal braces as '{{{{' / '}}}}' ({type(exc).__name__}: {exc})"
                ) from None
            if "\x00" not in probe:
                raise DataError(f"{source}: the prompt template has no '{{}}' placeholder for the problem")

    @classmethod
    def from_files(
        cls,
        task_name: str,
        prompt_file: str | Path | None = None,
        system_prompt_file: str | Path | None = None,
    ) -> TaskSpec:
        """Build a spec from a prompt file / system prompt file (each a path or the text itself)."""
        return cls(
            task_name=task_name,
            system_prompt=load_prompt_text(system_prompt_file, "system_prompt_file"),
            prompt_template=load_prompt_text(prompt_file, "prompt_file"),
            template_source=str(prompt_file) if prompt_file is not None else None,
        )

    def render(self, problem: str) -> str:
        """The problem text through the template (the problem itself if there is no template)."""
        if self.prompt_template is None:
            return problem
        return self.prompt_template.format(problem)
