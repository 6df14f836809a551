"""Mixed precision in-process (policy and value workers): fp32 masters move at a bf16 run's
small lr as fp32 weights do, where AdamW on bf16 weights leaves most of them unchanged; the
compute copy is the bf16 cast of the masters (what the engine gets); a checkpoint keeps the
fp32 masters and resumes bitwise. The FSDP2 side (MixedPrecisionPolicy over a gloo mesh) is
in test_fsdp.py."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from grpo_train.config.schema import LossConfig, PolicyConfig, ValueConfig, ValueLossConfig
from grpo_train.policy.precision import MasterWeights
from grpo_train.policy.worker import MASTERS_FILE, PolicyWorker

LR = 5e-6  # grpo_math_1B.yaml's
ADAMW = {"name": "torch.optim.AdamW", "kwargs": {"lr": LR, "weight_decay": 0.01}}
LOSS = LossConfig(reference_policy_kl_penalty=0.05)
# k_proj.bias has an exactly-zero gradient in exact arithmetic (softmax ignores a shift shared by
# all keys): its gradient's sign, and so its AdamW update, is rounding noise in either precision.
NOISE = ("k_proj.bias",)


VOCAB = 64


def make_batch(seed: int = 0, B: int = 8) -> dict[str, torch.Tensor]:
    """B ragged rows (3 prompt tokens, one masked sample) of the tiny model's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 12, (B,), generator=g)
    S = int(lengths.max())
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    token_mask = attention_mask.float().clone()
    token_mask[:, :3] = 0
    sample_mask = torch.ones(B)
    sample_mask[1] = 0
    return {
        "input_ids": torch.randint(3, VOCAB, (B, S), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": -torch.rand(B, S, generator=g) * token_mask,
        "advantages": torch.randn(B, generator=g)[:, None] * token_mask,
        "sample_mask": sample_mask,
    }


def worker(tiny_qwen2_dir: str, precision: str) -> PolicyWorker:
    cfg = PolicyConfig(
        precision=precision,
        train_global_batch_size=8,
        train_micro_batch_size=4,
        logprob_batch_size=4,
        max_grad_norm=None,
        optimizer=ADAMW,
        generation={"temperature": 0.7},
    )
    return PolicyWorker(tiny_qwen2_dir, cfg, LOSS, seed=0)


def prepared(w: PolicyWorker, seed: int = 0) -> dict[str, torch.Tensor]:
    batch = make_batch(seed)
    batch["prev_logprobs"] = w.logprobs(batch)
    batch["ref_logprobs"] = w.logprobs(batch, reference=True)
    return batch


def flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten().float() for k, v in d.items() if not k.endswith(NOISE)])


def test_bf16_masters_move_as_fp32_where_bf16_adamw_does_not(tiny_qwen2_dir):
    moved, grads = {}, {}
    for precision in ("float32", "bfloat16"):
        w = worker(tiny_qwen2_dir, precision)
        before = w.master_weights()
        assert all(t.dtype == torch.float32 for t in before.values())
        w.train(prepared(w))
        moved[precision] = {k: v - before[k] for k, v in w.master_weights().items()}
        grads[precision] = w.gradients()
        assert all(g.dtype == torch.float32 for g in grads[precision].values())
        if precision == "bfloat16":  # the compute copy (what refit pushes) is the masters' cast
            masters = w.master_weights()
            pushed = w.weights()
            assert all(
                pushed[k].dtype == torch.bfloat16 and torch.equal(pushed[k], masters[k].bfloat16()) for k in pushed
            )
    fp32, mixed = flat(moved["float32"]), flat(moved["bfloat16"])
    # AdamW's first step is ~lr * sign(grad) per weight: an fp32 run moves every weight by ~lr.
    assert float((fp32.abs() > 0.5 * LR).float().mean()) > 0.99
    assert float((mixed - fp32).norm() / fp32.norm()) < 0.2
    assert float((mixed.sign() == fp32.sign()).float().mean()) > 0.99

    # Contrast: the same bf16 gradients applied by AdamW to bf16 weights (no masters).
    w = worker(tiny_qwen2_dir, "bfloat16")
    weights = {k: torch.nn.Parameter(v.bfloat16()) for k, v in w.master_weights().items()}
    opt = torch.optim.AdamW(weights.values(), lr=LR, weight_decay=0.01)
    for k, p in weights.items():
        p.grad = grads["bfloat16"][k].bfloat16()
    start = {k: p.detach().clone() for k, p in weights.items()}
    opt.step()
    bf16_only = flat({k: p.detach() - start[k] for k, p in weights.items()})
    assert float((bf16_only == 0).float().mean()) > 0.8  # most updates round to nothing


