"""Fixtures shared by grpo-train's tests."""

from __future__ import annotations

import pytest
import torch


def build_tiny_model(path, seed: int = 0) -> None:
    """A 64-token char-level tokenizer and a random Qwen2 (hidden 128, 2 layers, 2 heads of 64,
    tied embeddings), saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    chars = "0123456789abcdefghijklmnopqrstuvwxyz+-=*/ ?.,:ABCDEFGHIJKLMNO"
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    assert len(vocab) == 64
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>"
    ).save_pretrained(path)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    """One random tiny Qwen2 with its tokenizer for the whole session (read-only for tests)."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_tiny_model(path)
    return str(path)
