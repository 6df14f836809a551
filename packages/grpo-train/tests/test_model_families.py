"""Every model family grpo claims, on small random-initialised models (2 layers, hidden 128, heads
of 64, the shared 64-symbol character tokenizer).

Trainer side (fast, per family): the push's names and tensors equal what transformers'
`save_pretrained` writes (the checkpoint the engine loads: an independent conversion); the
trainer's padded and packed logprobs equal log_softmax(HF forward logits / T) (the HF forward
applies the family's head, soft-capping and logit scaling included); one optimizer step moves
every weight (the MoE router included) and keeps them finite.
Engine side (slow, one vLLM engine per family, one after another in this process): after one
optimizer step and a push, the engine's logprobs equal the trainer's within the fp32 refit
threshold, and before the push they do not.
The README's "Model families" table is checked against FAMILIES here.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

from grpo_train.model_families import BY_MODEL_TYPE, family_of
from grpo_train.policy.logprobs import packed_logprobs, sequence_logprobs
from grpo_train.refit.check import check_refit
from grpo_train.refit.tensors import iter_refit_tensors, state_dict_for_refit

TEMPERATURE = 0.7
ATOL = 1e-4  # the fp32 refit threshold (test_refit.py)
README = Path(__file__).resolve().parents[1] / "README.md"
_DECODER = dict(
    vocab_size=64,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=False,
)


def _config(model_type: str):
    import transformers as T

    hd = dict(head_dim=64)
    return {
        "llama": lambda: T.LlamaConfig(**_DECODER, **hd),
        "mistral": lambda: T.MistralConfig(**_DECODER, **hd),
        "qwen2": lambda: T.Qwen2Config(**_DECODER, **hd),
        "qwen3": lambda: T.Qwen3Config(**_DECODER, **hd),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(
            **_DECODER, **hd, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1
        ),
        "gemma2": lambda: T.Gemma2Config(**{**_DECODER, "tie_word_embeddings": True}, **hd),
        "gemma3_text": lambda: T.Gemma3TextConfig(
            **{**_DECODER, "tie_word_embeddings": True}, **hd, final_logit_softcapping=30.0
        ),
        "phi3": lambda: T.Phi3Config(**_DECODER),
        "olmo2": lambda: T.Olmo2Config(**_DECODER),
        "granite": lambda: T.GraniteConfig(
            **_DECODER, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1
        ),
        "gpt2": lambda: T.GPT2Config(
            vocab_size=64,
            n_embd=128,
            n_layer=2,
            n_head=2,
            n_positions=256,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        ),
    }[model_type]()


# model type -> (transformers class, what the CPU engine test shows; None: passes)
FAMILIES = {
    "llama": ("LlamaForCausalLM", None),
    "mistral": ("MistralForCausalLM", None),
    "qwen2": ("Qwen2ForCausalLM", None),
    "qwen3": ("Qwen3ForCausalLM", None),
    "qwen3_moe": ("Qwen3MoeForCausalLM", None),
    "gemma2": ("Gemma2ForCausalLM", None),
    "gemma3_text": ("Gemma3ForCausalLM", None),
    "phi3": ("Phi3ForCausalLM", None),
    "olmo2": ("Olmo2ForCausalLM", None),
    "granite": ("GraniteForCausalLM", None),
    "gpt2": ("GPT2LMHeadModel", None),
}
# Weights are perturbed by this much noise (std) after init, so logits lie far from 0 and soft-caps
# and logit scales matter. Qwen3-MoE keeps its init scale: with the noise, vLLM's CPU MoE already
# disagrees with transformers on the saved checkpoint itself, before any push (12.6 nats measured);
# open question whether that is the CPU expert kernel's precision (not the naming: the names and
# tensors equal save_pretrained's, and the refit is exact at init scale).
PERTURB = {"qwen3_moe": 0.0}
PROBE = [[3 + (7 * i) % 60 for i in range(40)], [3 + (11 * i) % 60 for i in range(30)], [5, 9, 4]]
PROMPT_LENS = [5, 7, 1]


def family_table() -> str:
    """The README's table (regenerate with `python -c "import test_model_families as t; print(t.family_table())"`
    from this folder)."""
    rows = ["| model type | transformers class | grpo rule | vLLM CPU engine |", "|---|---|---|---|"]
    for model_type, (cls, engine) in FAMILIES.items():
        rule = BY_MODEL_TYPE[model_type]
        rows.append(f"| `{model_type}` | `{cls}` | `{rule.__name__}` | {engine or 'refit within 1e-4 (fp32)'} |")
    return "\n".join(rows)


def build_family(path: Path, model_type: str, tokenizer_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(model_type), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * PERTURB.get(model_type, 0.2))
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_qwen2_dir) -> dict[str, str]:
    out = {}
    for model_type in FAMILIES:
        path = tmp_path_factory.mktemp(model_type)
        build_family(path, model_type, tiny_qwen2_dir)
        out[model_type] = str(path)
    return out


def load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def reference_logprobs(model, sequences=PROBE, prompt_lens=PROMPT_LENS) -> list[list[float]]:
    """log_softmax(HF forward logits / T) of each sequence's response tokens, with transformers'
    eager attention (its reference math: SDPA drops Gemma 2's attention soft-capping)."""
    model = copy.deepcopy(model)
    model.set_attn_implementation("eager")
    out = []
    with torch.no_grad():
        for seq, plen in zip(sequences, prompt_lens):
            logits = model(torch.tensor([seq])).logits[0].float()
            lp = torch.log_softmax(logits / TEMPERATURE, dim=-1)[plen - 1 : -1]
            out.append(lp.gather(-1, torch.tensor(seq[plen:])[:, None])[:, 0].tolist())
    return out


def padded_and_packed(model) -> tuple[list[list[float]], list[list[float]]]:
    width = max(map(len, PROBE))
    ids = torch.zeros(len(PROBE), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(PROBE):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    padded = sequence_logprobs(model, ids, mask, TEMPERATURE)
    flat = torch.tensor([t for s in PROBE for t in s])
    positions = torch.tensor([j for s in PROBE for j in range(len(s))])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in PROBE]).cumsum(0).tolist()])
    packed = packed_logprobs(model, flat, positions, cu, width, TEMPERATURE)
    pad_rows, pack_rows = [], []
    for i, (s, plen) in enumerate(zip(PROBE, PROMPT_LENS)):
        pad_rows.append(padded[i, plen : len(s)].tolist())
        pack_rows.append(packed[int(cu[i]) + plen : int(cu[i + 1])].tolist())
    return pad_rows, pack_rows


