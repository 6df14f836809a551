"""The bundled `arith-tiny` model: it resolves by name, loads with the HF auto classes and in real
vLLM, tokenises the task as the data package does, and is half-trained as its build recorded."""

from __future__ import annotations

import random

import pytest

from grpo_train.assets import BUILTIN_MODELS, builtin_model_path

NAME = "arith-tiny"
NUM_PROBLEMS = 64  # the first 64 of the build's held-out set; build_info.json records their answers
MAX_NEW_TOKENS = 6
# The default build (recipe biased-carry) answers problems without a units carry right and mostly
# drops the carry on the others (61 % held-out greedy accuracy on 512 problems, 75 % on these 64,
# which have fewer carries); the band leaves room for both recipes' subsets.
ACCURACY_BAND = (0.30, 0.85)
# Answers may flip on near-ties on other hardware (other BLAS, GPU); the same machine gives 0.
MAX_CHANGED_ANSWERS = 3
PARAMETER_RANGE = (0.8e6, 1.5e6)


@pytest.fixture(scope="module")
def problems(build_info):
    flat = random.Random(build_info["heldout_seed"]).sample(range(10_000), 512)[:NUM_PROBLEMS]
    return [(x // 100, x % 100) for x in flat]


def hf_greedy_answers(model, tokenizer, problems) -> list[str]:
    """HF generate, prompts grouped by token length so that no padding is involved."""
    import torch

    encoded = [tokenizer(f"{a}+{b}=", add_special_tokens=False).input_ids for a, b in problems]
    answers = [""] * len(problems)
    for length in sorted({len(ids) for ids in encoded}):
        idx = [i for i, ids in enumerate(encoded) if len(ids) == length]
        input_ids = torch.tensor([encoded[i] for i in idx])  # [n, length]
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
            )
        for i, row in zip(idx, out[:, length:].tolist()):
            answers[i] = tokenizer.decode(row, skip_special_tokens=True)
    return answers


def accuracy(answers, problems) -> float:
    return sum(ans.strip() == str(a + b) for ans, (a, b) in zip(answers, problems)) / len(problems)


def test_builtin_model_path_resolves_known_name(model_dir):
    assert NAME in BUILTIN_MODELS
    assert (model_dir / "config.json").is_file()
    assert (model_dir / "model.safetensors").is_file()
    assert (model_dir / "README.md").is_file()


def test_builtin_model_path_rejects_unknown_name():
    with pytest.raises(ValueError, match="unknown built-in model 'gpt-9'.*arith-tiny"):
        builtin_model_path("gpt-9")


def test_tokenizer_splits_every_digit_and_adds_no_specials(tokenizer, model):
    for digit in "0123456789":
        assert len(tokenizer(digit, add_special_tokens=False).input_ids) == 1
    assert tokenizer.convert_ids_to_tokens(tokenizer("37+5=", add_special_tokens=False).input_ids) == [
        "3",
        "7",
        "+",
        "5",
        "=",
    ]
    # No BOS and no post-processor: add_special_tokens changes nothing.
    assert tokenizer.bos_token_id is None
    assert tokenizer("37+5=").input_ids == tokenizer("37+5=", add_special_tokens=False).input_ids
    for text in ["+", "-", "*", "=", " "]:
        assert len(tokenizer(text, add_special_tokens=False).input_ids) == 1, text
    assert tokenizer.decode(tokenizer("12 + 7 = 19").input_ids) == "12 + 7 = 19"
    # Every embedding row is a token, so any sampled id decodes.
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id
    assert tokenizer.pad_token_id == model.config.pad_token_id == model.generation_config.pad_token_id


def test_model_config_and_size(model, model_dir):
    config = model.config
    assert config.model_type == "qwen2"
    assert config.head_dim == 64  # vLLM's CPU attention rejects head_dim 16
    assert config.hidden_size == 128 and config.num_hidden_layers == 4
    assert config.tie_word_embeddings is True
    assert config.max_position_embeddings == 64
    assert config.vocab_size % 16 == 0
    n = sum(p.numel() for p in model.parameters())
    assert PARAMETER_RANGE[0] <= n <= PARAMETER_RANGE[1], n
    assert (model_dir / "model.safetensors").stat().st_size < 8 * 2**20


def test_greedy_accuracy_is_in_the_recorded_band(model, tokenizer, problems, build_info):
    answers = hf_greedy_answers(model, tokenizer, problems)
    acc = accuracy(answers, problems)
    assert ACCURACY_BAND[0] <= acc <= ACCURACY_BAND[1], acc
    recorded = build_info["test_subset_hf_answers"]
    changed = sum(a != r for a, r in zip(answers, recorded))
    assert changed <= MAX_CHANGED_ANSWERS, (changed, acc, build_info["test_subset_accuracy"])


def test_biased_carry_model_drops_carries(model, tokenizer, problems, build_info):
    """The bias GRPO must remove: right without a carry, carry-dropped answers with one."""
    if build_info.get("recipe") != "biased-carry":
        pytest.skip("built with another recipe")
    answers = hf_greedy_answers(model, tokenizer, problems)
    carry = [(ans, (a, b)) for ans, (a, b) in zip(answers, problems) if a % 10 + b % 10 >= 10]
    plain = [(ans, (a, b)) for ans, (a, b) in zip(answers, problems) if a % 10 + b % 10 < 10]
    assert sum(ans.strip() == str(a + b) for ans, (a, b) in plain) >= 0.9 * len(plain)
    dropped = sum(ans.strip() == str((a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10) for ans, (a, b) in carry)
    right = sum(ans.strip() == str(a + b) for ans, (a, b) in carry)
    assert dropped > right and dropped >= 0.5 * len(carry), (dropped, right, len(carry))


@pytest.mark.slow
def test_vllm_greedy_matches_hf(model, tokenizer, problems, model_dir):
    """The production generation path (real vLLM, CPU build here) decodes the same answers."""
    import gc

    from vllm import LLM, SamplingParams

    hf_answers = hf_greedy_answers(model, tokenizer, problems)
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=64, seed=0)
    try:
        prompts = [
            {"prompt_token_ids": tokenizer(f"{a}+{b}=", add_special_tokens=False).input_ids} for a, b in problems
        ]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)
        vllm_answers = [o.outputs[0].text for o in outputs]
        assert all(
            o.outputs[0].finish_reason == "stop" or len(o.outputs[0].token_ids) == MAX_NEW_TOKENS for o in outputs
        )
    finally:
        del llm
        gc.collect()
    assert vllm_answers == hf_answers
