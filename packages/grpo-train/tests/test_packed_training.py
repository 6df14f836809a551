"""Packed and dynamic micro-batches train exactly like padded ones: same logprobs, loss and
gradients; packed sequences do not see each other; dummy micro-batches change nothing; a
sequence over the token budget is an error that names the key."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from grpo_train.config.schema import LossConfig, PolicyConfig
from grpo_train.policy import microbatch
from grpo_train.policy.logprobs import VARLEN_ATTENTION, _length_buckets, use_packed_attention, varlen_sdpa_attention
from grpo_train.policy.worker import PolicyWorker

VOCAB = 48
B, S = 8, 20
PACKING = {
    "sequence_packing": {"enabled": True, "train_mb_tokens": 40, "logprob_mb_tokens": 48, "sequence_length_round": 16}
}
DYNAMIC = {
    "dynamic_batching": {"enabled": True, "train_mb_tokens": 48, "logprob_mb_tokens": 64, "sequence_length_round": 4}
}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 with grouped-query attention (2 query heads share 1 KV head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-gqa")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def policy_cfg(**kw) -> PolicyConfig:
    base = dict(
        precision="float32",
        train_global_batch_size=8,
        train_micro_batch_size=4,
        logprob_batch_size=3,
        max_grad_norm=None,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}},
        generation={"temperature": 0.7},
    )
    base.update(kw)
    return PolicyConfig(**base)


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows of 3..20 tokens (a wide spread, so padding and packing differ)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([20, 3, 11, 7, 16, 5, 13, 9])
    input_ids = torch.randint(0, VOCAB, (B, S), generator=g)
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    token_mask = attention_mask.float().clone()
    token_mask[:, :2] = 0  # 2 prompt tokens
    sample_mask = torch.ones(B)
    sample_mask[5] = 0
    gen = -torch.rand(B, S, generator=g) * token_mask
    adv = torch.randn(B, generator=g)
    return {
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": gen,
        "advantages": adv[:, None] * token_mask,
        "sample_mask": sample_mask,
    }


def train_once(model_dir, batch, loss_cfg=None, **kw):
    """One optimizer step -> (metrics, gradients before the step, prev logprobs, loss scale)."""
    worker = PolicyWorker(model_dir, policy_cfg(**kw), loss_cfg or LossConfig(reference_policy_kl_penalty=0.05), seed=0)
    batch = dict(batch)
    batch["prev_logprobs"] = worker.logprobs(batch) + 0.01 * batch["token_mask"]  # ratios != 1: clipping matters
    batch["ref_logprobs"] = worker.logprobs(batch, reference=True)
    grads = {}
    step = worker.optimizer.step

    def capture_then_step(*args, **kwargs):
        grads.update({k: v.grad.detach().clone() for k, v in worker.model.named_parameters()})
        return step(*args, **kwargs)

    worker.optimizer.step = capture_then_step
    metrics = worker.train(batch)
    valid = batch["token_mask"] * batch["sample_mask"][:, None]
    scale = float((batch["advantages"].abs() * valid).sum() / valid.sum())
    return metrics, grads, batch["prev_logprobs"], scale


def assert_same_step(got, ref):
    """Logprobs within 1e-5 (fp32); loss and gradients within 1e-6 relative. The loss is a mean of
    advantage-weighted ratios whose advantages average to about 0, so its value is small by
    cancellation; it is compared relative to its scale without cancellation (mean |advantage|)."""
    (metrics, grads, prev, _), (ref_metrics, ref_grads, ref_prev, scale) = got, ref
    torch.testing.assert_close(prev, ref_prev, rtol=0, atol=1e-5)
    assert abs(metrics["loss"] - ref_metrics["loss"]) <= 1e-6 * max(abs(ref_metrics["loss"]), scale)
    flat = torch.cat([grads[k].double().flatten() for k in sorted(grads)])
    ref_flat = torch.cat([ref_grads[k].double().flatten() for k in sorted(grads)])
    rel = float((flat - ref_flat).norm() / ref_flat.norm())
    assert rel <= 1e-6, f"relative gradient difference {rel:.2e}"


@pytest.fixture(scope="module")
def padded_step(model_dir):
    return train_once(model_dir, make_batch())


@pytest.mark.parametrize("layout", [PACKING, DYNAMIC], ids=["packing", "dynamic"])
def test_logprobs_loss_and_gradients_match_padded(model_dir, padded_step, layout):
    assert_same_step(train_once(model_dir, make_batch(), **layout), padded_step)


def test_packing_matches_padded_with_sequence_level_loss_and_fused_head(model_dir):
    """Per-sequence means (token_level_loss false, GSPO ratios) and the fused lm_head op."""
    loss = LossConfig(reference_policy_kl_penalty=0.05, token_level_loss=False, sequence_level_importance_ratios=True)
    ref = train_once(model_dir, make_batch(1), loss, use_fused_kernels=True)
    assert_same_step(train_once(model_dir, make_batch(1), loss, use_fused_kernels=True, **PACKING), ref)


def test_packed_micro_batches_hold_several_rows(model_dir):
    """The equality tests above are only meaningful if rows really share a packed stream."""
    batch = make_batch()
    plan = microbatch.make_planner(policy_cfg(**PACKING), "train").plan(
        microbatch.row_lengths(batch["attention_mask"]), S
    )
    assert all(mb.packed for mb in plan)
    assert max(len(mb.rows) for mb in plan) >= 3
    assert any(mb.width > sum(mb.lengths) for mb in plan)  # a padding tail (sequence_length_round 16)


def test_attention_does_not_leak_across_packed_sequences(model_dir):
    worker = PolicyWorker(model_dir, policy_cfg(**PACKING), LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    batch = make_batch()
    plan = microbatch.make_planner(worker.cfg, "logprob").plan(microbatch.row_lengths(batch["attention_mask"]), S)
    shared = next(mb for mb in plan if len(mb.rows) >= 3)
    changed = shared.rows[len(shared.rows) // 2]  # a row with packed neighbours on both sides, if it has them
    before = worker.logprobs(batch)
    edited = dict(batch)
    edited["input_ids"] = batch["input_ids"].clone()
    n = int(batch["attention_mask"][changed].sum())
    edited["input_ids"][changed, :n] = (batch["input_ids"][changed, :n] + 1) % VOCAB
    after = worker.logprobs(edited)
    others = [r for r in range(B) if r != changed]
    torch.testing.assert_close(after[others], before[others], rtol=0, atol=1e-6)
    assert (after[changed, 1:n] - before[changed, 1:n]).abs().max() > 1e-3


def test_dummy_micro_batches_leave_loss_and_gradients_unchanged(model_dir, padded_step, monkeypatch):
    """A rank with fewer micro-batches than the others runs dummy ones: zero contribution."""
    calls = []
    forward = PolicyWorker._microbatch_logprobs

    def counting(self, model, batch, mb):
        calls.append(mb)
        return forward(self, model, batch, mb)

    monkeypatch.setattr(PolicyWorker, "_agree_microbatch_count", lambda self, n: n + 2)
    monkeypatch.setattr(PolicyWorker, "_microbatch_logprobs", counting)
    got = train_once(model_dir, make_batch(), **PACKING)
    assert_same_step(got, padded_step)
    cfg = policy_cfg(**PACKING)
    lengths = microbatch.row_lengths(make_batch()["attention_mask"])
    n_logprob = len(microbatch.make_planner(cfg, "logprob").plan(lengths, S))
    n_train = len(microbatch.make_planner(cfg, "train").plan(lengths, S))
    assert len(calls) == 2 * (n_logprob + 2) + n_train + 2  # prev + ref logprobs, then the train step


def run_rank(rank: int, port: int, model_dir: str, data: str) -> dict:
    """One of two gloo ranks: prev logprobs and one optimizer step on its shard with packing."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        spec = torch.load(data)
        worker = PolicyWorker(
            model_dir,
            PolicyConfig(**spec["cfg"]),
            LossConfig(reference_policy_kl_penalty=0.0),
            seed=0,
            rank=rank,
            world_size=2,
        )
        calls = []
        run = worker._microbatch_logprobs
        worker._microbatch_logprobs = lambda model, batch, mb: calls.append(mb) or run(model, batch, mb)
        shard = spec["shards"][rank]
        shard["prev_logprobs"] = worker.logprobs(shard)
        worker.train(shard, [spec["tokens"]], [spec["seqs"]])
        return {"calls": len(calls), "weights": {k: v.detach().clone() for k, v in worker.model.state_dict().items()}}
    finally:
        dist.destroy_process_group()