def test_fp32_precision_keeps_one_copy(tiny_qwen2_dir):
    w = worker(tiny_qwen2_dir, "float32")
    assert w.master.parameters() == list(w.model.parameters())  # the masters are the weights


def test_mixed_checkpoint_keeps_masters_and_resumes_bitwise(tiny_qwen2_dir, tmp_path):
    uninterrupted = worker(tiny_qwen2_dir, "bfloat16")
    uninterrupted.train(prepared(uninterrupted, seed=0))
    uninterrupted.save(str(tmp_path / "ckpt"))
    # The HF export is in the compute dtype; the masters file holds fp32.
    exported = load_file(str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert (tmp_path / "ckpt" / MASTERS_FILE).is_file()

    resumed = worker(tiny_qwen2_dir, "bfloat16")
    resumed.load(str(tmp_path / "ckpt"))
    for a, b in (
        (uninterrupted.master_weights(), resumed.master_weights()),
        (uninterrupted.weights(), resumed.weights()),
    ):
        assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    state_a, state_b = uninterrupted.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for i in state_a:
        assert all(torch.equal(state_a[i][key], state_b[i][key]) for key in state_a[i])
    batch = prepared(uninterrupted, seed=1)
    uninterrupted.train(dict(batch))
    resumed.train(dict(batch))
    a, b = uninterrupted.master_weights(), resumed.master_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], exported[k].float()) for k in a if k in exported)  # it did step


def test_value_worker_keeps_fp32_masters(tiny_qwen2_dir, tmp_path):
    from grpo_train.ppo.value_worker import ValueWorker

    cfg = ValueConfig(precision="bfloat16", optimizer=ADAMW, train_micro_batch_size=2)
    v = ValueWorker(tiny_qwen2_dir, cfg, ValueLossConfig(), global_batch_size=4, seed=0)
    assert isinstance(v.master, MasterWeights) and v.master.mixed
    assert all(p.dtype == torch.bfloat16 for p in v.model.parameters())
    before = v.weights()
    assert all(t.dtype == torch.float32 for t in before.values())
    batch = {k: t[:4] for k, t in make_batch(0).items()}
    batch["values"] = torch.zeros_like(batch["token_mask"])
    batch["returns"] = batch["token_mask"]
    v.train(batch)  # the zero head gives the backbone zero gradients at first: a second step moves it
    v.train(batch)
    after = v.weights()
    backbone = [k for k in before if k.startswith("backbone.")]
    moved = flat({k: after[k] - before[k] for k in backbone})
    start = flat({k: before[k] for k in backbone})
    assert float((moved != 0).float().mean()) > 0.9
    # ... by less than half a bf16 step of the weight: bf16 weights would have rounded back.
    assert float((moved.abs() < start.abs() * 2.0**-9).float().mean()) > 0.8
    assert all(torch.equal(p.detach(), after[k].bfloat16()) for k, p in v.model.named_parameters())
    v.save(str(tmp_path / "value"))
    resumed = ValueWorker(tiny_qwen2_dir, cfg, ValueLossConfig(), global_batch_size=4, seed=0)
    resumed.load(str(tmp_path / "value"))
    again = resumed.weights()
    assert all(torch.equal(again[k], after[k]) for k in after)  # the fp32 masters, not the bf16 export
