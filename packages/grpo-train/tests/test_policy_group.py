"""Data-parallel policy workers (real Ray actors, gloo on CPU) against one worker.

The oracle is the single worker on the same global batch: with the loss divided by the global
valid-token count and gradients summed across ranks, two ranks must give the same loss,
gradients and updated weights (fp32, 1e-6 relative)."""

from __future__ import annotations

import pytest
import torch

from grpo_train.actor_group import split_rows
from grpo_train.config.schema import ClusterConfig, DTensorConfig, LossConfig, PolicyConfig
from grpo_train.policy.group import PolicyGroup, combine_metrics, worker_bundles

VOCAB = 64
RTOL = 1e-6
# k_proj.bias has an exactly-zero gradient in exact arithmetic (softmax ignores a shift shared by
# all keys): its gradient is rounding noise, so differences also get this absolute floor (as in
# test_fsdp.py and test_tp_workers.py).
ATOL = 1e-9


def policy_cfg(num_workers: int) -> PolicyConfig:
    return PolicyConfig(
        precision="float32",
        train_global_batch_size=8,
        train_micro_batch_size=2,
        logprob_batch_size=3,
        max_grad_norm=1.0,
        num_workers=num_workers,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
        generation={"temperature": 0.7},
    )


@pytest.fixture(scope="module")
def make_batch(policy_batch):
    """conftest's `ragged_policy_batch`: by default 16 rows, two optimizer steps of 8, row 8 masked."""
    return lambda B=16, seed=0: policy_batch(B, seed)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Difference norm over RTOL * norm(b) + ATOL, in units of RTOL: <= RTOL passes."""
    return float((a - b).norm() / (b.norm() + ATOL / RTOL))


def prepare(batch, logprobs):
    batch = dict(batch)
    batch["prev_logprobs"] = logprobs(batch)
    batch["ref_logprobs"] = logprobs(batch, reference=True)
    return batch


LOSS = LossConfig(reference_policy_kl_penalty=0.05)


@pytest.fixture(scope="module")
def gloo_group(ray_session, tiny_qwen2_dir):
    """Two unsharded gloo ranks (dtensor_cfg.enabled is null: no FSDP2 on CPU), shared by the module."""
    group = PolicyGroup(tiny_qwen2_dir, policy_cfg(2), LOSS, ClusterConfig(), seed=0, num_threads=1)
    yield group
    group.close()


def synced_single_worker(group, model_dir: str, folder):
    """A fresh in-process worker, and the group loaded from its checkpoint (same state)."""
    from grpo_train.policy.worker import PolicyWorker

    torch.set_num_threads(1)
    single = PolicyWorker(model_dir, policy_cfg(1), LOSS, seed=0)
    single.save(str(folder))
    group.load(str(folder))
    return single


def test_two_data_parallel_workers_match_one_worker(gloo_group, tiny_qwen2_dir, tmp_path, make_batch):
    """Oracle: one PolicyWorker in this process; subject: two gloo ranks in Ray actors."""
    group = gloo_group
    single = synced_single_worker(group, tiny_qwen2_dir, tmp_path)
    assert not group._sharded
    one = prepare(make_batch(), single.logprobs)
    m1 = single.train(one)
    g1, w1 = single.gradients(), single.weights()
    two = prepare(make_batch(), lambda b, **kw: group.logprobs(b, **kw))
    m2 = group.train(two)
    g2, w2 = group.gradients(), group.weights()
    ranks = group.whereabouts()
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]
    torch.testing.assert_close(two["prev_logprobs"], one["prev_logprobs"], rtol=0, atol=1e-6)
    for key in ("loss", "grad_norm", "lr"):
        assert abs(m2[key] - m1[key]) <= RTOL * max(abs(m1[key]), 1e-12), (key, m1[key], m2[key])
    assert m1["grad_norm"] > 0
    assert g1.keys() == g2.keys() and len(g1) > 0
    for name in g1:
        assert rel_err(g2[name], g1[name]) <= RTOL, name
    for name in w1:
        assert rel_err(w2[name], w1[name]) <= RTOL, name


def test_logprobs_and_reference_in_one_call_equal_the_two_calls_bitwise(gloo_group, make_batch):
    """The loop's one round trip for prev and ref logprobs returns exactly the two separate calls."""
    batch = make_batch(B=7, seed=5)  # 7 rows: ranks get 4 and 3 rows, the halves are concatenated
    separate = prepare(batch, lambda b, **kw: gloo_group.logprobs(b, **kw))
    both = gloo_group.logprobs_and_reference(batch)
    assert both.shape == (2, *batch["input_ids"].shape)
    assert torch.equal(both[0], separate["prev_logprobs"]) and torch.equal(both[1], separate["ref_logprobs"])