def one_step(model, lr: float = 1e-2):
    """A copy after one AdamW step on the packed logprobs of the probe (the trainer's path)."""
    trained = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(trained.parameters(), lr=lr)
    flat = torch.tensor([t for s in PROBE for t in s])
    positions = torch.tensor([j for s in PROBE for j in range(len(s))])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in PROBE]).cumsum(0).tolist()])
    (-packed_logprobs(trained, flat, positions, cu, max(map(len, PROBE)), TEMPERATURE).sum()).backward()
    no_grad = [n for n, p in trained.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    opt.step()
    return trained.eval(), no_grad


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_trainer_side(model_type, family_dirs):
    from safetensors.torch import load_file

    path = family_dirs[model_type]
    model = load(path).eval()
    assert model.config.model_type == model_type and type(model).__name__ == FAMILIES[model_type][0]
    assert type(family_of(model.config)) is BY_MODEL_TYPE[model_type]

    # names and tensors: what save_pretrained wrote (less a tied head, sent once as the embedding)
    saved = load_file(str(Path(path) / "model.safetensors"))
    if model.config.get_text_config().tie_word_embeddings:
        saved.pop("lm_head.weight", None)
    pushed = dict(iter_refit_tensors(model))
    assert sorted(pushed) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(pushed[name], tensor), name
    metas = {n: (tuple(t.shape), t.dtype) for n, t in iter_refit_tensors(model, gather=False)}
    assert metas == {n: (tuple(t.shape), t.dtype) for n, t in saved.items()}

    # padded and packed trainer logprobs vs the HF forward
    reference = reference_logprobs(model)
    with torch.no_grad():
        padded, packed = padded_and_packed(model)
    assert check_refit(reference, padded, ATOL) <= ATOL
    assert check_refit(reference, packed, ATOL) <= ATOL

    # one optimizer step: every parameter gets a gradient (experts and router included) and moves
    trained, no_grad = one_step(model)
    assert not no_grad
    for (name, before), after in zip(model.named_parameters(), trained.parameters()):
        assert torch.isfinite(after).all() and not torch.equal(before, after), name


def test_hf_generator_takes_a_push_of_fused_experts(family_dirs):
    """The HF backend receives checkpoint-format names and writes them into its fused tensors."""
    from grpo_train.generation import HFGenerator

    path = family_dirs["qwen3_moe"]
    gen = HFGenerator(path, temperature_for_logprobs=TEMPERATURE)
    trained, _ = one_step(load(path).eval())
    gen.update_weights(state_dict_for_refit(trained), 1)
    assert check_refit(reference_logprobs(trained), gen.score(PROBE, PROMPT_LENS), 1e-5) <= 1e-5


def test_unsupported_layout_is_refused_with_the_model_type(family_dirs):
    from grpo_train.generation.base import check_weight_names
    from grpo_train.model_families import UnsupportedFamilyError

    path = family_dirs["qwen3_moe"]
    model = load(path)
    fused = [n for n in model.state_dict()]  # the in-memory (fused) names, as a push without the rule
    expected = set(dict(iter_refit_tensors(model)))
    with pytest.raises(
        UnsupportedFamilyError, match=r"model type 'qwen3_moe'.*missing \['model.layers.0.mlp.experts.0"
    ):
        check_weight_names(fused, expected, path)
    model.config.model_type = "made_up"
    with pytest.raises(UnsupportedFamilyError, match="'made_up' is not in grpo's family registry"):
        check_weight_names(fused, expected, model.config)


def test_readme_table_lists_every_family():
    assert set(FAMILIES) == set(BY_MODEL_TYPE), "a registry rule without a tested family, or the reverse"
    assert family_table() in README.read_text(), "README 'Model families' table is stale:\n" + family_table()


# Families whose engine refit is known to fail (strict xfail); Qwen3-MoE's stale prepacked experts
# (0.126 before the worker extension re-ran the kernel's processing) are fixed, see
# benchmarks/results/model_families_cpu.md.
ENGINE_XFAIL: dict[str, str] = {}


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type",
    [
        pytest.param(t, marks=pytest.mark.xfail(reason=ENGINE_XFAIL[t], strict=True)) if t in ENGINE_XFAIL else t
        for t in FAMILIES
    ],
)
def test_engine_refit(model_type, family_dirs):
    """One engine per family, started one after another in this process (~2-10 s each once vLLM
    is imported): push after one optimizer step, then the engine runs the trainer's weights."""
    from grpo_train.generation import VllmGenerator

    path = family_dirs[model_type]
    engine_note = FAMILIES[model_type][1]
    # transformers models are built before the engine: once vLLM has loaded its OLMo 2, building
    # transformers' OLMo 2 in the same process fails inside vLLM's compile decorator.
    model = load(path).eval()
    reference = reference_logprobs(model)
    trained, _ = one_step(model)
    expected = reference_logprobs(trained)
    state = state_dict_for_refit(trained)
    try:
        gen = VllmGenerator(path, max_model_len=256, temperature_for_logprobs=TEMPERATURE, kv_cache_space_gb=0.125)
    except Exception as err:  # noqa: BLE001 - a family the CPU build cannot run must say so in FAMILIES
        if engine_note is None or model_type in ENGINE_XFAIL:
            raise
        assert engine_note.split(":")[0] in str(err)
        return
    try:
        assert check_refit(reference, gen.score(PROBE, PROMPT_LENS), ATOL) <= ATOL
        assert check_refit(expected, gen.score(PROBE, PROMPT_LENS), float("inf")) > 10 * ATOL  # stale before
        gen.update_weights(state, 1)
        assert check_refit(expected, gen.score(PROBE, PROMPT_LENS), ATOL) <= ATOL
    finally:
        gen.shutdown()
