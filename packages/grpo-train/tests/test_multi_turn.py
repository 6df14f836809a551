"""Multi-turn rollouts on real parts: a tiny model in an HF generation actor (Ray) playing the
number-guessing environment; observations join the sequence but not the loss."""

from __future__ import annotations

import pytest
import torch

from grpo_data.records import DatumSpec
from grpo_envs.pool import EnvPool
from grpo_train.batch import build_train_batch
from grpo_train.generation.base import SamplingSpec
from grpo_train.rollout.multi_turn import multi_turn_rollout, observation_ids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random tiny Qwen2 over grpo-data's character tokenizer, which can spell the hints."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_data.testing import make_char_tokenizer

    tok = make_char_tokenizer(chat_template=None)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    path = tmp_path_factory.mktemp("guess-model")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def generator(ray_session, model_dir):
    from grpo_train.generation import make_generation_actor
    from grpo_train.generation.group import GeneratorGroup

    actor = make_generation_actor("hf", model_dir, num_cpus=0, max_model_len=128, seed=0)
    ray_session.get(actor.ready.remote())
    yield GeneratorGroup([actor])  # what the loops hold
    ray_session.kill(actor)


def datum(tokenizer, text: str, target: int) -> DatumSpec:
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    return DatumSpec(
        [{"role": "user", "content": text, "token_ids": ids}],
        len(ids),
        {"target": target},
        env_name="number_guess",
        task_name="guess",
    )


def test_multi_turn_rollout_masks_observations_and_sums_rewards(generator, tokenizer):
    envs = {"number_guess": EnvPool("number_guess", {"max_turns": 3}, num_workers=1, in_process=True)}
    # Targets the model will not hit first time, so conversations continue.
    datums = [datum(tokenizer, "12+30=", 999), datum(tokenizer, "5+5=", 998)]
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=4, n=2, stop_token_ids=(tokenizer.eos_token_id,))
    result = multi_turn_rollout(generator, envs, datums, sampling, tokenizer, max_turns=3, max_total_len=128)
    assert len(result.rollouts) == 4
    assert [r.prompt_index for r in result.rollouts] == [0, 0, 1, 1]
    for r in result.rollouts:
        assert r.turns == 3 and r.reward == 0.0  # never solved: three turns, reward 0
        assert len(r.response_mask) == len(r.response_ids) == len(r.gen_logprobs)
        observed = [t for t, m in zip(r.response_ids, r.response_mask) if m == 0]
        # Each of the two observations is a hint ("higher", "lower" or the no-number hint: a
        # random model seldom writes a number), encoded as the loop encodes it.
        hints = [
            observation_ids(tokenizer, {"content": h})
            for h in ("higher", "lower", "no number found; answer with an integer")
        ]
        assert all(hints) and observed in [a + b for a in hints for b in hints]
        assert all(lp == 0.0 for lp, m in zip(r.gen_logprobs, r.response_mask) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(r.gen_logprobs, r.response_mask) if m == 1)
    batch = build_train_batch(result.rollouts, torch.ones(4), torch.ones(4), tokenizer.pad_token_id)
    for i, r in enumerate(result.rollouts):
        p = len(r.prompt_ids)
        assert batch["token_mask"][i, p : p + len(r.response_ids)].tolist() == [float(m) for m in r.response_mask]
        assert batch["token_mask"][i, :p].sum() == 0
    assert result.env_metrics["turns_mean"] == 3.0


@pytest.fixture(scope="module")
def arith(ray_session):
    """The bundled arithmetic model: its greedy answers are integers, so a guess can be right."""
    from transformers import AutoTokenizer

    from grpo_train.assets import builtin_model_path
    from grpo_train.generation import make_generation_actor

    path = str(builtin_model_path("arith-tiny"))
    from grpo_train.generation.group import GeneratorGroup

    actor = make_generation_actor("hf", path, num_cpus=0, max_model_len=64, seed=0)
    ray_session.get(actor.ready.remote())
    yield GeneratorGroup([actor]), AutoTokenizer.from_pretrained(path)
    ray_session.kill(actor)


def test_solved_conversation_stops_and_is_rewarded(arith):
    generator, tok = arith
    envs = {"number_guess": EnvPool("number_guess", {"max_turns": 4}, num_workers=1, in_process=True)}
    greedy = SamplingSpec(greedy=True, max_new_tokens=4, n=1, stop_token_ids=(tok.eos_token_id,))
    prompt = tok("12+30=", add_special_tokens=False)["input_ids"]
    (first,) = generator.generate([prompt], greedy)
    guess = int(first.text.strip())  # the model answers additions with an integer
    result = multi_turn_rollout(
        generator, envs, [datum(tok, "12+30=", guess)], greedy, tok, max_turns=4, max_total_len=64
    )
    (r,) = result.rollouts
    assert r.turns == 1 and r.reward == 1.0 and r.response_mask == [1] * len(r.response_ids)
    # A wrong secret: the conversation runs all four turns and scores 0.
    result = multi_turn_rollout(
        generator, envs, [datum(tok, "12+30=", guess + 1000)], greedy, tok, max_turns=4, max_total_len=64
    )
    (r,) = result.rollouts
    assert r.turns == 4 and r.reward == 0.0