# Rank 1 runs in a child process: this file's run_rank, loaded by path.
RANK_1 = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("packed_training_rank", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
torch.set_num_threads(1)
torch.save(module.run_rank(1, int(sys.argv[2]), sys.argv[3], sys.argv[4]), sys.argv[5])
"""


def test_data_parallel_ranks_with_different_bin_counts_stay_in_step(model_dir, tmp_path):
    """Two gloo ranks (this process and a child) whose shards pack into 1 and 2 bins: the first
    runs dummy micro-batches (forward and backward) so both take the same number, and the step
    equals one worker's."""
    import socket
    import subprocess
    import sys

    cfg = dict(
        precision="float32",
        train_global_batch_size=8,
        train_micro_batch_size=4,
        logprob_batch_size=4,
        max_grad_norm=None,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}},
        generation={"temperature": 0.7},
        **PACKING,
    )
    batch = make_batch()
    order = [1, 2, 3, 5, 0, 4, 6, 7]  # rank 0: lengths 3, 11, 7, 5 (one bin); rank 1: 20, 16, 13, 9
    batch = {k: v[order] for k, v in batch.items()}
    shards = [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}]
    bins = {
        purpose: [
            len(
                microbatch.make_planner(PolicyConfig(**cfg), purpose).plan(
                    microbatch.row_lengths(s["attention_mask"]), S
                )
            )
            for s in shards
        ]
        for purpose in ("logprob", "train")
    }
    assert bins["train"][0] < bins["train"][1]
    valid = batch["token_mask"] * batch["sample_mask"][:, None]
    data = tmp_path / "data.pt"
    torch.save(
        {"cfg": cfg, "shards": shards, "tokens": float(valid.sum()), "seqs": float(batch["sample_mask"].sum())}, data
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, "-c", RANK_1, __file__, str(port), model_dir, str(data), str(tmp_path / "rank1.pt")],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        rank0 = run_rank(0, port, model_dir, str(data))
    finally:
        _, err = child.communicate(timeout=180)
    assert child.returncode == 0, err[-3000:]
    ranks = [rank0, torch.load(tmp_path / "rank1.pt")]
    expected_calls = max(bins["logprob"]) + max(bins["train"])  # every rank runs the larger count, dummies included
    assert [r["calls"] for r in ranks] == [expected_calls, expected_calls]
    single = PolicyWorker(model_dir, PolicyConfig(**cfg), LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    batch["prev_logprobs"] = single.logprobs(batch)
    single.train(batch)
    for name, value in single.model.state_dict().items():
        for r in ranks:
            torch.testing.assert_close(r["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "layout,key",
    [
        (PACKING, "policy.sequence_packing.train_mb_tokens"),
        (DYNAMIC, "policy.dynamic_batching.train_mb_tokens"),
    ],
)
def test_sequence_over_the_token_budget_is_an_error_naming_the_key(model_dir, layout, key):
    section = next(iter(layout))
    small = {section: {**layout[section], "train_mb_tokens": 16}}
    worker = PolicyWorker(model_dir, policy_cfg(**small), LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    batch = make_batch()
    batch["prev_logprobs"] = worker.logprobs(batch)  # the logprob budget is large enough
    with pytest.raises(ValueError, match=rf"{key}=16: row 0 of the batch is 20 tokens long .* at least 20"):
        worker.train(batch)
    tiny = {section: {**layout[section], "logprob_mb_tokens": 10}}
    worker.cfg = policy_cfg(**tiny)
    with pytest.raises(ValueError, match=rf"policy.{section}.logprob_mb_tokens=10"):
        worker.logprobs(batch)


def test_score_goes_through_packed_micro_batches(model_dir):
    padded = PolicyWorker(model_dir, policy_cfg(), LossConfig(), seed=0)
    packed = PolicyWorker(model_dir, policy_cfg(**PACKING), LossConfig(), seed=0)
    seqs, prompt_lens = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 12], [2, 1, 4]
    for a, b in zip(packed.score(seqs, prompt_lens), padded.score(seqs, prompt_lens)):
        assert a == pytest.approx(b, abs=1e-5)
    assert packed.model.config._attn_implementation == VARLEN_ATTENTION


# ------------------------------------------------------------------ the attention function
def per_sequence_attention(q, k, v, lengths):
    """Oracle: each sequence's causal attention on its own, [1, H, T, D] -> [1, T, H, D]."""
    rep = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in filter(None, lengths):
        s = slice(start, start + n)
        o = F.scaled_dot_product_attention(
            q[:, :, s], k[:, :, s].repeat_interleave(rep, 1), v[:, :, s].repeat_interleave(rep, 1), is_causal=True
        )
        out.append(o.transpose(1, 2))
        start += n
    return torch.cat(out, dim=1)


def test_varlen_attention_equals_per_sequence_attention():
    torch.manual_seed(0)
    lengths = [5, 1, 9, 8, 0, 3]  # 9 and 8 share a padded SDPA call; the last one plays the padding tail
    T = sum(lengths)
    q = torch.randn(1, 4, T, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, T, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, T, 8, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    module = torch.nn.Module()
    out, _ = varlen_sdpa_attention(
        module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9
    )
    assert [len(b) for b in _length_buckets(lengths)] == [2, 1, 1, 1]
    expected = per_sequence_attention(q, k, v, lengths)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_packed_attention_switch_is_idempotent_and_not_saved(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    use_packed_attention(model)
    use_packed_attention(model)
    assert model.config._attn_implementation == VARLEN_ATTENTION
    model.save_pretrained(tmp_path)
    assert VARLEN_ATTENTION not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_startup_warns_when_a_budget_is_below_the_longest_sequence():
    from grpo_train.config.schema import GRPOMasterConfig
    from grpo_train.setup import check_supported

    cfg = GRPOMasterConfig(
        policy={
            "max_total_sequence_length": 512,
            "sequence_packing": {"enabled": True, "train_mb_tokens": 256, "logprob_mb_tokens": 1024},
        }
    )
    assert check_supported(cfg) == [
        "policy.sequence_packing.train_mb_tokens=256 is below policy.max_total_sequence_length=512: "
        "a longer sequence will stop training with an error"
    ]
    assert check_supported(GRPOMasterConfig(policy={"max_total_sequence_length": 512})) == []


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_packed_logprobs_match_padded_on_cuda_bf16(model_dir, attn):
    """bf16 on a GPU: packed through PyTorch's flash varlen kernel (a model loaded with sdpa is
    switched to varlen_sdpa_attention) or through flash-attn's varlen (flash_attention_2 reads
    cu_seq_lens_*), against padded attention."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    from grpo_train.policy.logprobs import packed_logprobs, sequence_logprobs

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation=attn).cuda().eval()
    )
    batch = make_batch()
    ids, mask = batch["input_ids"].cuda(), batch["attention_mask"].cuda()
    with torch.no_grad():
        padded = sequence_logprobs(model, ids, mask, 0.7)
        mb = microbatch.MicroBatch(
            tuple(range(B)), tuple(microbatch.row_lengths(mask)), int(mask.sum()) + 5, packed=True
        )
        packed = microbatch.pack_rows(ids, mb)
        flat = packed_logprobs(model, packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen, 0.7)
        got = microbatch.unpack_rows(flat, packed)
    torch.testing.assert_close(
        got.float(), padded[:, : got.shape[1]].float() * mask[:, : got.shape[1]], rtol=0, atol=3e-2
    )
    assert model.config._attn_implementation == (VARLEN_ATTENTION if attn == "sdpa" else attn)
