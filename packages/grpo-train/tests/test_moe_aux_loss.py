"""`policy.moe_aux_loss_coeff`: the MoE load-balancing loss added to the training loss.

Independent expectation: transformers' own Qwen3-MoE forward with `output_router_logits=True`
returns `aux_loss` (Switch Transformer's loss over the same tokens); one micro-batch holding the
whole step must add exactly coeff * that to the loss, padded or packed. A non-MoE model is refused
at the key path, by the worker and by `grpo train`'s startup check.
"""

from __future__ import annotations

import pytest
import torch

from grpo_train.config.schema import GRPOMasterConfig, LossConfig, PolicyConfig
from grpo_train.policy.moe_aux import NotMoEError
from grpo_train.policy.worker import PolicyWorker

VOCAB, B, S = 48, 6, 14
COEFF = 0.5


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=64,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # a router far from uniform, so the loss is far from its minimum
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)
    path = tmp_path_factory.mktemp("tiny-moe")
    model.save_pretrained(path)
    return str(path)


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([14, 3, 9, 6, 12, 5])
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    token_mask = attention_mask.float().clone()
    token_mask[:, :2] = 0
    gen = -torch.rand(B, S, generator=g) * token_mask
    return {
        "input_ids": torch.randint(0, VOCAB, (B, S), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": gen,
        "prev_logprobs": gen,
        "advantages": torch.randn(B, 1, generator=g) * token_mask,
        "sample_mask": torch.ones(B),
    }


def policy_cfg(coeff: float, **kw) -> PolicyConfig:
    return PolicyConfig(
        precision="float32",
        train_global_batch_size=B,
        train_micro_batch_size=B,
        max_grad_norm=None,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.1}},
        moe_aux_loss_coeff=coeff,
        use_fused_kernels=False,
        **kw,
    )


def train_step(path: str, coeff: float, **kw) -> tuple[dict[str, float], torch.Tensor]:
    """Metrics of one step and the router gradient of layer 0."""
    worker = PolicyWorker(path, policy_cfg(coeff, **kw), LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    grads = {}
    step = worker.optimizer.step

    def capture(*args, **kwargs):
        grads["router"] = worker.model.model.layers[0].mlp.gate.weight.grad.clone()
        return step(*args, **kwargs)

    worker.optimizer.step = capture
    return worker.train(make_batch()), grads["router"]


def hf_aux_loss(path: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = make_batch()
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    return float(out.aux_loss)


PACKED = {
    "sequence_packing": {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64, "sequence_length_round": 1}
}


@pytest.mark.parametrize("layout", [{}, PACKED], ids=["padded", "packed"])
def test_added_term_is_coeff_times_the_models_aux_loss(moe_dir, layout):
    expected = hf_aux_loss(moe_dir)
    assert expected > 1.05  # num_experts * sum(f_i * P_i) is 1 when balanced; the noised router is not
    off, router_off = train_step(moe_dir, 0.0, **layout)
    on, router_on = train_step(moe_dir, COEFF, **layout)
    assert "moe_aux_loss" not in off
    assert on["moe_aux_loss"] == pytest.approx(COEFF * expected, rel=1e-5)
    assert on["loss"] - off["loss"] == pytest.approx(COEFF * expected, rel=1e-4)
    assert not torch.allclose(router_on, router_off)  # the term reaches the router


def test_non_moe_model_is_refused_at_the_key(tiny_qwen2_dir):
    """`grpo train` runs check_model_options before any actor starts; a StartupError is one line, exit 2."""
    from grpo_train.setup import StartupError, check_model_options

    with pytest.raises(NotMoEError, match="model type 'qwen2'.*no MoE router logits"):
        PolicyWorker(tiny_qwen2_dir, policy_cfg(COEFF), LossConfig(), seed=0)
    cfg = GRPOMasterConfig(policy={"moe_aux_loss_coeff": COEFF})
    with pytest.raises(StartupError, match=r"^policy.moe_aux_loss_coeff: model type 'qwen2'"):
        check_model_options(cfg, tiny_qwen2_dir)
    check_model_options(GRPOMasterConfig(), tiny_qwen2_dir)  # off: no check
