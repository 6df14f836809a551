"""Reward model env: a tiny, randomly initialised Qwen2 classifier built here, scored in batches
and compared with a direct, unpadded forward pass per conversation."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import grpo_envs  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}],
    [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "five i think"}],
    [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "hello hello hello hello hello world"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
    [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hi there"},
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_rm")
    # A byte-level BPE trained here: transformers rebuilds a Qwen2 tokenizer from its vocab and
    # merges, so the folder loads like a real Qwen2 reward model.
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = byte_level
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "</s>"], initial_alphabet=byte_level.alphabet()
    )
    corpus = [f"{m['role']}: {m['content']}" for log in CONVERSATIONS for m in log] * 5
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    fast.save_pretrained(folder)
    vocab = tok.get_vocab()
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=vocab["<pad>"],
    )
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(folder)
    return folder


def _reference_scores(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    scores = []
    for log in CONVERSATIONS:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in log)
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            scores.append(model(input_ids=ids).logits[0, 0].item())
    return scores


def test_batched_scores_match_unpadded_forward(model_dir):
    env = grpo_envs.make("reward_model", model_name_or_path=str(model_dir), batch_size=2, device="cpu")
    out = env.step(CONVERSATIONS, [{}] * len(CONVERSATIONS))
    expected = _reference_scores(model_dir)
    assert out.rewards == pytest.approx(expected, abs=1e-5)
    assert len(set(round(r, 6) for r in out.rewards)) > 1  # a real model, not a constant
    assert out.terminateds == [True] * len(CONVERSATIONS)
    assert out.metrics["score_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert [m["score"] for m in out.metadata] == out.rewards


def test_truncation_is_reported(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = ["\n".join(f"{m['role']}: {m['content']}" for m in log) for log in CONVERSATIONS[:3]]
    lengths = [len(tok(t)["input_ids"]) for t in texts]
    limit = min(lengths) + 1  # the shortest fits, the longer ones are cut
    env = grpo_envs.make("reward_model", model_name_or_path=str(model_dir), max_length=limit, device="cpu")
    out = env.step(CONVERSATIONS[:3], [{}] * 3)
    assert [m["truncated"] for m in out.metadata] == [n > limit for n in lengths]
    assert sum(m["truncated"] for m in out.metadata) == 2
    longest = lengths.index(max(lengths))
    ids = tok(texts[longest])["input_ids"][:limit]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert out.rewards[longest] == pytest.approx(expected, abs=1e-5)


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(OSError, match="point model_name_or_path at a local folder"):
        grpo_envs.make("reward_model", model_name_or_path=str(tmp_path / "nope"))


def test_reward_model_on_a_ray_actor(ray_session, model_dir):
    from grpo_envs.pool import EnvPool

    with EnvPool(
        "reward_model", {"model_name_or_path": str(model_dir), "batch_size": 4, "device": "cpu"}, num_workers=1
    ) as pool:
        out = pool.step(CONVERSATIONS, [{}] * len(CONVERSATIONS))
    assert out.rewards == pytest.approx(_reference_scores(model_dir), abs=1e-5)
