"""LoRA on peft (`policy.dtensor_cfg.lora_cfg`), in-process on the tiny Qwen2: what trains, the
reference without a copy, the merged refit, bf16 masters, checkpoints and resume, bad input."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from grpo_train.config.schema import GRPOMasterConfig, LossConfig, PolicyConfig
from grpo_train.policy.logprobs import sequence_logprobs
from grpo_train.policy.worker import ADAPTER_DIR, MASTERS_FILE, PolicyWorker

VOCAB = 64  # conftest.build_tiny_model
DIM, ALPHA = 4, 8


def lora_policy(lr: float = 1e-2, **lora) -> PolicyConfig:
    return PolicyConfig(
        precision=lora.pop("precision", "float32"),
        train_global_batch_size=8,
        train_micro_batch_size=4,
        logprob_batch_size=4,
        max_grad_norm=None,
        generation={"temperature": 1.0},
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": lr, "weight_decay": 0.0}},
        dtensor_cfg={"lora_cfg": {"enabled": True, "dim": DIM, "alpha": ALPHA, **lora}},
    )


def make_batch(seed: int = 0, B: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 14, (B,), generator=g)
    S = int(lengths.max())
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    token_mask = attention_mask.float().clone()
    token_mask[:, :3] = 0
    adv = torch.randn(B, generator=g)
    return {
        "input_ids": torch.randint(0, VOCAB, (B, S), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": -torch.rand(B, S, generator=g) * token_mask,
        "advantages": adv[:, None] * token_mask,
        "sample_mask": torch.ones(B),
    }


def step_batch(worker: PolicyWorker, seed: int) -> dict[str, torch.Tensor]:
    batch = make_batch(seed)
    return {**batch, "prev_logprobs": worker.logprobs(batch), "ref_logprobs": worker.logprobs(batch, reference=True)}


def plain_logprobs(model_or_dir, batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = model_or_dir
    if isinstance(model_or_dir, str):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32)
    with torch.no_grad():
        return sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], 1.0) * batch["attention_mask"]


@pytest.fixture(scope="module")
def trained(tiny_qwen2_dir):
    """A LoRA worker after one AdamW step (adapters non-zero), with the base weights it started from."""
    worker = PolicyWorker(tiny_qwen2_dir, lora_policy(), LossConfig(reference_policy_kl_penalty=0.05), seed=0)
    base = {k: v.clone() for k, v in worker.model.state_dict().items() if ".lora_" not in k}
    worker.train(step_batch(worker, 0))
    return worker, base


def test_only_adapters_require_grad_and_get_optimizer_state(trained):
    worker, base = trained
    trainable = [n for n, p in worker.model.named_parameters() if p.requires_grad]
    # every linear of the 2 decoder layers (q, k, v, o, gate, up, down) gets lora_A and lora_B; lm_head does not
    assert len(trainable) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert worker.master.names == trainable
    optimized = [p for group in worker.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in worker.master.parameters()}
    assert set(worker.optimizer.state) == set(optimized)  # AdamW state for the adapters only
    after = worker.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base did not move
    assert any(worker.model.get_parameter(n).abs().sum() > 0 for n in trainable if ".lora_B." in n)


def test_reference_is_the_base_model_with_adapters_disabled_and_no_copy(trained, tiny_qwen2_dir):
    worker, _ = trained
    batch = make_batch(1)
    assert worker.reference is None
    ref = worker.logprobs(batch, reference=True) * batch["attention_mask"]
    full = PolicyWorker(tiny_qwen2_dir, lora_policy(enabled=False), LossConfig(), seed=0)  # same micro-batches
    assert torch.equal(ref, full.logprobs(batch) * batch["attention_mask"])  # the untouched base model, bitwise
    assert (worker.logprobs(batch) * batch["attention_mask"] - ref).abs().max() > 1e-3  # the adapters do act
    # Memory: the parameters the worker holds are the base's plus the adapters', nothing more.
    from transformers import AutoModelForCausalLM

    base_numel = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).parameters())
    adapter_numel = sum(p.numel() for p in worker.master.parameters())
    held = {id(p): p.numel() for p in worker.model.parameters()}
    held.update({id(p): p.numel() for p in worker.master.parameters()})
    assert sum(held.values()) == base_numel + adapter_numel
    # rank 4 on every linear: A is [4, in], B is [out, 4]; q/k/v/o 128x128, gate/up 128->256, down 256->128
    per_layer = 4 * 4 * (128 + 128) + 3 * 4 * (128 + 256)
    assert adapter_numel == 2 * per_layer


def test_merged_refit_is_w_plus_scaled_ba_and_leaves_the_trainer_unmerged(trained):
    worker, _ = trained
    before = {k: v.clone() for k, v in worker.model.state_dict().items()}
    pushed = worker.weights()
    assert all(torch.equal(before[k], v) for k, v in worker.model.state_dict().items())  # no merge left behind
    assert not any(".lora_" in k or ".base_layer" in k for k in pushed)
    name = "model.layers.1.mlp.down_proj"
    a, b = before[f"{name}.lora_A.default.weight"], before[f"{name}.lora_B.default.weight"]
    expected = before[f"{name}.base_layer.weight"] + (b @ a) * (ALPHA / DIM)
    torch.testing.assert_close(pushed[f"{name}.weight"], expected, rtol=0, atol=1e-6)
    assert torch.equal(pushed["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    # A plain HF model given the pushed weights scores like the LoRA policy (the engine's view).
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(worker.model_path, dtype=torch.float32)
    assert set(pushed) == set(plain.state_dict()) - {"lm_head.weight"}  # tied head: sent once
    plain.load_state_dict(pushed, strict=False)
    batch = make_batch(2)
    torch.testing.assert_close(
        plain_logprobs(plain, batch), worker.logprobs(batch) * batch["attention_mask"], rtol=0, atol=1e-5
    )


def test_bf16_compute_keeps_fp32_masters_for_the_adapters_only(tiny_qwen2_dir):
    worker = PolicyWorker(tiny_qwen2_dir, lora_policy(precision="bfloat16"), LossConfig(), seed=0)
    assert all(m.dtype == torch.float32 for m in worker.master.parameters())
    assert all(p.dtype == torch.bfloat16 for p in worker.model.parameters())  # base and adapters compute in bf16
    assert len(worker.master.names) == 2 * 7 * 2
    worker.train(step_batch(worker, 0))
    for master, compute in zip(worker.master.parameters(), worker.master.compute):
        assert torch.equal(compute, master.detach().to(torch.bfloat16))  # the compute copy is the masters' cast
    assert any(
        float(m.detach().abs().max()) > 0
        for n, m in zip(worker.master.names, worker.master.parameters())
        if ".lora_B." in n
    )


def test_lora_a_init_is_rank_independent_and_follows_lora_A_init(tiny_qwen2_dir):
    def adapters(rank: int, init: str) -> dict[str, torch.Tensor]:
        w = PolicyWorker(tiny_qwen2_dir, lora_policy(lora_A_init=init), LossConfig(), seed=3, rank=rank, world_size=2)
        return w.master.state()

    xavier0, xavier1, kaiming = adapters(0, "xavier"), adapters(1, "xavier"), adapters(0, "kaiming")
    assert all(torch.equal(xavier0[k], xavier1[k]) for k in xavier0)  # DP ranks start from the same adapters
    a = "model.layers.0.self_attn.q_proj.lora_A.default.weight"  # [4, 128]
    assert float(xavier0[a].abs().max()) <= math.sqrt(6 / (128 + 4))  # xavier-uniform bound
    assert float(xavier0[a].abs().max()) > 1 / math.sqrt(128)  # beyond kaiming's: a different law
    assert float(kaiming[a].abs().max()) <= 1 / math.sqrt(128)  # kaiming-uniform, a=sqrt(5): 1/sqrt(fan_in)
    assert all(float(v.abs().max()) == 0 for k, v in xavier0.items() if ".lora_B." in k)


def test_target_modules_select_layers_and_exclude_modules_remove_them(tiny_qwen2_dir):
    w = PolicyWorker(
        tiny_qwen2_dir,
        lora_policy(
            match_all_linear=False,
            target_modules=["q_proj", "v_proj"],
            exclude_modules=["model.layers.1.self_attn.v_proj"],
        ),
        LossConfig(),
        seed=0,
    )
    adapted = sorted({n.split(".lora_")[0] for n in w.master.names})
    assert adapted == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
    ]


def test_dropout_reaches_the_adapter_input(tiny_qwen2_dir):
    w = PolicyWorker(tiny_qwen2_dir, lora_policy(dropout=0.25), LossConfig(), seed=0)
    q = w.model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q.lora_dropout["default"], torch.nn.Dropout) and q.lora_dropout["default"].p == 0.25
    assert not w.reuses_prev(make_batch(0), 8)  # dropout: the training forward is not the logprob pass


def test_checkpoint_is_peft_format_with_a_merged_export_and_resumes_bitwise(tiny_qwen2_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def fresh() -> PolicyWorker:
        return PolicyWorker(tiny_qwen2_dir, lora_policy(), LossConfig(reference_policy_kl_penalty=0.05), seed=0)

    straight = fresh()
    metrics = [straight.train(step_batch(straight, s)) for s in range(3)]
    first = fresh()
    for s in range(2):
        first.train(step_batch(first, s))
    first.save(str(tmp_path))
    resumed = fresh()
    resumed.load(str(tmp_path))
    assert resumed.train(step_batch(resumed, 2)) == metrics[2]
    assert all(torch.equal(v, straight.master.state()[k]) for k, v in resumed.master.state().items())
    # PEFT format: peft loads the adapters onto the base model and scores like the worker that saved them.
    batch = make_batch(5)
    saved = first.logprobs(batch) * batch["attention_mask"]
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32), str(tmp_path / ADAPTER_DIR)
    )
    torch.testing.assert_close(plain_logprobs(peft_model.get_base_model(), batch), saved, rtol=0, atol=1e-6)
    # model/: the merged HF model (what `grpo eval --checkpoint` loads), plain names, no adapters.
    torch.testing.assert_close(plain_logprobs(str(tmp_path / "model"), batch), saved, rtol=0, atol=1e-5)
    assert (tmp_path / MASTERS_FILE).is_file() and (tmp_path / "model" / "tokenizer.json").is_file()


def test_bad_lora_input_is_refused_at_its_key_before_training(tiny_qwen2_dir):
    from grpo_train.setup import StartupError, check_model_options

    def cfg(**lora) -> GRPOMasterConfig:
        return GRPOMasterConfig(policy={"dtensor_cfg": {"lora_cfg": {"enabled": True, **lora}}})

    check_model_options(cfg(), tiny_qwen2_dir)
    with pytest.raises(StartupError, match=r"^policy.dtensor_cfg.lora_cfg.target_modules: 'qkv' matches no linear"):
        check_model_options(cfg(match_all_linear=False, target_modules=["q_proj", "qkv"]), tiny_qwen2_dir)
    with pytest.raises(StartupError, match=r"^policy.dtensor_cfg.lora_cfg.target_modules: an adapter on lm_head"):
        check_model_options(cfg(match_all_linear=False, target_modules=["lm_head"]), tiny_qwen2_dir)
    with pytest.raises(StartupError, match=r"^policy.dtensor_cfg.lora_cfg.exclude_modules: excludes every"):
        check_model_options(
            cfg(match_all_linear=False, target_modules=["q_proj"], exclude_modules=["q_proj"]), tiny_qwen2_dir
        )


def test_moe_models_are_refused():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from grpo_train.config.schema import LoRAConfig
    from grpo_train.policy.lora import LoRAConfigError, check_lora

    config = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
    )
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    with pytest.raises(LoRAConfigError, match=r"^policy.dtensor_cfg.lora_cfg.enabled: LoRA on mixture-of-experts"):
        check_lora(model, LoRAConfig(enabled=True))


def test_adapter_refit_is_accepted_and_its_unsupported_combinations_are_refused_at_their_key():
    """refit: adapter validates (it was refused before it was built) and reaches the engine and the
    transport: the vLLM engine gets lora_adapter {dim, alpha}, `auto` resolves to the object store.
    Refused, each at its key: the hf backend (loads full weights only), the collective / ipc transports
    (adapters go through the object store), async GRPO (in-flight adapter ids not built), dim > 512
    (vLLM's largest max_lora_rank)."""
    from grpo_train.config import validate_config_dict
    from grpo_train.config.errors import ConfigError
    from grpo_train.setup import attach_generators, engine_factories

    adapter = {"policy": {"dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": 8, "alpha": 32, "refit": "adapter"}}}}
    cfg = validate_config_dict(adapter)

    class Policy:
        placement_group = None

        def attach(self, transport, generators):
            self.transport = transport

    policy = Policy()
    factories = engine_factories(cfg, "/model", policy)
    assert [f.keywords["lora_adapter"] for f in factories] == [{"dim": 8, "alpha": 32}]
    attach_generators(
        cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"gpus_per_node": 1})}),
        policy,
        generator=SimpleNamespace(engines=[]),
    )  # auto on separate GPUs would be collective
    assert type(policy.transport).__name__ == "ObjectStoreTransport"
    merged = validate_config_dict({"policy": {"dtensor_cfg": {"lora_cfg": {"enabled": True}}}})
    assert "lora_adapter" not in engine_factories(merged, "/model", policy)[0].keywords

    def refused(extra: dict) -> str:
        config = {**adapter, **{k: v for k, v in extra.items() if k != "policy"}}
        config["policy"] = {**adapter["policy"], **extra.get("policy", {})}
        with pytest.raises(ConfigError) as err:
            validate_config_dict(config)
        return str(err.value)

    assert "policy.dtensor_cfg.lora_cfg.refit: adapter needs policy.generation.backend: vllm" in refused(
        {"policy": {"generation": {"backend": "hf"}}}
    )
    for transport in ("collective", "ipc"):
        assert f"policy.generation.weight_transport: '{transport}' with lora_cfg.refit: adapter" in refused(
            {"policy": {"generation": {"weight_transport": transport}}}
        )
    assert "grpo.async_grpo with policy.dtensor_cfg.lora_cfg.refit: adapter is not supported" in refused(
        {"grpo": {"async_grpo": {"enabled": True}}, "loss_fn": {"use_importance_sampling_correction": True}}
    )
    big = {"dtensor_cfg": {"lora_cfg": {**adapter["policy"]["dtensor_cfg"]["lora_cfg"], "dim": 513}}}
    assert (
        "policy.dtensor_cfg.lora_cfg.dim: 513 with refit: adapter exceeds vLLM's largest max_lora_rank (512)"
        in refused({"policy": big})
    )
    # The engine's side reads the same bound (config/schema/generation.py): 512 fits, 513 does not.
    from grpo_train.generation.lora_adapter import vllm_max_lora_rank

    assert vllm_max_lora_rank(512) == 512 and vllm_max_lora_rank(300) == 320
    with pytest.raises(ValueError, match="exceeds vLLM's largest max_lora_rank 512"):
        vllm_max_lora_rank(513)
