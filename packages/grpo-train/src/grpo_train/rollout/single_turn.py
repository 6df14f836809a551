"""One-turn rollout: prompts -> generations -> environment rewards, as `Rollout` records.

This is where tokens (grpo-data, generation) meet text and rewards (grpo-envs): prompts go to
the generator as token ids; responses go to the environment named by each datum as messages.
The pieces of a turn (`generate_in_chunks`, `step_environments`) are shared with multi_turn.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from grpo_train.batch import Rollout
from grpo_train.generation.base import SamplingSpec


@dataclass
class RolloutResult:
    rollouts: list[Rollout]  # prompt-major: prompt p's samples are rows p*n .. p*n+n-1
    env_metrics: dict[str, float]
    generate_s: float
    reward_s: float


def prompt_messages(datum, raw: bool = False) -> list[dict]:
    """The datum's message log as plain {"role", "content"} messages (no token ids); `raw`: each
    message's own text where a processor rendered it through the chat template (`raw_content`),
    for a render of the conversation again."""
    return [
        {"role": m["role"], "content": m.get("raw_content", m["content"]) if raw else m["content"]}
        for m in datum.message_log
    ]


@dataclass
class EnvStep:
    """Environment answers for a batch of conversations, in the order they were given."""

    rewards: list[float]
    observations: list[dict | list[dict] | None]
    terminateds: list[bool]
    metadata: list[dict]
    metrics: dict[str, float]
    stop_strings: list[tuple[str, ...] | None]
    """Each conversation's next-turn stop strings from its environment (None: the sampling settings')."""


def step_environments(envs: dict, datums: list, message_logs: list[list[dict]]) -> EnvStep:
    """Send conversation i to the environment its datum names; answers come back in order."""
    by_env: dict[str, list[int]] = defaultdict(list)
    for i, datum in enumerate(datums):
        by_env[datum.env_name].append(i)
    n = len(datums)
    step = EnvStep([0.0] * n, [None] * n, [True] * n, [{} for _ in range(n)], {}, [None] * n)
    for env_name, rows in by_env.items():
        if env_name not in envs:
            raise KeyError(f"data routes samples to environment {env_name!r}, but env has only {sorted(envs)}")
        out = envs[env_name].step([message_logs[i] for i in rows], [datums[i].extra_env_info for i in rows])
        for j, i in enumerate(rows):
            step.rewards[i] = float(out.rewards[j])
            step.observations[i] = out.observations[j]
            step.terminateds[i] = bool(out.terminateds[j])
            step.metadata[i] = out.metadata[j]
            step.stop_strings[i] = out.stop_strings[j] if out.stop_strings is not None else None
        step.metrics.update({f"env/{env_name}/{k}": v for k, v in out.metrics.items()})
    return step


def generate_in_chunks(generator, prompts: list, sampling: SamplingSpec, chunk_size: int | None) -> list:
    """`generator.generate` over `prompts` in calls of at most `chunk_size` prompts (policy.generation_batch_size),
    one after the other; the results are those of one call, prompt-major, prompt_index into `prompts`."""
    if not chunk_size or chunk_size >= len(prompts):
        return generator.generate(prompts, sampling)
    results = []
    for start in range(0, len(prompts), chunk_size):
        for res in generator.generate(prompts[start : start + chunk_size], sampling):
            res.prompt_index += start
            results.append(res)
    return results


def rollout(
    generator, envs: dict, datums: list, sampling: SamplingSpec, chunk_size: int | None = None
) -> RolloutResult:
    """Generate `sampling.n` responses per datum and score them (one turn)."""
    start = time.perf_counter()
    prompts = [d.token_ids.tolist() for d in datums]
    results = generate_in_chunks(generator, prompts, sampling, chunk_size)
    generate_s = time.perf_counter() - start
    start = time.perf_counter()
    sample_datums = [datums[r.prompt_index] for r in results]
    logs = [[*prompt_messages(d), {"role": "assistant", "content": r.text}] for d, r in zip(sample_datums, results)]
    env = step_environments(envs, sample_datums, logs)
    reward_s = time.perf_counter() - start
    rollouts = []
    for res, reward, meta in zip(results, env.rewards, env.metadata):
        datum = datums[res.prompt_index]
        rollouts.append(
            Rollout(
                prompt_index=res.prompt_index,
                prompt_ids=list(res.prompt_ids),
                response_ids=list(res.response_ids),
                gen_logprobs=list(res.response_logprobs),
                text=res.text,
                truncated=res.finish_reason == "length",
                reward=reward,
                loss_multiplier=float(datum.loss_multiplier),
                task_name=datum.task_name,
                dataset_name=getattr(datum, "dataset_name", ""),
                env_metadata=meta,
            )
        )
    return RolloutResult(rollouts, env.metrics, generate_s, reward_s)
