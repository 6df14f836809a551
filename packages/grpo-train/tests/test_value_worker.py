"""The value worker in-process: value alignment, padding and micro-batch invariance, learning, save/load."""

from __future__ import annotations

import pytest
import torch

from grpo_train.config.schema import ValueConfig, ValueLossConfig
from grpo_train.ppo.value_worker import ValueWorker, value_planner

torch.set_num_threads(1)


def value_cfg(**kw) -> ValueConfig:
    base = dict(
        train_micro_batch_size=8,
        inference_batch_size=3,
        max_grad_norm=None,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.1}},
    )
    return ValueConfig(**(base | kw))


def make_batch(seed: int = 0, B: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 12, (B,), generator=g)
    S = int(lengths.max())
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    token_mask = attention_mask.float().clone()
    token_mask[:, :3] = 0  # 3 prompt tokens
    sample_mask = torch.ones(B)
    sample_mask[1] = 0
    return {
        "input_ids": torch.randint(3, 64, (B, S), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "returns": torch.randn(B, S, generator=g) * token_mask,
    }


def worker(model_dir: str, device: str = "cpu", **kw) -> ValueWorker:
    return ValueWorker(
        model_dir, value_cfg(**kw), ValueLossConfig(value_clip=0.5), global_batch_size=8, seed=0, device=device
    )


def test_values_start_at_zero_and_are_aligned_and_padding_invariant(tiny_qwen2_dir):
    w = worker(tiny_qwen2_dir)
    batch = make_batch()
    assert w.values(batch).abs().max() == 0  # zero head
    torch.nn.init.normal_(w.model.head.weight)
    values = w.values(batch)
    assert values[:, 0].abs().max() == 0 and (values * (1 - batch["attention_mask"])).abs().max() == 0
    # Row 0 alone, without padding, gives the same values; V at t depends only on x_<t.
    n = int(batch["attention_mask"][0].sum())
    alone = w.values({k: v[:1, :n] if v.dim() == 2 else v[:1] for k, v in batch.items()})
    torch.testing.assert_close(alone[0], values[0, :n], atol=1e-5, rtol=1e-5)
    changed = batch["input_ids"][:1, :n].clone()
    changed[0, n - 1] = (changed[0, n - 1] + 1) % 64
    again = w.values({"input_ids": changed, "attention_mask": batch["attention_mask"][:1, :n]})
    torch.testing.assert_close(again[0], values[0, :n], atol=1e-5, rtol=1e-5)


def test_micro_batch_size_does_not_change_the_step(tiny_qwen2_dir):
    batch = make_batch()
    results = []
    for micro in (8, 2):
        w = worker(tiny_qwen2_dir, train_micro_batch_size=micro)
        torch.nn.init.normal_(w.model.head.weight, std=0.1)
        batch["values"] = w.values(batch)
        metrics = w.train(batch)
        results.append((metrics["value_loss"], w.values(batch)))
    assert abs(results[0][0] - results[1][0]) < 1e-5
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "batching",
    [
        {
            "sequence_packing": {
                "enabled": True,
                "train_mb_tokens": 24,
                "logprob_mb_tokens": 30,
                "sequence_length_round": 4,
            }
        },
        {
            "dynamic_batching": {
                "enabled": True,
                "train_mb_tokens": 24,
                "logprob_mb_tokens": 30,
                "sequence_length_round": 4,
            }
        },
    ],
    ids=["packed", "dynamic"],
)
def test_token_budget_micro_batches_match_padded_ones(tiny_qwen2_dir, batching):
    """value.sequence_packing / value.dynamic_batching: the same values, loss and updated weights."""
    batch = make_batch()
    padded, other = worker(tiny_qwen2_dir), worker(tiny_qwen2_dir, **batching)
    assert value_planner(other.cfg, "train").name == next(iter(batching))
    for w in (padded, other):
        torch.nn.init.constant_(w.model.head.weight, 0.05)
    torch.testing.assert_close(other.values(batch), padded.values(batch), atol=1e-5, rtol=1e-5)
    batch["values"] = padded.values(batch)
    m_padded, m_other = padded.train(batch), other.train(batch)
    assert m_other["value_loss"] == pytest.approx(m_padded["value_loss"], rel=1e-5)
    for (name, a), b in zip(padded.model.named_parameters(), other.model.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)


def test_value_loss_falls_on_fixed_returns(tiny_qwen2_dir):
    w = worker(tiny_qwen2_dir, optimizer={"name": "torch.optim.Adam", "kwargs": {"lr": 1e-3}})
    batch = make_batch()
    batch["returns"] = batch["token_mask"] * 0.7  # every state is worth 0.7
    losses = []
    for _ in range(15):
        batch["values"] = w.values(batch)
        losses.append(w.train(batch)["value_loss"])
    assert losses[-1] < 0.2 * losses[0], losses


def test_save_and_load_resume_exactly(tiny_qwen2_dir, tmp_path):
    adam = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}}
    a = worker(tiny_qwen2_dir, optimizer=adam)
    batch = make_batch()
    batch["values"] = a.values(batch)
    a.train(batch)
    a.save(str(tmp_path / "value"))
    assert (tmp_path / "value" / "model" / "value_head.safetensors").is_file()
    b = worker(tiny_qwen2_dir, optimizer=adam)
    b.load(str(tmp_path / "value"))
    torch.testing.assert_close(a.values(batch), b.values(batch), atol=0, rtol=0)
    ma, mb = a.train(batch), b.train(batch)
    assert ma == pytest.approx(mb, rel=0, abs=0)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert pa.equal(pb)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_value_worker_matches_cpu(tiny_qwen2_dir, tmp_path):
    """device="cuda" (a GPU cluster) puts the model on CUDA; values, a step and save/load agree with CPU (fp32)."""
    batch = make_batch()
    cpu, gpu = worker(tiny_qwen2_dir), worker(tiny_qwen2_dir, device="cuda")
    assert next(gpu.model.parameters()).is_cuda
    for w in (cpu, gpu):
        torch.nn.init.constant_(w.model.head.weight, 0.01)
    torch.testing.assert_close(gpu.values(batch), cpu.values(batch), atol=1e-4, rtol=1e-4)
    batch["values"] = cpu.values(batch)
    assert gpu.train(batch)["value_loss"] == pytest.approx(cpu.train(batch)["value_loss"], rel=1e-4)
    gpu.save(str(tmp_path / "value"))
    again = worker(tiny_qwen2_dir, device="cuda")
    again.load(str(tmp_path / "value"))
    torch.testing.assert_close(again.values(batch), gpu.values(batch), atol=0, rtol=0)
