"""Multi-turn rollouts: generate, let the environment answer, append its observation, repeat.

Turn 1 samples `sampling.n` responses per prompt; each unfinished conversation then continues
with one sample per turn until its environment says it is done, `max_turns` is reached, or the
context is full. Observation tokens join the sequence but are masked out of the loss; the
reward of a sample is the sum of its per-turn rewards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from grpo_train.batch import Rollout
from grpo_train.rollout.single_turn import RolloutResult, generate_in_chunks, prompt_messages, step_environments


@dataclass
class _Conversation:
    datum: object
    prompt_index: int
    prompt_ids: list[int]
    messages: list[dict]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    gen_logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    turns: int = 0
    text: str = ""
    metadata: dict = field(default_factory=dict)

    def add_generation(self, ids: list[int], logprobs: list[float], text: str, finish_reason: str) -> None:
        self.response_ids += ids
        self.response_mask += [1] * len(ids)
        self.gen_logprobs += logprobs
        self.messages.append({"role": "assistant", "content": text})
        self.text += text
        self.turns += 1
        self.truncated = finish_reason == "length"

    def add_observation(self, ids: list[int], message: dict) -> None:
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.gen_logprobs += [0.0] * len(ids)
        self.messages.append(message)


def observation_ids(tokenizer, message: dict) -> list[int]:
    """Tokens of an environment message appended to the running sequence (its text, plain)."""
    return tokenizer(str(message.get("content", "")), add_special_tokens=False)["input_ids"]


def multi_turn_rollout(generator, envs: dict, datums: list, sampling, tokenizer, max_turns: int,
                       max_total_len: int, chunk_size: int | None = None) -> RolloutResult:
    n = sampling.n
    convs = [_Conversation(d, p, d.token_ids.tolist(), prompt_messages(d)) for p, d in enumerate(datums) for _ in range(n)]
    generate_s = reward_s = 0.0
    metrics: dict[str, float] = {}
    for turn in range(max_turns):
        active = [c for c in convs if not c.done]
        if not active:
            break
        start = time.perf_counter()
        if turn == 0:
            results = generate_in_chunks(generator, [d.token_ids.tolist() for d in datums], sampling, chunk_size)
        else:
            prompts = [c.prompt_ids + c.response_ids for c in active]
            results = generate_in_chunks(generator, prompts, replace(sampling, n=1), chunk_size)
        generate_s += time.perf_counter() - start
        for conv, res in zip(active, results):
            conv.add_generation(list(res.response_ids), list(res.response_logprobs), res.text, res.finish_reason)

        start = time.perf_counter()
        env = step_environments(envs, [c.datum for c in active], [c.messages for c in active])
        for conv, reward, obs, done, meta in zip(active, env.rewards, env.observations, env.terminateds, env.metadata):
            conv.reward += reward
            conv.metadata = meta
            conv.done = done or obs is None
            if not conv.done:
                ids = observation_ids(tokenizer, obs)
                room = max_total_len - sampling.max_new_tokens - len(conv.prompt_ids) - len(conv.response_ids)
                if len(ids) > room:
                    conv.done = conv.truncated = True  # no room for the observation and another turn
                else:
                    conv.add_observation(ids, obs)
        metrics.update(env.metrics)
        reward_s += time.perf_counter() - start
    rollouts = [
        Rollout(prompt_index=c.prompt_index, prompt_ids=c.prompt_ids, response_ids=c.response_ids,
                gen_logprobs=c.gen_logprobs, text=c.text, truncated=c.truncated, reward=c.reward,
                loss_multiplier=float(c.datum.loss_multiplier), task_name=c.datum.task_name, dataset_name=getattr(c.datum, "dataset_name", ""), env_metadata=c.metadata,
                response_mask=c.response_mask, turns=c.turns)
        for c in convs
    ]
    metrics["turns_mean"] = sum(c.turns for c in convs) / max(len(convs), 1)
    return RolloutResult(rollouts, metrics, generate_s, reward_s)
