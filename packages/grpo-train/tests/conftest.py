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
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    """One random tiny Qwen2 with its tokenizer for the whole session (read-only for tests)."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_tiny_model(path)
    return str(path)


def ragged_policy_batch(B: int, seed: int) -> dict[str, torch.Tensor]:
    """B rows of the tiny model's vocabulary, ragged (odd and even) lengths 5-13, 3 prompt tokens
    masked, one masked sample (row B // 2, when B > 1); prev/ref logprobs are for the caller to add."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 14, (B,), generator=g)
    S = int(lengths.max())
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    token_mask = attention_mask.float().clone()
    token_mask[:, :3] = 0
    sample_mask = torch.ones(B)
    sample_mask[B // 2] = 0 if B > 1 else 1
    return {
        "input_ids": torch.randint(3, 64, (B, S), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": -torch.rand(B, S, generator=g) * token_mask,
        "advantages": torch.randn(B, generator=g)[:, None] * token_mask,
        "sample_mask": sample_mask,
    }


@pytest.fixture(scope="module")
def model_dir(request):
    """The bundled model that the test module names in its NAME (test_assets.py, test_assets_tool.py)."""
    from grpo_train.assets import builtin_model_path

    return builtin_model_path(request.module.NAME)


@pytest.fixture(scope="module")
def build_info(model_dir) -> dict:
    """The bundled model's build record (build_info.json)."""
    import json

    return json.loads((model_dir / "build_info.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="session")
def policy_batch():
    """`ragged_policy_batch`, shared by the multi-rank worker tests (test_fsdp.py, test_tp_workers.py)."""
    return ragged_policy_batch
