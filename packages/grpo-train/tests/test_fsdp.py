"""FSDP2-sharded policy ranks on CPU (real Ray actors, a real gloo device mesh) against one
unsharded worker, and checkpoints that cross between the two layouts.

The oracle is the single in-process worker on the same global batch (fp32, 1e-6 relative),
started from the same state: the group loads the single worker's checkpoint first, which is
also the unsharded -> sharded load. Checkpoint round trips are checked bitwise. One sharded
group serves the module (each group start costs seconds on 2 cores)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from grpo_train.config.schema import ClusterConfig, DTensorConfig, LossConfig, PolicyConfig
from grpo_train.policy.fsdp import uses_fsdp
from grpo_train.policy.group import PolicyGroup
from grpo_train.refit.buckets import open_group, receive_buckets
from grpo_train.state_io import load_state

RTOL = 1e-6
# k_proj.bias has an exactly-zero gradient in exact arithmetic (softmax ignores a shift shared
# by all keys): its gradient, and its update, are rounding noise. Tensors compare to 1e-6
# relative plus this absolute floor on the difference norm. (AdamW would scale that noise up
# to lr-sized steps of random sign, hence SGD with momentum for the optimizer state.)
ATOL = 1e-9
LOSS = LossConfig(reference_policy_kl_penalty=0.05)
BUCKET_BYTES = 64 * 1024  # several buckets per push of the tiny model


def policy_cfg(num_workers: int, fsdp: bool | None = True, precision: str = "float32") -> PolicyConfig:
    """SGD with momentum: per-parameter optimizer state, sharded under FSDP2."""
    return PolicyConfig(
        precision=precision,
        train_global_batch_size=8,
        train_micro_batch_size=2,
        logprob_batch_size=3,
        max_grad_norm=1.0,
        num_workers=num_workers,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5, "momentum": 0.9}},
        dtensor_cfg=DTensorConfig(enabled=fsdp),
        generation={"temperature": 0.7},
    )


def prepare(batch, logprobs):
    batch = dict(batch)
    batch["prev_logprobs"] = logprobs(batch)
    batch["ref_logprobs"] = logprobs(batch, reference=True)
    return batch


def group_logprobs(group):
    return lambda b, **kw: group.logprobs(b, **kw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def assert_close_rel(got: dict, want: dict, what: str, atol: float = ATOL) -> None:
    assert got.keys() == want.keys() and len(want) > 0, what
    for name in want:
        diff = float((got[name] - want[name]).norm())
        assert diff <= RTOL * float(want[name].norm()) + atol, (what, name, rel_err(got[name], want[name]))


def assert_metrics_close(got: dict, want: dict) -> None:
    for key in ("loss", "grad_norm", "lr"):
        assert abs(got[key] - want[key]) <= RTOL * max(abs(want[key]), 1e-12), (key, want[key], got[key])


def assert_state_equal(a, b, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values, bitwise."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_state_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


def single_worker(model_dir: str, precision: str = "float32"):
    from grpo_train.policy.worker import PolicyWorker

    torch.set_num_threads(1)
    return PolicyWorker(model_dir, policy_cfg(1, precision=precision), LOSS, seed=0)


def synced_single_worker(group, model_dir: str, folder: Path, precision: str = "float32"):
    """A fresh single worker and the group in the same state: the group loads its checkpoint."""
    single = single_worker(model_dir, precision)
    single.save(str(folder))
    group.load(str(folder))
    return single


def collective_refit(group) -> dict[str, torch.Tensor]:
    """The weights as a separately placed engine receives them over the collective transport
    (this process is the receiving rank of a real gloo group)."""
    metas = group.weight_metadata()
    host, port = group.free_address()
    opened = group.submit_open_collective(host, port, 2, "gloo")
    receiver = open_group(host, port, 1, 2, "gloo")
    ray.get(opened)
    sent = group.submit_send_collective(BUCKET_BYTES)
    received = {name: t.clone() for name, t in receive_buckets(receiver, metas, BUCKET_BYTES, torch.device("cpu"))}
    assert ray.get(sent)[0] > 1  # rank 0 broadcast the buckets
    return received


# Also before the module fixture (room for one 2-rank group beside it).
@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [True, None], ids=["fsdp2", "gloo_all_reduce"])
def test_lora_ranks_match_one_lora_worker(policy_batch, ray_session, tiny_qwen2_dir, tmp_path, fsdp):
    """policy.dtensor_cfg.lora_cfg on two data-parallel ranks (FSDP2 over gloo, and full replicas
    with the gloo all-reduce) against one LoRA worker, fp32: the same logprobs (policy and the
    adapters-disabled reference), the same adapter gradients and metrics (1e-6 relative), only
    adapters carry gradients, and the merged refit gathered from the ranks is the single worker's.
    The group starts from the single worker's LoRA checkpoint (adapters only: the sharded load
    leaves the base weights as loaded)."""
    from grpo_train.policy.worker import PolicyWorker

    def cfg(n: int) -> PolicyConfig:
        lora = {"enabled": True, "dim": 4, "alpha": 8}
        return policy_cfg(n, fsdp=fsdp).model_copy(update={"dtensor_cfg": DTensorConfig(enabled=fsdp, lora_cfg=lora)})

    group = PolicyGroup(tiny_qwen2_dir, cfg(2), LOSS, ClusterConfig(), seed=0, num_threads=1)
    try:
        torch.set_num_threads(1)
        single = PolicyWorker(tiny_qwen2_dir, cfg(1), LOSS, seed=0)
        single.train(prepare(policy_batch(8, seed=1), single.logprobs))  # non-zero adapters to start from
        single.save(str(tmp_path / "start"))
        group.load(str(tmp_path / "start"))
        assert group._sharded == bool(fsdp)
        one = prepare(policy_batch(16, seed=0), single.logprobs)
        two = prepare(policy_batch(16, seed=0), group_logprobs(group))
        torch.testing.assert_close(two["prev_logprobs"], one["prev_logprobs"], rtol=0, atol=1e-6)
        torch.testing.assert_close(two["ref_logprobs"], one["ref_logprobs"], rtol=0, atol=1e-6)
        assert (one["prev_logprobs"] - one["ref_logprobs"]).abs().max() > 1e-3  # the adapters act
        m1, m2 = single.train(one), group.train(two)
        assert_metrics_close(m2, m1)
        grads = group.gradients()
        assert grads.keys() and all(".lora_A." in k or ".lora_B." in k for k in grads)
        assert_close_rel(grads, single.gradients(), "adapter gradients")
        assert_close_rel(group.weights(), single.weights(), "merged refit")
    finally:
        group.close()


@pytest.fixture(scope="module")
def fsdp_groups(ray_session, tiny_qwen2_dir):
    """The module's sharded group, and a fresh one for the resume test whose ranks load their
    model meanwhile (it joins its process group only when that test starts it)."""
    fresh = PolicyGroup(tiny_qwen2_dir, policy_cfg(2), LOSS, ClusterConfig(), seed=0, num_threads=1, start=False)
    group = PolicyGroup(tiny_qwen2_dir, policy_cfg(2), LOSS, ClusterConfig(), seed=0, num_threads=1)
    yield group, fresh
    group.close()
    fresh.close()


@pytest.fixture(scope="module")
def fsdp_group(fsdp_groups):
    return fsdp_groups[0]


def test_cpu_default_is_the_gloo_all_reduce_and_true_shards():
    assert not uses_fsdp(DTensorConfig(), on_gpu=False, world_size=2)
    assert uses_fsdp(DTensorConfig(), on_gpu=True, world_size=1)
    assert uses_fsdp(DTensorConfig(enabled=True), on_gpu=False, world_size=2)
    assert not uses_fsdp(DTensorConfig(enabled=True), on_gpu=False, world_size=1)
    assert not uses_fsdp(DTensorConfig(enabled=False), on_gpu=True, world_size=8)


# Runs before the module fixture starts its two groups: the session cluster has room for one
# 2-rank group beside them, not two.
@pytest.mark.slow
def test_bf16_mixed_precision_ranks_reduce_fp32_gradients_as_one_worker(
    policy_batch, ray_session, tiny_qwen2_dir, tmp_path
):
    """policy.precision=bfloat16 on two FSDP2 ranks (MixedPrecisionPolicy: fp32 shards, bf16
    gathers, fp32 reduce-scatter) against one unsharded worker (fp32 masters, bf16 compute
    copy): the same bf16 logprobs, the same fp32 gradients (summed over the ranks in fp32) and
    fp32 masters; the refit carries the masters' bf16 cast, in the checkpoint the masters stay fp32."""
    from grpo_train.policy.worker import PolicyWorker

    # Micro-batches of 4 rows: the single worker's two are the two ranks' shards, so each bf16
    # forward/backward is the same computation on both sides and only the fp32 sums remain.
    def cfg(n: int) -> PolicyConfig:
        return policy_cfg(n, precision="bfloat16").model_copy(
            update={"train_micro_batch_size": 4, "logprob_batch_size": 4}
        )

    group = PolicyGroup(tiny_qwen2_dir, cfg(2), LOSS, ClusterConfig(), seed=0, num_threads=1)
    try:
        torch.set_num_threads(1)
        single = PolicyWorker(tiny_qwen2_dir, cfg(1), LOSS, seed=0)
        single.save(str(tmp_path / "start"))
        group.load(str(tmp_path / "start"))
        assert group._sharded
        one = prepare(policy_batch(8, seed=0), single.logprobs)
        two = prepare(policy_batch(8, seed=0), group_logprobs(group))
        torch.testing.assert_close(two["prev_logprobs"], one["prev_logprobs"], rtol=0, atol=0)
        m1, m2 = single.train(one), group.train(two)
        assert_metrics_close(m2, m1)
        grads = group.gradients()
        assert {g.dtype for g in grads.values()} == {torch.float32}
        assert_close_rel(grads, single.gradients(), "fp32-reduced gradients")
        group.save(str(tmp_path / "saved"))
        masters = load_file(tmp_path / "saved" / "master_weights.safetensors")
        assert {t.dtype for t in masters.values()} == {torch.float32}
        assert_close_rel({k: masters[k] for k in single.master_weights()}, single.master_weights(), "masters")
        pushed = collective_refit(group)
        assert {t.dtype for t in pushed.values()} == {torch.bfloat16}
        assert all(torch.equal(t, masters[name].bfloat16()) for name, t in pushed.items())
    finally:
        group.close()


