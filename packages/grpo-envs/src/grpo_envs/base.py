"""The environment interface: message logs in, rewards, observations and done flags out.

An environment never sees tokens. A *message log* is the conversation of one sample, a list of
``{"role": str, "content": str}`` dicts whose last ``assistant`` message is the response being
scored; an *env_info* dict carries what the environment needs to score it (e.g.
``{"ground_truth": "46"}``). ``step`` scores a whole batch at once and returns one
:class:`EnvOutput` whose lists are aligned with the batch.

Metrics are merged across batch chunks (see :meth:`Environment.merge_metrics`): by default a
metric is a per-sample mean and is merged as a weighted mean; names listed in an
environment's ``COUNT_METRICS`` are event counts and are summed.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

Message = dict[str, Any]
MessageLog = list[Message]


@dataclass
class EnvOutput:
    """The result of one ``step`` over a batch of B samples; every list has length B."""

    rewards: list[float]
    observations: list[dict | list[dict] | None]
    """Next message for a multi-turn environment, e.g. ``{"role": "environment", "content": ...}``,
    or a list of messages (one ``{"role": "tool", ...}`` message per tool call of the turn); None
    where the environment has nothing to say."""
    terminateds: list[bool]
    metadata: list[dict]
    """Per-sample facts for logging (extracted answer, status, ...); JSON-serialisable."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Batch-level metrics (see the module docstring for how chunks are merged)."""
    stop_strings: list[tuple[str, ...] | None] | None = None
    """Stop strings of each sample's next turn (e.g. ``("</tool_call>",)``); None, for the whole
    batch or for one sample, keeps the sampling settings' own."""

    def __post_init__(self) -> None:
        n = len(self.rewards)
        for name in ("observations", "terminateds", "metadata", "stop_strings"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(f"EnvOutput.{name} has {len(getattr(self, name))} entries but rewards has {n}")

    def __len__(self) -> int:
        return len(self.rewards)

    @classmethod
    def concat(cls, parts: Sequence[EnvOutput], metrics: dict[str, float]) -> EnvOutput:
        """Join chunk outputs in order; the caller supplies the merged metrics."""
        return cls(
            rewards=[r for p in parts for r in p.rewards],
            observations=[o for p in parts for o in p.observations],
            terminateds=[t for p in parts for t in p.terminateds],
            metadata=[m for p in parts for m in p.metadata],
            metrics=metrics,
            stop_strings=None
            if all(p.stop_strings is None for p in parts)
            else [s for p in parts for s in (p.stop_strings or [None] * len(p))],
        )


class Environment(abc.ABC):
    """Base class of every environment. Subclasses take their settings as keyword arguments."""

    COUNT_METRICS: ClassVar[frozenset[str]] = frozenset()
    """Metric names that count events in a batch (summed when chunks are merged)."""

    @abc.abstractmethod
    def step(self, message_logs: list[MessageLog], env_infos: list[dict]) -> EnvOutput:
        """Score a batch: ``message_logs[i]`` is sample i's conversation, ``env_infos[i]`` its info."""

    def tools(self) -> list[dict]:
        """Tool schemas the model may call, in the OpenAI / HF chat-template ``tools=`` form
        (``{"type": "function", "function": {"name", "description", "parameters"}}``); the
        rollout renders them into the prompt through the tokenizer's chat template. None by default."""
        return []

    def global_post_process_and_metrics(self, batch_metadata: list[dict]) -> dict[str, float]:
        """Metrics over a whole global batch (all chunks, all turns); none by default."""
        return {}

    def close(self) -> None:  # noqa: B027 - an optional hook: doing nothing is the default
        """Release processes or devices the environment holds."""

    @classmethod
    def merge_metrics(cls, parts: Sequence[tuple[Mapping[str, float], int]]) -> dict[str, float]:
        """Merge ``(metrics, num_samples)`` of chunks into the metrics of the whole batch."""
        total = sum(n for _, n in parts)
        merged: dict[str, float] = {}
        for key in dict.fromkeys(k for metrics, _ in parts for k in metrics):
            present = [(m[key], n) for m, n in parts if key in m]
            if key in cls.COUNT_METRICS:
                merged[key] = float(sum(v for v, _ in present))
            else:
                weight = sum(n for _, n in present) or total or 1
                merged[key] = float(sum(v * n for v, n in present) / weight)
        return merged


def response_text(message_log: MessageLog) -> str | None:
    """The content of the last assistant message, or None when there is none.

    Model output is untrusted: a non-string content (e.g. a list of parts) is joined from its
    text parts rather than raising.
    """
    for message in reversed(message_log):
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            return _as_text(message.get("content"))
    return None


def _as_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, Mapping) else str(part) for part in content)
    return "" if content is None else str(content)


def count_turns(message_log: MessageLog) -> int:
    """Number of assistant messages in a conversation."""
    return sum(1 for m in message_log if isinstance(m, Mapping) and m.get("role") == "assistant")


def single_turn_output(rewards: list[float], metadata: list[dict], metrics: dict[str, float]) -> EnvOutput:
    """EnvOutput of a single-turn environment: no observations, every sample done."""
    n = len(rewards)
    return EnvOutput(
        rewards=rewards,
        observations=[None] * n,
        terminateds=[True] * n,
        metadata=metadata,
        metrics=metrics,
    )


def preview(text: str | None, limit: int = 200) -> str | None:
    """``text`` cut to ``limit`` characters for metadata (model output can be megabytes)."""
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"...[{len(text) - limit} more chars]"
