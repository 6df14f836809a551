"""Multi-turn rollouts: generate, let the environment answer, append its observation, repeat.

Turn 1 samples `sampling.n` responses per prompt; each unfinished conversation then continues
with one sample per turn until its environment says it is done, `max_turns` is reached, or the
context is full. Observation tokens join the sequence but are masked out of the loss; the
reward of a sample is the sum of its per-turn rewards.

Tools: when a datum's environment declares tools (`Environment.tools`), its prompt is rendered
again by the tokenizer's chat template with `tools=`; tool-role observations are rendered by the
template too (`chat_tokens`), carried forward as ids, never re-tokenising earlier turns, and the
carried stream is measured against a fresh render of the whole conversation (`rollout/chat_drift_*`).
Environment text holding the text of an added token (`<|im_end|>`, a role marker) is tokenised as
plain text, never as that token (`chat_tokens`); `rollout/env_markup_messages` counts such messages.
An environment may set the next turn's stop strings per sample (`EnvOutput.stop_strings`).

Two schedules, same conversations: `per_sample=False` runs turns in lockstep (every active
conversation generates, then every one is scored: reproducible batches); `per_sample=True` lets
each conversation go on as soon as its own environment answered, so a slow tool call holds back
only its own sample (generation batches then depend on timing).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

from grpo_train.batch import Rollout
from grpo_train.rollout.chat_tokens import ChatTokens, added_tokens, drift, plain_ids
from grpo_train.rollout.single_turn import RolloutResult, generate_in_chunks, prompt_messages, step_environments

TOOL_ROLE = "tool"


@dataclass
class _Conversation:
    datum: object
    prompt_index: int
    prompt_ids: list[int]
    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    gen_logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    turns: int = 0
    text: str = ""
    metadata: dict = field(default_factory=dict)
    stop_strings: tuple[str, ...] | None = None
    """This conversation's stop strings for its next turn (None: the sampling settings')."""
    templated: bool = False
    """Some observation was rendered by the chat template (drift is measured)."""
    last_generated: list[int] = field(default_factory=list)
    last_start: int = 0
    """Where the last generated turn starts in `response_ids`."""
    invalid_spans: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) of the generated turns whose tool calls the env found written wrong."""
    prompt_messages: int = 0
    """How many of `messages` are the prompt's (the rest: the model's turns and the environment's)."""

    def add_generation(self, ids: list[int], logprobs: list[float], text: str, finish_reason: str) -> None:
        self.last_start = len(self.response_ids)
        self.response_ids += ids
        self.response_mask += [1] * len(ids)
        self.gen_logprobs += logprobs
        self.last_generated = list(ids)
        self.messages.append({"role": "assistant", "content": text})
        self.text += text
        self.turns += 1
        self.truncated = finish_reason == "length"

    def invalid_call_mask(self) -> list[int] | None:
        if not self.invalid_spans:
            return None
        mask = [0] * len(self.response_ids)
        for start, end in self.invalid_spans:
            mask[start:end] = [1] * (end - start)
        return mask

    def add_observation(self, ids: list[int], messages: list[dict]) -> None:
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.gen_logprobs += [0.0] * len(ids)
        self.messages += messages


