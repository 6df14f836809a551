"""LoRA on the PPO value model (value.lora_cfg), in-process: peft adapters on the backbone's linear
layers, the value head trained in full. Checked against a twin built by hand with peft and
torch.optim.AdamW (one step's gradients and weights), by a bitwise save/resume, by peft loading the
saved adapters, and by the start-up check naming the key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grpo_train.config.schema import LoRAConfig, ValueConfig, ValueLossConfig
from grpo_train.ppo.value_worker import ADAPTER_DIR, HEAD_FILE, MASTERS_FILE, ValueWorker

VOCAB = 64
LR = 1e-3
LOSS = ValueLossConfig(value_clip=None, token_level_loss=True)  # 0.5 * masked MSE over the batch's tokens


def make_batch(seed: int, B: int = 4) -> dict[str, torch.Tensor]:
    """B ragged rows of the tiny model's vocabulary with returns and rollout-time values."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 12, (B,), generator=g)
    S = int(lengths.max())
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    token_mask = attention_mask.float().clone()
    token_mask[:, :3] = 0
    return {
        "input_ids": torch.randint(3, VOCAB, (B, S), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
        "values": torch.zeros(B, S),
        "returns": torch.randn(B, S, generator=g) * token_mask,
    }


def value_cfg(**lora) -> ValueConfig:
    return ValueConfig(
        lora_cfg=LoRAConfig(enabled=True, **lora),
        train_micro_batch_size=2,
        max_grad_norm=None,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": LR, "weight_decay": 0.0}},
    )


def twin_name(worker_name: str) -> str:
    """The worker's parameter name under a PeftModel built on the bare backbone."""
    return worker_name.replace("backbone.", "base_model.model.", 1)


def test_only_adapters_and_head_train_and_one_step_matches_a_peft_twin(tiny_qwen2_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    targets, excluded = ["q_proj", "v_proj", "down_proj"], ["layers.0.mlp.down_proj"]
    v = ValueWorker(
        tiny_qwen2_dir,
        value_cfg(match_all_linear=False, target_modules=targets, exclude_modules=excluded, dim=4, alpha=8),
        LOSS,
        global_batch_size=4,
        seed=0,
    )
    trainable = {n for n, p in v.model.named_parameters() if p.requires_grad}
    assert trainable == set(v.master.names)
    assert {"head.weight", "head.bias"} <= trainable and all(
        "lora_" in n for n in trainable - {"head.weight", "head.bias"}
    )
    adapted = {n.split(".lora_A")[0] for n in trainable if ".lora_A." in n}
    layers = {n.split(".self_attn")[0] for n in adapted if ".self_attn." in n}
    expected = {f"{layer}.self_attn.{m}" for layer in layers for m in ("q_proj", "v_proj")} | {
        f"{layer}.mlp.down_proj" for layer in layers if layer != "backbone.layers.0"
    }
    assert len(layers) >= 2 and adapted == expected
    # A non-zero head and lora_B, so that every trained parameter gets a gradient at the first step
    # (both start at zero: the head's zero would stop the backbone's gradients).
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in v.model.named_parameters():
            if n.startswith("head.") or ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    start = {n: p.detach().clone() for n, p in v.model.named_parameters()}

    # The twin: peft's LoRA on a fresh backbone (peft's names: r, lora_alpha), the worker's initial
    # adapters and head, the value loss written out, and torch's AdamW.
    backbone = get_peft_model(
        AutoModel.from_pretrained(tiny_qwen2_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=targets, exclude_modules=excluded),
    )
    head = torch.nn.Linear(backbone.config.hidden_size, 1)
    twin = {
        **{f"head.{k}": p for k, p in head.named_parameters()},
        **{n: p for n, p in backbone.named_parameters() if p.requires_grad},
    }
    assert set(twin) == {twin_name(n) for n in trainable}
    with torch.no_grad():
        for n in trainable:
            twin[twin_name(n)].copy_(start[n])
    batch = make_batch(0)
    hidden = backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    values = F.pad(head(hidden[:, :-1]).squeeze(-1), (1, 0)) * batch["attention_mask"]
    mask = batch["token_mask"]
    loss = 0.5 * ((values - batch["returns"]) ** 2 * mask).sum() / mask.sum()
    loss.backward()
    optimizer = torch.optim.AdamW(list(twin.values()), lr=LR, weight_decay=0.0)
    optimizer.step()

    metrics = v.train(batch)
    assert metrics["value_loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    grads = v.gradients()
    assert set(grads) == trainable and all(bool(g.abs().sum() > 0) for g in grads.values())
    for n, grad in grads.items():
        torch.testing.assert_close(grad, twin[twin_name(n)].grad, rtol=1e-4, atol=1e-7)
    after = dict(v.model.named_parameters())
    for n in trainable:
        torch.testing.assert_close(after[n].detach(), twin[twin_name(n)].detach(), rtol=1e-5, atol=1e-7)
    # The base weights did not move, and optimizer state exists only for adapters and head.
    assert all(torch.equal(after[n].detach(), start[n]) for n in start if n not in trainable)
    state_params = {id(p) for p in v.optimizer.state}
    assert state_params == {id(p) for p in v.master.parameters()} and len(state_params) == len(trainable)


def test_dropout_reaches_the_adapters_of_all_linear_layers_and_rollout_values_are_deterministic(tiny_qwen2_dir):
    from peft.tuners.lora import LoraLayer

    v = ValueWorker(tiny_qwen2_dir, value_cfg(dropout=0.5), LOSS, global_batch_size=4, seed=0)
    linears = [
        n
        for n, m in ValueWorker(tiny_qwen2_dir, ValueConfig(), LOSS, 4, 0).model.backbone.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    lora_layers = {n: m for n, m in v.model.backbone.named_modules() if isinstance(m, LoraLayer)}
    assert sorted(lora_layers) == sorted(linears)  # match_all_linear: every linear layer of the backbone
    assert all(
        isinstance(m.lora_dropout["default"], torch.nn.Dropout) and m.lora_dropout["default"].p == 0.5
        for m in lora_layers.values()
    )
    with torch.no_grad():
        for n, p in v.model.named_parameters():
            if n.startswith("head.") or ".lora_B." in n:
                p.fill_(0.05)
    batch = make_batch(1)
    first = v.values(batch)
    assert torch.equal(first, v.values(batch)) and v.model.training  # eval for the rollout's values, then back
    with torch.no_grad():
        trained = v.model(batch["input_ids"], batch["attention_mask"])  # train mode: dropout on the adapters
    assert not torch.allclose(trained * batch["attention_mask"], first * batch["attention_mask"])


def test_lora_checkpoint_keeps_adapters_and_head_and_resumes_bitwise(tiny_qwen2_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModel

    cfg = value_cfg(dim=4, alpha=8).model_copy(update={"precision": "bfloat16"})

    def fresh() -> ValueWorker:
        return ValueWorker(tiny_qwen2_dir, cfg, LOSS, global_batch_size=4, seed=0)

    straight = fresh()
    metrics = [straight.train(make_batch(s)) for s in range(2)]
    first = fresh()
    first.train(make_batch(0))
    first.save(str(tmp_path))
    resumed = fresh()
    resumed.load(str(tmp_path))
    assert resumed.train(make_batch(1)) == metrics[1]
    a, b = straight.weights(), resumed.weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the fp32 masters
    # Only the trained parameters are saved (the base backbone is the model path's).
    masters = load_file(tmp_path / MASTERS_FILE)
    assert set(masters) == set(first.master.names) and all(t.dtype == torch.float32 for t in masters.values())
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == [HEAD_FILE]
    # PEFT format: peft loads the adapters onto the bare backbone with the saved fp32 values.
    peft_model = PeftModel.from_pretrained(
        AutoModel.from_pretrained(tiny_qwen2_dir, dtype=torch.float32), str(tmp_path / ADAPTER_DIR)
    )
    loaded = {n: p for n, p in peft_model.named_parameters() if ".lora_" in n}
    adapters = {twin_name(n): t for n, t in masters.items() if n.startswith("backbone.")}
    assert loaded.keys() == adapters.keys() and all(torch.equal(loaded[n].detach(), adapters[n]) for n in loaded)
    # A checkpoint and a worker that disagree on LoRA are refused, not half-loaded.
    with pytest.raises(RuntimeError, match="holds LoRA adapters"):
        ValueWorker(tiny_qwen2_dir, ValueConfig(), LOSS, 4, 0).load(str(tmp_path))


def test_bad_value_lora_is_refused_at_its_key_before_training(tiny_qwen2_dir):
    from grpo_train.config import validate_config_dict
    from grpo_train.setup import StartupError, check_model_options

    def config(**lora):
        return validate_config_dict(
            {"ppo": {}, "policy": {"model_name": tiny_qwen2_dir}, "value": {"lora_cfg": {"enabled": True, **lora}}}
        )

    with pytest.raises(StartupError, match=r"^value\.lora_cfg\.target_modules: 'nope' matches no linear module"):
        check_model_options(config(match_all_linear=False, target_modules=["nope"]), tiny_qwen2_dir)
    with pytest.raises(StartupError, match=r"^value\.lora_cfg\.exclude_modules: "):
        check_model_options(
            config(exclude_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
            tiny_qwen2_dir,
        )
    check_model_options(config(), tiny_qwen2_dir)  # the backbone's linear layers: accepted
