"""Data-parallel value workers (real Ray actors, gloo on CPU) against one value worker.

The oracle is the single worker on the same global batch: with the value loss divided by the
global valid-token count and gradients summed across ranks, two ranks must give the same values,
loss, gradients and updated weights (fp32, 1e-6 relative). A checkpoint written by rank 0 is
loaded by every rank (and by a single worker) and resumes bitwise. Config refusals need no Ray."""

from __future__ import annotations

import pytest
import ray
import torch

from grpo_train.actor_group import combine_rank_metrics, shard_steps
from grpo_train.config import ConfigError, validate_config_dict
from grpo_train.config.schema import ClusterConfig, ValueConfig, ValueLossConfig
from grpo_train.ppo.value_group import ValueGroup
from grpo_train.ppo.value_worker import HEAD_FILE, ValueWorker

torch.set_num_threads(1)
RTOL = 1e-6
# head.bias's gradient is a sum of O(1) per-token terms that nearly cancel: two ranks add it in
# another order than one worker, so differences also get this absolute floor (fp32 rounding of
# such a sum; 2e-9 seen on conftest's batch).
ATOL = 1e-8
GLOBAL_BATCH = 8
LOSS = ValueLossConfig(value_clip=0.5)


def value_cfg(num_workers: int) -> ValueConfig:
    return ValueConfig(
        num_workers=num_workers,
        train_micro_batch_size=2,
        inference_batch_size=3,
        max_grad_norm=1.0,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
    )


@pytest.fixture(scope="module")
def make_batch(policy_batch):
    """The rows of conftest's `ragged_policy_batch` (16 by default: two optimizer steps of 8, row 8
    masked) with value targets: returns and the rollout's values on the response tokens."""

    def build(seed: int = 0, B: int = 16) -> dict[str, torch.Tensor]:
        rows = policy_batch(B, seed)
        g = torch.Generator().manual_seed(seed + 1)
        mask = rows["token_mask"]
        return {
            **{k: rows[k] for k in ("input_ids", "attention_mask", "token_mask", "sample_mask")},
            "returns": torch.randn(mask.shape, generator=g) * mask,
            "values": 0.3 * torch.randn(mask.shape, generator=g) * mask,
        }

    return build


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Difference norm over RTOL * norm(b) + ATOL, in units of RTOL: <= RTOL passes."""
    return float((a - b).norm() / (b.norm() + ATOL / RTOL))


@pytest.fixture(scope="module")
def group(ray_session, tiny_qwen2_dir):
    g = ValueGroup(tiny_qwen2_dir, value_cfg(2), LOSS, ClusterConfig(), GLOBAL_BATCH, seed=0, num_threads=1)
    yield g
    g.close()


def test_two_value_ranks_match_one_worker(group, tiny_qwen2_dir, make_batch):
    """Two steps (the zero head first learns, then gradients reach the backbone): the second
    step's gradients, both steps' mean metrics, the weights and the new values agree."""
    single = ValueWorker(tiny_qwen2_dir, value_cfg(1), LOSS, GLOBAL_BATCH, seed=0)
    batch = make_batch()
    m1, m2 = single.train(batch), group.train(batch)
    for key in ("value_loss", "value_mse", "value_clip_fraction", "value_grad_norm", "value_lr"):
        assert abs(m2[key] - m1[key]) <= RTOL * max(abs(m1[key]), 1e-12), (key, m1[key], m2[key])
    g1, g2 = single.gradients(), group.gradients()
    assert g1.keys() == g2.keys() and float(g1["backbone.embed_tokens.weight"].norm()) > 0
    for name in g1:
        assert rel_err(g2[name], g1[name]) <= RTOL, name
    w1, w2 = single.weights(), group.weights()
    for name in w1:
        assert rel_err(w2[name], w1[name]) <= RTOL, name
    values = group.values(batch)
    assert values.abs().max() > 0
    torch.testing.assert_close(values, single.values(batch), rtol=0, atol=1e-6)
    ranks = group.whereabouts()
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]


def test_checkpoint_from_rank_0_resumes_every_rank_bitwise(group, tiny_qwen2_dir, tmp_path, make_batch):
    """Save, step, load, step again: the same metrics and weights to the bit on both ranks; the
    folder is the single worker's format (a single worker loads it to the same weights)."""
    folder = str(tmp_path / "value")
    group.save(folder)
    assert (tmp_path / "value" / "model" / HEAD_FILE).is_file() and (
        tmp_path / "value" / "optimizer.safetensors"
    ).is_file()
    saved = group.weights()
    batch = make_batch(seed=1)
    first = group.train(batch), ray.get([w.weights.remote() for w in group.workers])
    group.load(folder)
    for rank_weights in ray.get([w.weights.remote() for w in group.workers]):
        assert all(rank_weights[k].equal(saved[k]) for k in saved)
    again = group.train(batch), ray.get([w.weights.remote() for w in group.workers])
    assert again[0] == first[0]
    for before, after in zip(first[1], again[1]):
        assert all(after[k].equal(before[k]) for k in before)
    assert all(again[1][1][k].equal(again[1][0][k]) for k in saved)  # the replicas stayed identical
    single = ValueWorker(tiny_qwen2_dir, value_cfg(1), LOSS, GLOBAL_BATCH, seed=0)
    single.load(folder)
    assert all(single.weights()[k].equal(saved[k]) for k in saved)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpu_value_ranks_over_nccl_match_one_cpu_worker(ray_session, tiny_qwen2_dir, make_batch):
    """cluster.gpus_per_node > 0: a GPU bundle per rank, NCCL gradient sum; fp32 on both devices."""
    single = ValueWorker(tiny_qwen2_dir, value_cfg(1), LOSS, GLOBAL_BATCH, seed=0)
    gpu = ValueGroup(tiny_qwen2_dir, value_cfg(2), LOSS, ClusterConfig(gpus_per_node=2), GLOBAL_BATCH, seed=0)
    try:
        batch = make_batch()
        m1, m2 = single.train(batch), gpu.train(batch)
        values, expected = gpu.values(batch), single.values(batch)
    finally:
        gpu.close()
    assert m2["value_loss"] == pytest.approx(m1["value_loss"], rel=1e-4)
    torch.testing.assert_close(values, expected, rtol=1e-4, atol=1e-4)