def observation_ids(tokenizer, message: dict) -> list[int]:
    """Tokens of a non-tool environment message appended to the running sequence (its text, plain:
    the text of an added token in it stays text, it does not become that token)."""
    text = str(message.get("content", ""))
    if any(token in text for token in added_tokens(tokenizer)):
        return plain_ids(tokenizer, text)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class _TurnRunner:
    """The pieces of one turn, shared by the lockstep and the per-sample schedules."""

    def __init__(
        self, generator, envs: dict, sampling, tokenizer, max_turns: int, max_total_len: int, chunk_size: int | None
    ) -> None:
        self.generator, self.envs, self.sampling, self.tokenizer = generator, envs, sampling, tokenizer
        self.max_turns, self.max_total_len, self.chunk_size = max_turns, max_total_len, chunk_size
        self._chats: dict[str, ChatTokens] = {}
        self.metrics = _TurnMetrics(envs)
        self.generate_s = self.reward_s = 0.0
        self.markup_messages = 0  # environment messages holding added-token text (tokenised as plain text)
        self._added = added_tokens(tokenizer)
        self._lock = threading.Lock()  # the per-sample schedule adds timings and metrics from threads

    def chat(self, datum) -> ChatTokens:
        """The template's renders for `datum`'s conversations, with its dataset's `chat_template_kwargs`."""
        kwargs = getattr(datum, "chat_template_kwargs", None) or {}
        key = json.dumps(kwargs, sort_keys=True, default=repr)
        with self._lock:
            if key not in self._chats:
                self._chats[key] = ChatTokens.of(self.tokenizer, kwargs)
            return self._chats[key]

    def conversations(self, datums: list) -> list[_Conversation]:
        convs = []
        for p, d in enumerate(datums):
            pool = self.envs.get(d.env_name)
            tools = list(pool.tools()) if pool is not None and hasattr(pool, "tools") else []
            # With tools, the prompt is rendered again from the messages' own text (not the pieces
            # a processor rendered), and the conversation goes on from those messages.
            messages = prompt_messages(d, raw=bool(tools))
            ids = d.token_ids.tolist()
            if tools:
                ids = self.chat(d).prompt_ids(messages, tools)
            convs += [
                _Conversation(d, p, list(ids), list(messages), tools, prompt_messages=len(messages))
                for _ in range(self.sampling.n)
            ]
        return convs

    def generate(self, convs: list[_Conversation], first: bool) -> None:
        """One turn of generation for `convs` (the first turn: `sampling.n` samples per prompt)."""
        start = time.perf_counter()
        if first:
            n = self.sampling.n
            results = generate_in_chunks(
                self.generator, [c.prompt_ids for c in convs[::n]], self.sampling, self.chunk_size
            )
            for conv, res in zip(convs, results):
                self._absorb(conv, res)
        else:
            groups: dict[tuple[str, ...] | None, list[_Conversation]] = {}
            for conv in convs:
                groups.setdefault(conv.stop_strings, []).append(conv)
            for stops, group in groups.items():
                spec = replace(self.sampling, n=1, stop_strings=self.sampling.stop_strings if stops is None else stops)
                results = generate_in_chunks(
                    self.generator, [c.prompt_ids + c.response_ids for c in group], spec, self.chunk_size
                )
                for conv, res in zip(group, results):
                    self._absorb(conv, res, spec.stop_strings)
        with self._lock:
            self.generate_s += time.perf_counter() - start

    def _absorb(self, conv: _Conversation, res, stops: tuple[str, ...] | None = None) -> None:
        text = res.text
        if res.finish_reason == "stop":  # the text is cut before a stop string its ids still hold
            full = self.tokenizer.decode(list(res.response_ids), skip_special_tokens=True)
            tail = full[len(text) :] if full.startswith(text) else ""
            text += next((s for s in (stops or self.sampling.stop_strings) if tail.startswith(s)), "")
        conv.add_generation(list(res.response_ids), list(res.response_logprobs), text, res.finish_reason)

    def step(self, convs: list[_Conversation]) -> None:
        """Score `convs` and append each unfinished conversation's observation."""
        start = time.perf_counter()
        env = step_environments(self.envs, [c.datum for c in convs], [c.messages for c in convs])
        for conv, reward, obs, done, meta, stop in zip(
            convs, env.rewards, env.observations, env.terminateds, env.metadata, env.stop_strings
        ):
            conv.reward += reward
            conv.metadata = meta
            if meta.get("invalid_tool_calls"):  # this turn's calls were written wrong
                conv.invalid_spans.append((conv.last_start, conv.last_start + len(conv.last_generated)))
            conv.stop_strings = tuple(stop) if stop is not None else None
            conv.done = done or obs is None or conv.turns >= self.max_turns
            if not conv.done and obs is not None:
                self._observe(conv, obs if isinstance(obs, list) else [obs])
        with self._lock:
            self.metrics.add(env.metrics, len(convs))
            self.reward_s += time.perf_counter() - start

    def _observe(self, conv: _Conversation, messages: list[dict]) -> None:
        marked = sum(any(t in str(m.get("content", "")) for t in self._added) for m in messages)
        if marked:
            with self._lock:
                self.markup_messages += marked
        if all(m.get("role") == TOOL_ROLE for m in messages):
            ids = self.chat(conv.datum).between_turns_ids(conv.last_generated, messages)
            conv.templated = True
        else:
            ids = [t for m in messages for t in observation_ids(self.tokenizer, m)]
        room = self.max_total_len - self.sampling.max_new_tokens - len(conv.prompt_ids) - len(conv.response_ids)
        if len(ids) > room:
            conv.done = conv.truncated = True  # no room for the observation and another turn
        else:
            conv.add_observation(ids, messages)