def test_fsdp_ranks_match_one_worker_and_refit_full_weights(policy_batch, fsdp_group, tiny_qwen2_dir, tmp_path):
    """Two optimizer steps (16 rows, 8 per step): logprobs, loss, grad norm, gradients and
    updated weights of the sharded ranks equal the single worker's; both transports carry
    the full weights out of the shards."""
    single = synced_single_worker(fsdp_group, tiny_qwen2_dir, tmp_path / "start")
    assert fsdp_group._sharded
    one = prepare(policy_batch(16, seed=0), single.logprobs)
    two = prepare(policy_batch(16, seed=0), group_logprobs(fsdp_group))
    torch.testing.assert_close(two["prev_logprobs"], one["prev_logprobs"], rtol=0, atol=1e-6)
    torch.testing.assert_close(two["ref_logprobs"], one["ref_logprobs"], rtol=0, atol=1e-6)
    m1, m2 = single.train(one), fsdp_group.train(two)
    assert_metrics_close(m2, m1)
    assert m1["grad_norm"] > policy_cfg(1).max_grad_norm  # the clip acts (on DTensor gradients in the group)
    assert_close_rel(fsdp_group.gradients(), single.gradients(), "gradients")
    w1 = single.weights()
    assert_close_rel(fsdp_group.weights(), w1, "object_store refit")
    assert_close_rel(collective_refit(fsdp_group), w1, "collective refit")
    assert "lm_head.weight" not in w1  # tied: sent once, as the embedding