def test_steps_split_evenly_and_metrics_add_up(make_batch):
    batch = make_batch()
    shards, tokens, seqs = shard_steps(batch, GLOBAL_BATCH, 2)
    assert [int(s["input_ids"].shape[0]) for s in shards] == [8, 8]
    assert torch.equal(shards[0]["input_ids"], torch.cat([batch["input_ids"][0:4], batch["input_ids"][8:12]]))
    # Row 8 is masked: the second optimizer step has 7 samples.
    assert seqs == [8.0, 7.0] and sum(tokens) == float((batch["token_mask"] * batch["sample_mask"][:, None]).sum())
    combined = combine_rank_metrics(
        [{"value_loss": 0.25, "value_lr": 0.1}, {"value_loss": 0.5, "value_lr": 0.1}], shared=("value_lr",)
    )
    assert combined == {"value_loss": 0.75, "value_lr": 0.1}


def ppo_config(**sections) -> dict:
    base = {
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
        "policy": {"train_global_batch_size": 4, "train_micro_batch_size": 2},
        "ppo": {},
    }
    return base | sections


GPU_CLUSTER = {"gpus_per_node": 2, "num_nodes": 1}
SEPARATE_GENERATION = {"colocated": {"enabled": False, "resources": {"gpus_per_node": 1, "num_nodes": 1}}}


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        ({"cluster": GPU_CLUSTER, "value": {"num_workers": 2}}, ("value.num_workers (2)", "cluster.gpus_per_node")),
        (
            {
                "cluster": GPU_CLUSTER,
                "policy": {
                    "train_global_batch_size": 4,
                    "train_micro_batch_size": 2,
                    "generation": SEPARATE_GENERATION,
                },
            },
            ("policy.generation.colocated.resources GPUs (1)", "= 3 GPUs"),
        ),
        ({"value": {"num_workers": 3}}, ("value.train_global_batch_size (4)", "value.num_workers (3)")),
        (
            {"cluster": {"num_cpus": 3}, "value": {"num_workers": 2}},
            ("value.num_workers (2)", "= 4 CPUs", "cluster.num_cpus is 3"),
        ),
        ({"value": {"num_gpus": 1}}, ("value.num_gpus was replaced by value.num_workers",)),
        (
            {"value": {"sequence_packing": {"enabled": True}, "dynamic_batching": {"enabled": True}}},
            ("value.dynamic_batching and value.sequence_packing",),
        ),
    ],
    ids=[
        "value-ranks-over-gpus",
        "separate-generation-over-gpus",
        "uneven-split",
        "local-cpus",
        "num-gpus",
        "two-planners",
    ],
)
def test_config_refuses_value_ranks_that_cannot_run(sections, words):
    with pytest.raises(ConfigError) as info:
        validate_config_dict(ppo_config(**sections))
    assert all(w in str(info.value) for w in words), str(info.value)


def test_config_accepts_value_ranks_that_fit():
    cfg = validate_config_dict(ppo_config(cluster=GPU_CLUSTER, value={"num_workers": 1}))
    assert cfg.value.num_workers == 1
    assert validate_config_dict(ppo_config(value={"num_workers": 4})).value.num_workers == 4  # all local CPUs
    remote = {"num_cpus": 2, "address": "ray://head:10001"}  # num_cpus sizes only a local Ray
    assert validate_config_dict(ppo_config(cluster=remote, value={"num_workers": 2})).value.num_workers == 2