def test_one_row_on_two_ranks_is_the_single_worker_step(gloo_group, tiny_qwen2_dir, tmp_path, make_batch):
    """A batch smaller than the ranks: rank 0 gets no rows, runs a pad-token micro-batch (zero
    gradient) and still joins the all-reduces; the result is the single worker's."""
    single = synced_single_worker(gloo_group, tiny_qwen2_dir, tmp_path)
    batch = {key: value[:1] for key, value in make_batch(B=8, seed=3).items()}
    one = prepare(batch, single.logprobs)
    two = prepare(batch, lambda b, **kw: gloo_group.logprobs(b, **kw))
    torch.testing.assert_close(two["prev_logprobs"], one["prev_logprobs"], rtol=0, atol=1e-6)
    m1, m2 = single.train(one), gloo_group.train(two)
    assert m2.keys() == m1.keys() and m1["grad_norm"] > 0
    for key in ("loss", "grad_norm", "lr", "ratio_min", "ratio_max"):
        assert abs(m2[key] - m1[key]) <= RTOL * max(abs(m1[key]), 1e-12), (key, m1[key], m2[key])
    w1, w2 = single.weights(), gloo_group.weights()
    for name in w1:
        assert rel_err(w2[name], w1[name]) <= RTOL, name


@pytest.mark.parametrize("planner", ["padded", "dynamic_batching", "sequence_packing"])
def test_a_rank_without_rows_runs_a_dummy_microbatch(tiny_qwen2_dir, planner, make_batch):
    """Every planner's stand-in for an empty row share: a two-token pad row through the model
    (its gradient is zero), so FSDP2's gathers and the gloo all-reduce stay matched."""
    from grpo_train.policy import microbatch
    from grpo_train.policy.worker import PolicyWorker

    torch.set_num_threads(1)
    update = {planner: {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64}} if planner != "padded" else {}
    cfg = PolicyConfig.model_validate({**policy_cfg(1).model_dump(), **update})
    worker = PolicyWorker(tiny_qwen2_dir, cfg, LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    empty = {key: value[:0] for key, value in make_batch(B=8).items()}
    planner_, lengths, plan = worker._plan(empty, "train")
    assert microbatch.planner_name(cfg) == planner and lengths == [] and plan == []
    curr = worker._microbatch_logprobs(worker.model, *worker._dummy(empty, planner_, lengths))
    (curr.sum() * 0.0).backward()
    assert curr.shape[0] == 1 and all(
        float(p.grad.abs().sum()) == 0 for p in worker.model.parameters() if p.grad is not None
    )
    assert worker.logprobs(empty).shape == (0, empty["input_ids"].shape[1])


def test_activation_checkpointing_keeps_the_gradients(tiny_qwen2_dir, make_batch):
    """The switch the group applies at `init_distributed` recomputes activations, same maths."""
    from grpo_train.policy.worker import PolicyWorker

    torch.set_num_threads(1)
    loss = LossConfig(reference_policy_kl_penalty=0.0)
    grads = []
    for checkpointing in (False, True):
        cfg = policy_cfg(1).model_copy(update={"dtensor_cfg": DTensorConfig(activation_checkpointing=checkpointing)})
        worker = PolicyWorker(tiny_qwen2_dir, cfg, loss, seed=0)
        worker.init_distributed("127.0.0.1", 0)  # one CPU rank: no process group, only the switch
        assert worker.model.is_gradient_checkpointing == checkpointing
        batch = make_batch(B=8)
        batch["prev_logprobs"] = worker.logprobs(batch)
        worker.train(batch)
        grads.append(worker.gradients())
    for name in grads[0]:
        assert rel_err(grads[1][name], grads[0][name]) <= RTOL, name


def test_rows_split_evenly_and_metrics_reduce_like_the_loss():
    assert split_rows(8, 2) == [slice(0, 4), slice(4, 8)]
    assert split_rows(5, 2) == [slice(0, 2), slice(2, 5)]
    merged = combine_metrics(
        [
            {"loss": 0.25, "ratio_min": 0.9, "ratio_max": 1.1, "grad_norm": 2.0},
            {"loss": 0.5, "ratio_min": 0.8, "ratio_max": 1.3, "grad_norm": 2.0},
        ]
    )
    assert merged == {"loss": 0.75, "ratio_min": 0.8, "ratio_max": 1.3, "grad_norm": 2.0}
    # A rank given no rows reports only the loss (0), grad norm and lr.
    assert combine_metrics([{"loss": 0.0, "grad_norm": 2.0}, {"loss": 0.5, "ratio_min": 0.9, "grad_norm": 2.0}]) == {
        "loss": 0.5,
        "grad_norm": 2.0,
        "ratio_min": 0.9,
    }


def test_bundles_follow_the_cluster_shape():
    assert worker_bundles(ClusterConfig(), 2) == ([{"CPU": 1}] * 2, "PACK")
    assert worker_bundles(ClusterConfig(num_nodes=2), 2) == ([{"CPU": 1}] * 2, "STRICT_SPREAD")
    assert worker_bundles(ClusterConfig(num_nodes=2, gpus_per_node=8), 16) == ([{"GPU": 1, "CPU": 1}] * 16, "PACK")


def test_global_batch_must_split_over_workers():
    with pytest.raises(ValueError, match="num_workers"):
        PolicyConfig(train_global_batch_size=6, train_micro_batch_size=1, num_workers=4)


@pytest.mark.gpu
def test_fsdp2_workers_match_one_gpu_worker(tiny_qwen2_dir, make_batch):
    """GPU-only: FSDP2-sharded ranks (NCCL) give the single-GPU gradient."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    batch = make_batch()
    cluster = ClusterConfig(gpus_per_node=2)
    out = []
    for n in (1, 2):
        group = PolicyGroup(
            tiny_qwen2_dir, policy_cfg(n), LossConfig(reference_policy_kl_penalty=0.05), cluster, seed=0
        )
        b = dict(batch)
        b["prev_logprobs"] = group.logprobs(b)
        b["ref_logprobs"] = group.logprobs(b, reference=True)
        out.append((group.train(b), group.weights()))
        group.close()
    (m1, w1), (m2, w2) = out
    assert abs(m1["loss"] - m2["loss"]) <= 1e-5 * abs(m1["loss"])
    for name in w1:
        assert rel_err(w2[name], w1[name]) <= 1e-5, name


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_every_actor_gets_every_core_with_passive_openmp_waiting(monkeypatch, cores):
    """threads_per_actor: the machine's core count (so a resume on the same machine has the same
    count); idle OpenMP threads sleep instead of spinning while another actor computes."""
    from grpo_train import setup

    monkeypatch.setattr(setup.os, "cpu_count", lambda: cores)
    assert setup.threads_per_actor() == cores
    env = setup.actor_env_vars()
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(cores)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.parametrize(
    ("cores", "cluster", "workers", "on_node", "threads"),
    [
        (16, {}, 1, 1, 16),  # one rank: every core
        (16, {}, 4, 4, 4),  # four CPU ranks on one node share its 16 cores
        (16, {}, 3, 3, 5),  # cores that do not divide: rounded down (never more threads than cores)
        (2, {}, 4, 4, 1),  # more ranks than cores: one thread each, never zero
        (16, {"num_nodes": 2}, 4, 2, 8),  # CPU ranks spread over two nodes: two per node
        (16, {"num_nodes": 2}, 3, 2, 8),  # 3 over 2 nodes: the fuller node has 2
        (16, {"gpus_per_node": 8}, 4, 4, 4),  # GPU ranks pack a node first
        (16, {"gpus_per_node": 2, "num_nodes": 2}, 4, 2, 8),  # 2 GPUs a node: 2 ranks share each node
    ],
)
def test_threads_divide_the_node_among_its_data_parallel_ranks(monkeypatch, cores, cluster, workers, on_node, threads):
    """threads_per_actor(ranks_per_node(...)): cpu_count // (ranks of the group on one node), so
    data-parallel ranks that compute at the same time do not oversubscribe the cores."""
    from grpo_train import setup
    from grpo_train.config.schema import ClusterConfig

    monkeypatch.setattr(setup.os, "cpu_count", lambda: cores)
    assert setup.ranks_per_node(ClusterConfig(**cluster), workers) == on_node
    assert setup.threads_per_actor(setup.ranks_per_node(ClusterConfig(**cluster), workers)) == threads
