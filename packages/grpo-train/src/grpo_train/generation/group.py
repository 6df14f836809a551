"""Data-parallel generation: several engines that the loops call like one generator actor.

Job: split each `generate`/`score` call's prompts into contiguous, near-equal shares, one per
engine, and put the answers back in prompt order (`prompt_index` is renumbered to the caller's
prompts); fan weight pushes, seeds and shutdown out to every engine.
Boundary: no placement (see `actor.place_generators`), no knowledge of what is generated.
"""

from __future__ import annotations

import dataclasses

import ray

from grpo_train.actor_group import remote_method, split_rows

# Engine i samples from seed + i * stride, so engines never share a random stream.
ENGINE_SEED_STRIDE = 7919


class GeneratorGroup:
    """N generation actors behind the `GenerationActor` method names."""

    def __init__(self, engines: list) -> None:
        if not engines:
            raise ValueError("a generator group needs at least one engine")
        self.engines = list(engines)

    @remote_method
    def generate(self, prompts, sampling):
        shares = split_rows(len(prompts), len(self.engines))
        refs = [e.generate.remote(prompts[s], sampling) for e, s in zip(self.engines, shares) if s.stop > s.start]
        starts = [s.start for s in shares if s.stop > s.start]
        results = []
        for start, part in zip(starts, ray.get(refs)):
            results += [dataclasses.replace(r, prompt_index=r.prompt_index + start) for r in part]
        return ray.put(results)

    @remote_method
    def score(self, sequences, prompt_lens):
        shares = [s for s in split_rows(len(sequences), len(self.engines)) if s.stop > s.start]
        parts = ray.get([e.score.remote(sequences[s], prompt_lens[s]) for e, s in zip(self.engines, shares)])
        return ray.put([row for part in parts for row in part])

    @remote_method
    def update_weights(self, named_tensors, version: int):
        return ray.put(max(ray.get([e.update_weights.remote(named_tensors, version) for e in self.engines])))

    @remote_method
    def reseed(self, seed: int):
        ray.get([e.reseed.remote(seed + i * ENGINE_SEED_STRIDE) for i, e in enumerate(self.engines)])
        return ray.put(None)

    @remote_method
    def weight_version(self):
        return self.engines[0].weight_version.remote()

    @remote_method
    def num_truncated_prompts(self):
        return ray.put(sum(ray.get([e.num_truncated_prompts.remote() for e in self.engines])))

    @remote_method
    def ready(self):
        return ray.put(max(ray.get([e.ready.remote() for e in self.engines])))

    def close(self) -> None:
        for engine in self.engines:
            try:
                ray.get(engine.shutdown.remote())
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
            ray.kill(engine)


def engines_of(generator) -> list:
    """The engine handles behind one generator actor or a group."""
    return generator.engines if isinstance(generator, GeneratorGroup) else [generator]
