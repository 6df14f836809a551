"""Weight transports: the bucket plan, a real gloo broadcast of buckets, and a trainer actor
refitting a separately placed vLLM engine (CPU build) over the collective transport.

The oracle for the refit is the trainer itself: after the push, the engine's logprobs on probe
sequences equal the trainer's (fp32, 1e-4); before it they do not."""

from __future__ import annotations

import threading

import pytest
import ray
import torch

from grpo_train.config.schema import ClusterConfig, LossConfig, PolicyConfig
from grpo_train.refit import TRANSPORTS, make_transport, push_weights
from grpo_train.refit.buckets import free_address, open_group, plan_buckets, receive_buckets, send_buckets
from grpo_train.refit.check import check_refit
from grpo_train.refit.metas import tensor_metadata

TEMPERATURE = 0.7
KIB = 1024


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(10, 30, generator=g),
        "b": torch.randn(5, generator=g),
        "big": torch.randn(64, 64, generator=g),
        "h": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "c": torch.randn(2, 2, 2, generator=g),
    }


def test_bucket_plan_keeps_order_dtype_and_size():
    metas = tensor_metadata(sample_tensors().items())
    buckets = plan_buckets(metas, bucket_bytes=2 * KIB)
    assert [i for b in buckets for i in b] == list(range(len(metas)))
    for bucket in buckets:
        assert len({metas[i].dtype for i in bucket}) == 1
        assert len(bucket) == 1 or sum(metas[i].nbytes() for i in bucket) <= 2 * KIB
    assert [metas[i].name for i in buckets[1]] == ["big"]  # larger than a bucket: alone


def test_tensor_metadata_survives_plain_rows():
    """An AsyncLLM engine gets the metadata through vLLM's msgpack RPC, as plain rows."""
    from grpo_train.refit.metas import TensorMeta

    metas = tensor_metadata(sample_tensors().items())
    rows = [m.to_row() for m in metas]
    assert all(isinstance(r, list) and isinstance(r[1], list) for r in rows)
    back = [TensorMeta.from_row(tuple(r)) for r in rows]
    assert back == metas and [TensorMeta.from_row(m) for m in metas] == metas
    assert plan_buckets(back, 2 * KIB) == plan_buckets(metas, 2 * KIB)


def test_buckets_round_trip_over_a_real_gloo_group(ray_session):
    tensors = sample_tensors()
    metas = tensor_metadata(tensors.items())
    host, port = free_address()
    received: dict[str, torch.Tensor] = {}

    def receiver():
        group = open_group(host, port, 1, 2, "gloo")
        for name, t in receive_buckets(group, metas, 2 * KIB, torch.device("cpu")):
            received[name] = t.clone()

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = open_group(host, port, 0, 2, "gloo")
    sent = send_buckets(sender, iter(tensors.values()), metas, 2 * KIB, torch.device("cpu"))
    thread.join(timeout=60)
    assert sent == len(plan_buckets(metas, 2 * KIB)) > 2
    assert received.keys() == tensors.keys()
    for name, t in tensors.items():
        assert received[name].dtype == t.dtype and torch.equal(received[name], t)


def test_unknown_transport_names_the_config_key():
    assert set(TRANSPORTS) == {"object_store", "collective", "ipc"}
    with pytest.raises(ValueError, match="policy.generation.weight_transport"):
        make_transport("smoke_signals", 1.0)
    assert make_transport("collective", 1 / 1024).bucket_bytes == 1 << 20


def train_batch(B: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    S = 12
    ids = torch.randint(3, 64, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    token_mask = mask.float().clone()
    token_mask[:, :4] = 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
        "gen_logprobs": torch.zeros(B, S),
        "advantages": torch.randn(B, 1, generator=g) * token_mask,
    }


def test_separate_engine_is_refit_over_the_collective_transport(ray_session, tiny_qwen2_dir):
    from grpo_train.generation import make_generation_actor
    from grpo_train.policy.group import PolicyGroup

    cfg = PolicyConfig(
        precision="float32",
        train_global_batch_size=4,
        train_micro_batch_size=4,
        max_grad_norm=None,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 5.0}},
        generation={"temperature": TEMPERATURE},
    )
    # The engine starts while the trainer loads (the constructor returns at once).
    engine = make_generation_actor(
        "vllm",
        tiny_qwen2_dir,
        num_cpus=1,
        dtype="float32",
        max_model_len=128,
        seed=0,
        kv_cache_space_gb=0.125,
        temperature_for_logprobs=TEMPERATURE,
    )
    policy = PolicyGroup(
        tiny_qwen2_dir, cfg, LossConfig(reference_policy_kl_penalty=0.0), ClusterConfig(), seed=0, num_threads=1
    )
    try:
        ray.get(engine.ready.remote())
        transport = make_transport("collective", 64 / (1 << 20))  # 64 KiB buckets: dozens per push
        transport.connect(policy, [engine])
        batch = train_batch()
        batch["prev_logprobs"] = policy.logprobs(batch)
        policy.train(batch)
        g = torch.Generator().manual_seed(2)
        probe = [torch.randint(3, 64, (24,), generator=g).tolist() for _ in range(3)]
        prompt_lens = [6, 6, 6]

        def refit_diff() -> float:
            trainer = policy.score(probe, prompt_lens)
            return check_refit(trainer, ray.get(engine.score.remote(probe, prompt_lens)), float("inf"))

        assert refit_diff() > 1e-2  # the step moved the weights; the engine has the old ones
        transport.push(policy, [engine], version=1)
        assert refit_diff() <= 1e-4
        assert ray.get(engine.weight_version.remote()) == 1
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine)
        policy.close()


@pytest.mark.gpu
def test_colocated_engine_sleeps_and_is_refit_over_ipc(tiny_qwen2_dir):
    """GPU-only (vLLM's sleep mode and CUDA IPC exist only on GPUs): the engine frees its memory
    while the trainer runs, wakes for the push and then matches the trainer."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from grpo_train.generation import make_generation_actor
    from grpo_train.policy.group import PolicyGroup

    cfg = PolicyConfig(
        precision="float32",
        train_global_batch_size=4,
        train_micro_batch_size=4,
        max_grad_norm=None,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 5.0}},
        generation={"temperature": TEMPERATURE},
    )
    engine = make_generation_actor(
        "vllm",
        tiny_qwen2_dir,
        num_cpus=1,
        num_gpus=0.5,
        dtype="float32",
        max_model_len=128,
        seed=0,
        gpu_memory_utilization=0.3,
        temperature_for_logprobs=TEMPERATURE,
        enable_sleep_mode=True,
    )
    from grpo_train.colocation import MemoryChoreography
    from grpo_train.generation.group import GeneratorGroup

    policy = PolicyGroup(
        tiny_qwen2_dir,
        cfg,
        LossConfig(),
        ClusterConfig(gpus_per_node=1),
        seed=0,
        colocated_generation=True,
        start=False,
    )
    memory = MemoryChoreography(policy, GeneratorGroup([engine]), active=True)
    memory.start_engines_first()  # the engine profiles a clean GPU, sleeps; then the trainer moves in
    policy.attach(make_transport("ipc", 1.0), [engine])
    batch = train_batch()
    memory.for_training()
    batch["prev_logprobs"] = policy.logprobs(batch)
    policy.train(batch)
    memory.for_refit()  # gradients, optimizer state offloaded; the engine wakes
    push_weights(policy, 1)
    probe = [list(range(3, 27))]
    trainer = policy.score(probe, [6])
    assert check_refit(trainer, ray.get(engine.score.remote(probe, [6])), float("inf")) <= 1e-3
