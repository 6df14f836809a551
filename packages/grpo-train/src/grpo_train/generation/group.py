"""The run's generation engines as one driver object: one engine or several, data-parallel.

Job: split each `generate`/`score` call's prompts into contiguous, near-equal shares, one per
engine, run the shares at once, and return the answers in prompt order (`prompt_index` is
renumbered to the caller's prompts); fan weight pushes, seeds, sleep/wake and shutdown out to
every engine; say which engines no longer answer (`dead`, for `engine_faults`). The loops hold a
`GeneratorGroup` whatever the engine count; each method waits for its engines and returns the
value. Calls from several threads at once (multi-turn rollouts, the async collector) overlap on
the engines as they would on the actors themselves.
Boundary: no placement (see `actor.place_generators`), no knowledge of what is generated.
"""

from __future__ import annotations

import dataclasses

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from grpo_train.actor_group import split_rows

# Engine i samples from seed + i * stride, so engines never share a random stream.
ENGINE_SEED_STRIDE = 7919
# An engine that does not answer `weight_version` in this long is taken for dead (a live one
# answers at once: nothing else is waiting on it when a phase has failed).
PROBE_TIMEOUT_S = 120.0


def answers(engine) -> bool:
    """Whether one engine actor still answers (within `PROBE_TIMEOUT_S`)."""
    try:
        ray.get(engine.weight_version.remote(), timeout=PROBE_TIMEOUT_S)
        return True
    except (RayActorError, GetTimeoutError):
        return False


class GeneratorGroup:
    """N generation actors (`GenerationActor` or the async vLLM engine) behind the same method names."""

    def __init__(self, engines: list) -> None:
        if not engines:
            raise ValueError("a generator group needs at least one engine")
        self.engines = list(engines)

    def generate(self, prompts: list, sampling) -> list:
        """`GenerationResult`s of every prompt, in prompt order (each engine samples its share)."""
        shares = [s for s in split_rows(len(prompts), len(self.engines)) if s.stop > s.start]
        refs = [e.generate.remote(prompts[s], sampling) for e, s in zip(self.engines, shares)]
        results = []
        for share, part in zip(shares, ray.get(refs)):
            results += (
                part
                if share.start == 0
                else [dataclasses.replace(r, prompt_index=r.prompt_index + share.start) for r in part]
            )
        return results

    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """Logprobs of each sequence's tokens after its prompt, in sequence order."""
        shares = [s for s in split_rows(len(sequences), len(self.engines)) if s.stop > s.start]
        parts = ray.get([e.score.remote(sequences[s], prompt_lens[s]) for e, s in zip(self.engines, shares)])
        return [row for part in parts for row in part]

    def update_weights(self, named_tensors, version: int) -> float:
        """Every engine loads `named_tensors` (a dict, or its ObjectRef); the slowest engine's seconds."""
        return max(ray.get([e.update_weights.remote(named_tensors, version) for e in self.engines]))

    def reseed(self, seed: int) -> None:
        ray.get([e.reseed.remote(seed + i * ENGINE_SEED_STRIDE) for i, e in enumerate(self.engines)])

    def weight_version(self) -> int:
        return ray.get(self.engines[0].weight_version.remote())

    def num_truncated_prompts(self) -> int:
        return sum(ray.get([e.num_truncated_prompts.remote() for e in self.engines]))

    def ready(self) -> float:
        """Wait for every engine to start; the slowest one's start-up seconds."""
        return max(ray.get([e.ready.remote() for e in self.engines]))

    def sleep(self) -> None:
        """Colocated on GPUs: every engine frees its GPU memory (colocation.py)."""
        ray.get([e.sleep.remote() for e in self.engines])

    def wake_up(self) -> None:
        ray.get([e.wake_up.remote() for e in self.engines])

    def dead(self) -> list[int]:
        """Indices of the engines that no longer answer."""
        return [i for i, engine in enumerate(self.engines) if not answers(engine)]

    def close(self) -> None:
        for engine in self.engines:
            try:
                ray.get(engine.shutdown.remote())
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
            ray.kill(engine)
