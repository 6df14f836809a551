"""Tensor-parallel policy ranks (policy.dtensor_cfg.tensor_parallel_size=2: real Ray actors, a real
gloo dp x tp device mesh, torch.distributed.tensor.parallel) against one unsharded worker.

The oracle is the single in-process worker on the same global batch (fp32), started from the
same state: the TP group loads the single worker's checkpoint first (rank 0 reads it and
scatters it into the TP shards). One optimizer step, the clip acting: logprobs (policy and
reference), loss, grad norm, every gradient, the updated weights the refit gathers and the
checkpoint the TP ranks write in the unsharded HF format must agree within 1e-5 relative. Resuming from
that checkpoint (padded case) repeats the next step bitwise in the TP group and within 1e-5 in one
unsharded worker."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from grpo_train.config.schema import ClusterConfig, DTensorConfig, LossConfig, PolicyConfig
from grpo_train.policy.group import PolicyGroup
from grpo_train.refit.buckets import open_group, receive_buckets

RTOL = 1e-5
ATOL = 1e-9  # k_proj.bias: an exactly-zero gradient in exact arithmetic (see test_fsdp.py)
LOSS = LossConfig(reference_policy_kl_penalty=0.05)
BUCKET_BYTES = 64 * 1024  # several buckets per push of the tiny model


def policy_cfg(num_workers: int, tp: int, sp: bool = False, packing: bool = False) -> PolicyConfig:
    return PolicyConfig(
        precision="float32",
        train_global_batch_size=6,
        train_micro_batch_size=3,
        logprob_batch_size=3,
        max_grad_norm=1.0,
        num_workers=num_workers,
        sequence_packing={"enabled": packing},
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5, "momentum": 0.9}},
        dtensor_cfg=DTensorConfig(tensor_parallel_size=tp, sequence_parallel=sp),
        generation={"temperature": 0.7},
    )


def collective_refit(group) -> dict[str, torch.Tensor]:
    """The weights as a separately placed engine receives them, bucket by bucket, over the collective
    transport (this process is the receiving rank of a real gloo group)."""
    metas = group.weight_metadata()
    host, port = group.free_address()
    opened = group.submit_open_collective(host, port, 2, "gloo")
    receiver = open_group(host, port, 1, 2, "gloo")
    ray.get(opened)
    sent = group.submit_send_collective(BUCKET_BYTES)
    received = {name: t.clone() for name, t in receive_buckets(receiver, metas, BUCKET_BYTES, torch.device("cpu"))}
    assert ray.get(sent)[0] > 1  # rank 0 broadcast the buckets
    return received


def assert_close_rel(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys() and len(want) > 0, (what, sorted(got.keys() ^ want.keys()))
    for name in want:
        diff = float((got[name] - want[name]).norm())
        assert diff <= RTOL * float(want[name].norm()) + ATOL, (what, name, diff, float(want[name].norm()))


def check_resume(single, group, saved: str, batch: dict) -> None:
    """Resume from the TP group's checkpoint (full weights, SGD momentum, scheduler, RNG, written by rank 0
    in the unsharded format): into the same TP group, the next step repeats bitwise (logprobs, metrics,
    updated weights); into one unsharded worker (another layout), it agrees within 1e-5 relative."""

    def step(group_or_worker, lp):
        return group_or_worker({**batch, "prev_logprobs": lp[0], "ref_logprobs": lp[1]})

    lp = group.logprobs_and_reference(batch)
    metrics = step(group.train, lp)
    want = group.weights()
    group.load(saved)
    lp_again = group.logprobs_and_reference(batch)
    assert torch.equal(lp_again, lp)
    assert step(group.train, lp_again) == metrics
    got = group.weights()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), "TP resume not bitwise"
    single.load(saved)
    step(single.train, single.logprobs_and_reference(batch))
    assert_close_rel(single.weights(), want, "TP checkpoint resumed by one unsharded worker")


@pytest.mark.slow
@pytest.mark.parametrize("sp,packing", [(False, False), (True, True)], ids=["tp2_padded", "tp2_sp_packed"])
def test_tp2_ranks_match_one_worker(policy_batch, ray_session, tiny_qwen2_dir, tmp_path, sp, packing):
    from grpo_train.policy.worker import PolicyWorker

    torch.set_num_threads(1)
    single = PolicyWorker(tiny_qwen2_dir, policy_cfg(1, 1, packing=packing), LOSS, seed=0)
    group = PolicyGroup(tiny_qwen2_dir, policy_cfg(2, 2, sp, packing), LOSS, ClusterConfig(), seed=0, num_threads=1)
    try:
        assert group._sharded  # the ranks' parameters are DTensors: full-weight calls gather on every rank
        single.save(str(tmp_path / "start"))
        group.load(str(tmp_path / "start"))
        batch = policy_batch(6, seed=0)
        lp1 = single.logprobs_and_reference(batch)
        lp2 = group.logprobs_and_reference(batch)
        torch.testing.assert_close(lp2, lp1, rtol=0, atol=1e-5)
        one = {**batch, "prev_logprobs": lp1[0], "ref_logprobs": lp1[1]}
        two = {**batch, "prev_logprobs": lp2[0], "ref_logprobs": lp2[1]}
        m1, m2 = single.train(one), group.train(two)
        assert m1["grad_norm"] > 1.0  # the clip acts (over TP-sharded and replicated gradients)
        assert m2.keys() == m1.keys()  # metrics counted once per dp group, not once per tp rank
        for key in m1:
            assert abs(m2[key] - m1[key]) <= RTOL * abs(m1[key]) + 1e-7, (key, m1[key], m2[key])
        assert_close_rel(group.gradients(), single.gradients(), "gradients")
        w1 = single.weights()
        assert "lm_head.weight" not in w1  # tied: once, as the embedding
        assert_close_rel(group.weights(), w1, "object_store refit")
        assert_close_rel(collective_refit(group), w1, "collective refit (rank 0 sends, every rank gathers)")
        group.save(str(tmp_path / "saved"))
        saved = load_file(Path(tmp_path / "saved" / "model" / "model.safetensors"))
        assert_close_rel(saved, w1, "checkpoint (unsharded HF format)")
        if not sp:  # one case suffices: SP and packing change activations, not the parameters' or checkpoint's layout
            check_resume(single, group, str(tmp_path / "saved"), policy_batch(6, seed=1))
    finally:
        group.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")
@pytest.mark.parametrize("sp,packing", [(False, False), (True, True)], ids=["tp2_padded", "tp2_sp_packed"])
def test_tp2_gpu_ranks_match_one_gpu_worker(policy_batch, ray_session, tiny_qwen2_dir, sp, packing):
    """GPU-only (not run on the CPU machine): a TP=2 group on two GPUs (an NCCL tp mesh; the vocab-sharded
    logits reach grpo_kernels' Triton vocab-parallel kernels through the dispatch) against one GPU worker,
    fp32, the same model and batch: policy and reference logprobs, every train metric, gradients and the
    updated weights within 1e-5 relative. The groups run one after the other (two GPUs in all)."""
    cluster = ClusterConfig(gpus_per_node=2)
    batch = policy_batch(6, seed=0)
    results = []
    for workers in (1, 2):
        group = PolicyGroup(
            tiny_qwen2_dir, policy_cfg(workers, workers, sp and workers == 2, packing), LOSS, cluster, seed=0
        )
        try:
            lp = group.logprobs_and_reference(batch)
            metrics = group.train({**batch, "prev_logprobs": lp[0], "ref_logprobs": lp[1]})
            results.append((lp, metrics, group.gradients(), group.weights()))
        finally:
            group.close()
    (lp1, m1, g1, w1), (lp2, m2, g2, w2) = results
    torch.testing.assert_close(lp2, lp1, rtol=0, atol=1e-5)
    assert m2.keys() == m1.keys()
    for key in m1:
        assert abs(m2[key] - m1[key]) <= RTOL * abs(m1[key]) + 1e-7, (key, m1[key], m2[key])
    assert_close_rel(g2, g1, "gradients")
    assert_close_rel(w2, w1, "updated weights")


def test_bad_tensor_parallel_input_is_refused_at_its_key_before_training(tiny_qwen2_dir):
    """tensor_parallel_size must divide the ranks (config check) and the model's heads, KV heads
    and vocabulary (startup check, before any actor); SP and a custom plan need TP > 1."""
    from grpo_train.config import validate_config_dict
    from grpo_train.config.errors import ConfigError
    from grpo_train.config.schema import GRPOMasterConfig
    from grpo_train.setup import StartupError, check_model_options

    def dtensor(num_workers: int = 2, **cfg) -> dict:
        return {
            "policy": {
                "num_workers": num_workers,
                "train_global_batch_size": 4,
                "precision": "float32",
                "dtensor_cfg": cfg,
            }
        }

    check_model_options(GRPOMasterConfig(**dtensor(tensor_parallel_size=2)), tiny_qwen2_dir)  # 2 heads, vocab 64
    engine = {"policy": {"generation": {"vllm_cfg": {"tensor_parallel_size": 2}}}}
    check_model_options(GRPOMasterConfig(**engine), tiny_qwen2_dir)
    engine["policy"]["generation"]["vllm_cfg"]["tensor_parallel_size"] = 4
    with pytest.raises(
        StartupError,
        match=r"^policy.generation.vllm_cfg.tensor_parallel_size: 4 does not fit the "
        r"model's num_attention_heads=2, num_key_value_heads=2",
    ):
        check_model_options(GRPOMasterConfig(**engine), tiny_qwen2_dir)
    with pytest.raises(
        StartupError,
        match=r"^policy.dtensor_cfg.tensor_parallel_size: 4 does not divide the "
        r"model's num_attention_heads=2, num_key_value_heads=2",
    ):
        check_model_options(GRPOMasterConfig(**dtensor(4, tensor_parallel_size=4)), tiny_qwen2_dir)
    for precision, cluster, enabled, refused in [
        ("bfloat16", {}, None, True),
        ("bfloat16", {"gpus_per_node": 4}, False, True),
        ("bfloat16", {"gpus_per_node": 4}, None, False),
        ("bfloat16", {}, True, True),
    ]:  # dp 1 on CPU: no FSDP2
        config = dtensor(tensor_parallel_size=2, enabled=enabled)
        config["policy"]["precision"], config["cluster"] = precision, cluster
        if refused:
            with pytest.raises(StartupError, match=r"^policy.precision: bfloat16 with policy.dtensor_cfg.tensor_para"):
                check_model_options(GRPOMasterConfig(**config), tiny_qwen2_dir)
        else:
            check_model_options(GRPOMasterConfig(**config), tiny_qwen2_dir)
    cases = [
        (
            dtensor(3, tensor_parallel_size=2),
            "policy.dtensor_cfg.tensor_parallel_size (2) must divide policy.num_workers (3)",
        ),
        (dtensor(sequence_parallel=True), "policy.dtensor_cfg.sequence_parallel"),
        (dtensor(custom_parallel_plan="my.plan:x"), "policy.dtensor_cfg.custom_parallel_plan"),
        (dtensor(tensor_parallel_size=2, custom_parallel_plan="my.plan"), "expected 'module:object'"),
        (dtensor(tensor_parallel_size=2, lora_cfg={"enabled": True}), "LoRA adapters on tensor-parallel layers"),
    ]
    for config, message in cases:
        with pytest.raises(ConfigError) as err:
            validate_config_dict(config)
        assert message in str(err.value), str(err.value)
