"""Data-parallel generation: two real generation actors (HF backend, the cheapest engine that
runs the same protocol) behind one `GeneratorGroup`.

The oracle is one in-process generator on the same prompts: greedy samples, their logprobs and
prompt scores must come back identical and in the caller's prompt order."""

from __future__ import annotations

import ray
import torch

from grpo_train.generation import HFGenerator, SamplingSpec, make_generation_actor
from grpo_train.generation.group import GeneratorGroup
from grpo_train.refit.tensors import state_dict_for_refit

PROMPTS = [[3 + (5 * i + j) % 60 for j in range(6 + i)] for i in range(5)]  # 5 prompts over 2 engines: 2 + 3


def test_two_engines_answer_like_one(ray_session, tiny_qwen2_dir):
    torch.set_num_threads(1)
    engines = [
        make_generation_actor("hf", tiny_qwen2_dir, num_cpus=1, max_model_len=64, temperature_for_logprobs=0.7)
        for _ in range(2)
    ]
    group = GeneratorGroup(engines)
    try:
        oracle = HFGenerator(tiny_qwen2_dir, max_model_len=64, temperature_for_logprobs=0.7)
        greedy = SamplingSpec(temperature=0.0, max_new_tokens=4)
        expected = oracle.generate(PROMPTS, greedy)
        got = group.generate(PROMPTS, greedy)
        assert [r.prompt_index for r in got] == [r.prompt_index for r in expected] == [0, 1, 2, 3, 4]
        assert [r.response_ids for r in got] == [r.response_ids for r in expected]
        for a, b in zip(got, expected):
            assert a.prompt_ids == b.prompt_ids
            torch.testing.assert_close(
                torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-5, rtol=0
            )

        sequences = [r.prompt_ids + r.response_ids for r in expected]
        prompt_lens = [len(r.prompt_ids) for r in expected]
        scores = group.score(sequences, prompt_lens)
        for a, b in zip(scores, oracle.score(sequences, prompt_lens)):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)

        weights = state_dict_for_refit(oracle.model)
        group.update_weights(ray.put(weights), 3)
        assert ray.get([e.weight_version.remote() for e in engines]) == [3, 3]
        assert group.weight_version() == 3
        one = GeneratorGroup(engines[:1])  # the loops hold a group for one engine too: the same answers
        assert [r.response_ids for r in one.generate(PROMPTS, greedy)] == [r.response_ids for r in expected]
        for a, b in zip(one.score(sequences, prompt_lens), oracle.score(sequences, prompt_lens), strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
        assert group.dead() == []
    finally:
        group.close()
