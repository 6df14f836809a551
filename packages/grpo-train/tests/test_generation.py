"""Generation backends against an independent oracle: a plain HF forward pass on the returned
tokens. Real vLLM (CPU build, engine in this process) and real transformers on a tiny random
Qwen2 with tied embeddings, built here so the tests do not depend on the bundled demo model."""

from __future__ import annotations

import time

import pytest
import torch

from grpo_train.generation import HFGenerator, SamplingSpec, VllmGenerator
from grpo_train.generation.base import fit_prompts

TEMPERATURE = 0.7
MAX_MODEL_LEN = 128
ATOL = 1e-4
KV_GB = 0.25  # a quarter GiB of KV cache is thousands of tokens for this model
EOS = 1
PROMPTS = [[4, 5, 13, 6, 7, 15], [3, 4, 5], [9] * 10, [20, 30, 40, 50, 8]]


def reference_logprobs(model, sequences, prompt_lens, temperature):
    """log_softmax(logits / T) of sequences[i][prompt_lens[i]:], one unpadded forward each."""
    out = []
    with torch.no_grad():
        for seq, plen in zip(sequences, prompt_lens):
            logits = model(torch.tensor([seq])).logits[0].float()  # [S, V]
            lp = torch.log_softmax(logits / temperature, dim=-1)[plen - 1 : -1]
            out.append(lp.gather(-1, torch.tensor(seq[plen:])[:, None])[:, 0].tolist())
    return out


def max_abs_diff(a, b):
    assert [len(x) for x in a] == [len(y) for y in b]
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir):
    return tiny_qwen2_dir