def test_fsdp_checkpoint_round_trips_bitwise_and_resumes_exactly(policy_batch, fsdp_groups, tiny_qwen2_dir, tmp_path):
    """Save the sharded ranks after a step; a fresh sharded group and an unsharded worker load
    it bitwise (weights, momentum buffers), write it back byte-identical in the unsharded format,
    and take the same next step as the group that never stopped."""
    fsdp_group, resumed = fsdp_groups
    fsdp_group.train(prepare(policy_batch(8, seed=1), group_logprobs(fsdp_group)))
    saved = tmp_path / "saved"
    fsdp_group.save(str(saved))
    resumed.start()
    resumed.load(str(saved))
    resumed.save(str(tmp_path / "resaved"))
    single = single_worker(tiny_qwen2_dir)
    single.load(str(saved))
    single.save(str(tmp_path / "unsharded"))
    for copy in ("resaved", "unsharded"):
        assert_checkpoints_equal(saved, tmp_path / copy)
    assert_state_equal(single.optimizer.state_dict(), load_state(saved, "optimizer"))
    assert_state_equal(resumed.weights(), fsdp_group.weights())

    nxt = policy_batch(8, seed=2)
    m_cont = fsdp_group.train(prepare(nxt, group_logprobs(fsdp_group)))
    m_res = resumed.train(prepare(nxt, group_logprobs(resumed)))
    m_one = single.train(prepare(nxt, single.logprobs))
    assert m_res == m_cont
    assert_state_equal(resumed.weights(), fsdp_group.weights())
    assert_metrics_close(m_one, m_cont)
    assert_close_rel(single.weights(), fsdp_group.weights(), "unsharded resume")

    # Rank 0 alone reads the checkpoint; a bad one fails on every rank instead of hanging one.
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    weights = load_file(bad / "model" / "model.safetensors")
    weights.pop("model.norm.weight")
    save_file(weights, bad / "model" / "model.safetensors", metadata={"format": "pt"})
    for ref in [worker.load.remote(str(bad)) for worker in resumed.workers]:
        with pytest.raises(ray.exceptions.RayTaskError, match="missing \\['model.norm.weight'\\]"):
            ray.get(ref, timeout=120)


