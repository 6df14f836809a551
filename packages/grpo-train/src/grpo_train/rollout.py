"""Rollout: prompts -> generations -> environment rewards, as `Rollout` records.

This is where tokens (grpo-data, generation) meet text and rewards (grpo-envs): prompts go to
the generator as token ids; responses go to the environment named by each datum as messages.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import ray

from grpo_train.batch import Rollout
from grpo_train.generation.base import SamplingSpec


@dataclass
class RolloutResult:
    rollouts: list[Rollout]  # prompt-major: prompt p's samples are rows p*n .. p*n+n-1
    env_metrics: dict[str, float]
    generate_s: float
    reward_s: float


def prompt_messages(datum) -> list[dict]:
    """The datum's message log as plain {"role", "content"} messages (no token ids)."""
    return [{"role": m["role"], "content": m["content"]} for m in datum.message_log]


def score_responses(envs: dict, datums: list, samples_per_prompt: int, texts: list[str]) -> tuple[list[float], list[dict], dict[str, float]]:
    """Send each response to its datum's environment; rewards come back in sample order."""
    by_env: dict[str, list[int]] = defaultdict(list)
    for i in range(len(texts)):
        by_env[datums[i // samples_per_prompt].env_name].append(i)
    rewards = [0.0] * len(texts)
    metadata: list[dict] = [{} for _ in texts]
    metrics: dict[str, float] = {}
    for env_name, rows in by_env.items():
        if env_name not in envs:
            raise KeyError(f"data routes samples to environment {env_name!r}, but env has only {sorted(envs)}")
        logs = [[*prompt_messages(datums[i // samples_per_prompt]), {"role": "assistant", "content": texts[i]}] for i in rows]
        infos = [datums[i // samples_per_prompt].extra_env_info for i in rows]
        out = envs[env_name].step(logs, infos)
        for i, reward, meta in zip(rows, out.rewards, out.metadata):
            rewards[i] = float(reward)
            metadata[i] = meta
        metrics.update({f"env/{env_name}/{k}": v for k, v in out.metrics.items()})
    return rewards, metadata, metrics


def rollout(generator, envs: dict, datums: list, sampling: SamplingSpec) -> RolloutResult:
    """Generate `sampling.n` responses per datum and score them."""
    start = time.perf_counter()
    prompts = [d.token_ids.tolist() for d in datums]
    results = ray.get(generator.generate.remote(prompts, sampling))
    generate_s = time.perf_counter() - start
    start = time.perf_counter()
    rewards, metadata, env_metrics = score_responses(envs, datums, sampling.n, [r.text for r in results])
    reward_s = time.perf_counter() - start
    rollouts = []
    for i, (res, reward, meta) in enumerate(zip(results, rewards, metadata)):
        datum = datums[res.prompt_index]
        rollouts.append(Rollout(
            prompt_index=res.prompt_index, prompt_ids=list(res.prompt_ids), response_ids=list(res.response_ids),
            gen_logprobs=list(res.response_logprobs), text=res.text, truncated=res.finish_reason == "length",
            reward=reward, loss_multiplier=float(datum.loss_multiplier), task_name=datum.task_name, dataset_name=getattr(datum, "dataset_name", ""), env_metadata=meta,
        ))
    return RolloutResult(rollouts, env_metrics, generate_s, reward_s)