class _TurnMetrics:
    """Env metrics over the turns of a rollout: counts summed, means weighted by samples scored."""

    def __init__(self, envs: dict) -> None:
        self.counts = {f"env/{name}/{k}" for name, pool in envs.items() for k in getattr(pool, "count_metrics", ())}
        self.sums: dict[str, float] = {}
        self.weights: dict[str, int] = {}

    def add(self, metrics: dict[str, float], n: int) -> None:
        for key, value in metrics.items():
            weight = 1 if key in self.counts else n
            self.sums[key] = self.sums.get(key, 0.0) + value * weight
            self.weights[key] = self.weights.get(key, 0) + weight

    def result(self) -> dict[str, float]:
        return {k: v if k in self.counts else v / max(self.weights[k], 1) for k, v in self.sums.items()}


def multi_turn_rollout(
    generator,
    envs: dict,
    datums: list,
    sampling,
    tokenizer,
    max_turns: int,
    max_total_len: int,
    chunk_size: int | None = None,
    per_sample: bool = False,
) -> RolloutResult:
    runner = _TurnRunner(generator, envs, sampling, tokenizer, max_turns, max_total_len, chunk_size)
    convs = runner.conversations(datums)
    (_per_sample_turns if per_sample else _lockstep_turns)(runner, convs)
    rollouts = [
        Rollout(
            prompt_index=c.prompt_index,
            prompt_ids=c.prompt_ids,
            response_ids=c.response_ids,
            gen_logprobs=c.gen_logprobs,
            text=c.text,
            truncated=c.truncated,
            reward=c.reward,
            loss_multiplier=float(c.datum.loss_multiplier),
            task_name=c.datum.task_name,
            dataset_name=getattr(c.datum, "dataset_name", ""),
            env_metadata=c.metadata,
            response_mask=c.response_mask,
            turns=c.turns,
            invalid_call_mask=c.invalid_call_mask(),
        )
        for c in convs
    ]
    metrics = runner.metrics.result()
    metrics.update(_conversation_metrics(runner, convs))
    return RolloutResult(rollouts, metrics, runner.generate_s, runner.reward_s)


def _lockstep_turns(runner: _TurnRunner, convs: list[_Conversation]) -> None:
    for turn in range(runner.max_turns):
        active = [c for c in convs if not c.done]
        if not active:
            break
        runner.generate(active, first=turn == 0)
        runner.step(active)


def _per_sample_turns(runner: _TurnRunner, convs: list[_Conversation]) -> None:
    """Each conversation is scored on its own thread; the conversations whose environment has
    answered are generated together at once, without waiting for the others."""
    runner.generate(convs, first=True)
    with ThreadPoolExecutor(max_workers=max(1, min(len(convs), 64)), thread_name_prefix="turn") as pool:
        # future -> (is a generation, its conversations); only this thread touches `pending`.
        pending: dict[Future, tuple[bool, list[_Conversation]]] = {
            pool.submit(runner.step, [c]): (False, [c]) for c in convs
        }
        while pending:
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            ready: list[_Conversation] = []
            for future in done:
                generated, group = pending.pop(future)
                future.result()  # an error in a turn ends the rollout, as in lockstep
                if generated:
                    pending.update({pool.submit(runner.step, [c]): (False, [c]) for c in group})
                else:
                    ready += [c for c in group if not c.done and c.turns < runner.max_turns]
            if ready:
                pending[pool.submit(runner.generate, ready, False)] = (True, ready)


def _conversation_metrics(runner: _TurnRunner, convs: list[_Conversation]) -> dict[str, float]:
    n = max(len(convs), 1)
    metrics = {
        "turns_mean": sum(c.turns for c in convs) / n,
        "rollout/turns_max": float(max((c.turns for c in convs), default=0)),
    }
    calls = sum(v for k, v in runner.metrics.result().items() if k.endswith("/tool_calls"))
    if calls or any(c.tools for c in convs):
        metrics["rollout/calls_per_turn"] = calls / max(sum(c.turns for c in convs), 1)
    if runner.markup_messages:
        metrics["rollout/env_markup_messages"] = float(runner.markup_messages)
    templated = [c for c in convs if c.templated]
    if templated:
        drifts = [
            drift(c.prompt_ids + c.response_ids, runner.chat(c.datum).fresh_ids(c.messages, c.tools, c.prompt_messages))
            for c in templated
        ]
        metrics["rollout/chat_drift_samples"] = float(sum(d > 0 for d in drifts))
        metrics["rollout/chat_drift_tokens_mean"] = sum(drifts) / len(drifts)
    return metrics