def assert_checkpoints_equal(a: Path, b: Path) -> None:
    """Same files and model config; safetensors, optimizer, scheduler and RNG state bitwise equal."""
    assert sorted(p.name for p in (a / "model").iterdir()) == sorted(p.name for p in (b / "model").iterdir())
    config = [json.loads((folder / "model" / "config.json").read_text()) for folder in (a, b)]
    assert config[0] == config[1] and config[0]["architectures"] == ["Qwen2ForCausalLM"]
    assert (a / "model" / "tokenizer.json").is_file()  # the folder loads alone (grpo eval --checkpoint)
    for shard in sorted((a / "model").glob("*.safetensors")):
        assert_state_equal(load_file(shard), load_file(b / "model" / shard.name), str(shard))
    for name in ("optimizer", "scheduler", "torch_rng"):
        assert_state_equal(load_state(a, name), load_state(b, name), name)


def test_one_row_on_two_sharded_ranks_is_the_single_worker_step(policy_batch, fsdp_group, tiny_qwen2_dir, tmp_path):
    """Rank 0 gets no rows: it runs pad-token micro-batches so that the shards' gathers and
    reduce-scatters stay matched, and the result is the single worker's."""
    single = synced_single_worker(fsdp_group, tiny_qwen2_dir, tmp_path / "start")
    one = prepare(policy_batch(1, seed=3), single.logprobs)
    two = prepare(policy_batch(1, seed=3), group_logprobs(fsdp_group))
    torch.testing.assert_close(two["prev_logprobs"], one["prev_logprobs"], rtol=0, atol=1e-6)
    m1, m2 = single.train(one), fsdp_group.train(two)
    assert_metrics_close(m2, m1)
    assert m2.keys() == m1.keys()
    assert_close_rel(fsdp_group.weights(), single.weights(), "weights")