@pytest.fixture(scope="module")
def oracle(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vllm_gen(model_dir):
    gen = VllmGenerator(
        model_dir, max_model_len=MAX_MODEL_LEN, temperature_for_logprobs=TEMPERATURE, kv_cache_space_gb=KV_GB
    )
    print(f"\n[measure] vLLM engine start (in-process, fp32): {gen.start_seconds:.1f} s")
    yield gen
    gen.shutdown()


@pytest.fixture(scope="module")
def hf_gen(model_dir):
    return HFGenerator(model_dir, max_model_len=MAX_MODEL_LEN, temperature_for_logprobs=TEMPERATURE)


def sequences_of(results):
    return [r.prompt_ids + r.response_ids for r in results], [len(r.prompt_ids) for r in results]


def check_shapes(results, n_prompts, n, max_new_tokens):
    assert len(results) == n_prompts * n
    assert [r.prompt_index for r in results] == [i for i in range(n_prompts) for _ in range(n)]
    for r in results:
        assert r.prompt_ids == PROMPTS[r.prompt_index]
        assert 1 <= len(r.response_ids) <= max_new_tokens
        assert len(r.response_logprobs) == len(r.response_ids)
        assert all(lp <= 0.0 for lp in r.response_logprobs)
        if r.finish_reason == "length":
            assert len(r.response_ids) == max_new_tokens
        else:
            assert r.finish_reason == "stop" and r.response_ids[-1] == EOS


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_sampling_logprobs_equal_temperature_scaled_recomputation(backend, request, oracle):
    gen = request.getfixturevalue(f"{backend}_gen")
    spec = SamplingSpec(temperature=TEMPERATURE, max_new_tokens=12, n=3)
    results = gen.generate(PROMPTS, spec)
    check_shapes(results, len(PROMPTS), 3, 12)
    seqs, plens = sequences_of(results)
    expected = reference_logprobs(oracle, seqs, plens, TEMPERATURE)
    assert max_abs_diff([r.response_logprobs for r in results], expected) < ATOL
    # The samples of one prompt are not all the same: sampling, not argmax.
    assert len({tuple(r.response_ids) for r in results[:3]}) > 1


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_top_k_top_p_restrict_sampling_but_not_logprobs(backend, request, oracle):
    gen = request.getfixturevalue(f"{backend}_gen")
    spec = SamplingSpec(temperature=TEMPERATURE, top_k=3, top_p=0.95, max_new_tokens=8, n=2)
    results = gen.generate(PROMPTS, spec)
    seqs, plens = sequences_of(results)
    # Full-vocabulary logprobs, not renormalised over the kept tokens ...
    expected = reference_logprobs(oracle, seqs, plens, TEMPERATURE)
    assert max_abs_diff([r.response_logprobs for r in results], expected) < ATOL
    # ... while every sampled token is among the 3 most likely ones.
    with torch.no_grad():
        for seq, plen in zip(seqs, plens):
            logits = oracle(torch.tensor([seq])).logits[0, plen - 1 : -1]
            top3 = logits.topk(3, dim=-1).indices
            assert all(tok in top3[t].tolist() for t, tok in enumerate(seq[plen:]))


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_reseed_repeats_samples(backend, request):
    gen = request.getfixturevalue(f"{backend}_gen")
    spec = SamplingSpec(temperature=1.0, max_new_tokens=10, n=2)
    runs = []
    for seed in (11, 12, 11):
        gen.reseed(seed)
        runs.append([r.response_ids for r in gen.generate(PROMPTS, spec)])
    assert runs[0] == runs[2]
    assert runs[0] != runs[1]


def test_greedy_outputs_agree_between_vllm_and_hf(vllm_gen, hf_gen, oracle):
    spec = SamplingSpec(greedy=True, max_new_tokens=10)
    from_vllm = vllm_gen.generate(PROMPTS, spec)
    from_hf = hf_gen.generate(PROMPTS, spec)
    check_shapes(from_vllm, len(PROMPTS), 1, 10)
    assert [r.response_ids for r in from_vllm] == [r.response_ids for r in from_hf]
    assert [r.finish_reason for r in from_vllm] == [r.finish_reason for r in from_hf]
    assert [r.text for r in from_vllm] == [r.text for r in from_hf]
    # Greedy tokens are the argmax of the oracle, and logprobs refer to temperature_for_logprobs.
    seqs, plens = sequences_of(from_vllm)
    with torch.no_grad():
        for seq, plen in zip(seqs, plens):
            argmax = oracle(torch.tensor([seq])).logits[0, plen - 1 : -1].argmax(-1)
            assert argmax.tolist() == seq[plen:]
    expected = reference_logprobs(oracle, seqs, plens, TEMPERATURE)
    assert max_abs_diff([r.response_logprobs for r in from_vllm], expected) < ATOL
    assert max_abs_diff([r.response_logprobs for r in from_hf], expected) < ATOL


def test_stop_token_ends_sample_in_both_backends(vllm_gen, hf_gen):
    free = vllm_gen.generate(PROMPTS[:1], SamplingSpec(greedy=True, max_new_tokens=10))[0]
    stop = free.response_ids[2]  # the third greedy token; it may also occur earlier
    cut = free.response_ids.index(stop) + 1
    spec = SamplingSpec(greedy=True, max_new_tokens=10, stop_token_ids=(stop,))
    for gen in (vllm_gen, hf_gen):
        result = gen.generate(PROMPTS[:1], spec)[0]
        assert result.response_ids == free.response_ids[:cut]
        assert result.finish_reason == "stop"


def test_stop_string_ends_sample_in_both_backends(vllm_gen, hf_gen):
    prompts = [[20, 30, 40, 50, 8], [3, 4, 5]]
    free = vllm_gen.generate(prompts, SamplingSpec(greedy=True, max_new_tokens=12))
    stop = free[0].text[3:5]  # two characters from the middle of the first greedy answer
    spec = SamplingSpec(greedy=True, max_new_tokens=12, stop_strings=(stop,))
    from_vllm, from_hf = vllm_gen.generate(prompts, spec), hf_gen.generate(prompts, spec)
    for got in (from_vllm, from_hf):
        first = got[0]
        assert first.finish_reason == "stop"
        assert first.text == free[0].text[: free[0].text.index(stop)]
        # Generation stops at the token that completes the string; that token is kept.
        assert first.response_ids == free[0].response_ids[: len(first.response_ids)]
        assert stop in "".join(hf_gen.tokenizer.decode(first.response_ids))
    assert [r.response_ids for r in from_vllm] == [r.response_ids for r in from_hf]
    assert [r.text for r in from_vllm] == [r.text for r in from_hf]
    assert [r.finish_reason for r in from_vllm] == [r.finish_reason for r in from_hf]


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_score_equals_oracle(backend, request, oracle):
    gen = request.getfixturevalue(f"{backend}_gen")
    seqs = [PROMPTS[0] + [5, 6, 7, 8], PROMPTS[2] + [10, 11]]
    plens = [len(PROMPTS[0]), len(PROMPTS[2])]
    scores = gen.score(seqs, plens)
    assert [len(s) for s in scores] == [4, 2]
    assert max_abs_diff(scores, reference_logprobs(oracle, seqs, plens, TEMPERATURE)) < ATOL
    with pytest.raises(ValueError, match="prompt_len"):
        gen.score([[1, 2]], [0])
    with pytest.raises(ValueError, match="at most max_model_len - 1"):
        gen.score([[5] * MAX_MODEL_LEN], [1])


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_overlong_prompt_is_left_truncated_and_counted(backend, request):
    gen = request.getfixturevalue(f"{backend}_gen")
    long_prompt = [3 + i % 60 for i in range(MAX_MODEL_LEN + 20)]
    before = gen.num_truncated_prompts
    results = gen.generate([long_prompt, PROMPTS[1]], SamplingSpec(greedy=True, max_new_tokens=8))
    # One position stays free so the finished sample can still be scored.
    assert results[0].prompt_ids == long_prompt[-(MAX_MODEL_LEN - 8 - 1) :]
    assert len(results[0].prompt_ids) + len(results[0].response_ids) < MAX_MODEL_LEN
    assert results[1].prompt_ids == PROMPTS[1]
    assert gen.num_truncated_prompts == before + 1


def test_configured_kv_cache_size_wins_over_environment(vllm_gen):
    # The test session sets VLLM_CPU_KVCACHE_SPACE=1 (GiB); the constructor's size must win.
    cache_config = vllm_gen.llm.llm_engine.vllm_config.cache_config
    assert cache_config.kv_cache_memory_bytes == int(KV_GB * (1 << 30))


def test_fit_prompts_rejects_impossible_budget():
    with pytest.raises(ValueError, match="max_new_tokens"):
        fit_prompts([[1, 2]], max_model_len=16, max_new_tokens=16)
    with pytest.raises(ValueError, match="empty"):
        fit_prompts([[]], max_model_len=16, max_new_tokens=4)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}, {"max_new_tokens": 0}, {"n": 0}]
)
def test_sampling_spec_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingSpec(**kwargs)


def test_measure_generate_throughput(vllm_gen, hf_gen):
    """Not a speed assertion: records tokens/s of both backends on the tiny model."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    spec = SamplingSpec(temperature=1.0, max_new_tokens=32, n=4)
    for name, gen in (("vllm", vllm_gen), ("hf", hf_gen)):
        start = time.perf_counter()
        results = gen.generate(prompts, spec)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.response_ids) for r in results)
        assert len(results) == 64
        print(
            f"\n[measure] {name} generate 16 prompts x 4 samples: {tokens} tokens in "
            f"{seconds:.2f} s = {tokens / seconds:.0f} tok/s"
        )
