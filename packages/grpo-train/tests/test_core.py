"""policy/core.py: the worker core both workers train through, on a one-weight model with hand-computed steps."""

from __future__ import annotations

import pytest
import torch

from grpo_train.config.schema import ValueConfig
from grpo_train.errors import NonFiniteLossError
from grpo_train.policy import microbatch
from grpo_train.policy.core import WorkerCore, merge_metrics
from grpo_train.policy.worker import PolicyWorker
from grpo_train.ppo.value_worker import ValueWorker


class OneWeight(WorkerCore):
    """loss of a micro-batch = w * sum(x over its rows' tokens); rows of 2 per micro-batch."""

    metric_prefix, step_name = "toy_", "toy"
    max_metrics = ("toy_peak",)

    def __init__(self, w: float):
        super().__init__(
            ValueConfig(max_grad_norm=None, optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.1}}),
            seed=0,
            rank=0,
            world_size=1,
            num_threads=None,
        )
        self.model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.constant_(self.model.weight, w)
        self._build_optimizer(self.dtype)

    def _planner(self, purpose):
        return microbatch.PaddedRows(2)

    def _microbatch_loss(self, batch, mb, global_tokens, global_seqs):
        x = microbatch.rows_of(batch, mb.rows, mb.width, torch.device("cpu"))["x"]
        loss = self.model.weight.sum() * x.sum()
        return loss, {"toy_loss": loss.detach(), "toy_peak": x.max()}


def batch_of(x: list[list[float]]) -> dict[str, torch.Tensor]:
    t = torch.tensor(x)
    return {
        "input_ids": torch.zeros_like(t, dtype=torch.long),
        "attention_mask": torch.ones_like(t, dtype=torch.long),
        "x": t,
    }


def test_merge_metrics_sums_mins_and_maxes():
    sums = {"a": 1.0, "lo": 2.0, "hi": 2.0}
    merge_metrics(sums, {"a": torch.tensor(0.5), "lo": 3.0, "hi": 3.0, "b": 4}, mins=("lo",), maxes=("hi",))
    merge_metrics(sums, {"lo": 1.0, "hi": -1.0}, mins=("lo",), maxes=("hi",))
    assert sums == {"a": 1.5, "lo": 1.0, "hi": 3.0, "b": 4.0}


def test_one_optimizer_step_over_micro_batches_by_hand():
    # rows [1, 2], [3, 4] | [5, 6]: two micro-batches; w = 2 -> losses 2*10 and 2*11, gradient 21.
    worker = OneWeight(2.0)
    metrics = worker._optimizer_step(batch_of([[1, 2], [3, 4], [5, 6]]), 1.0, 1.0)
    assert metrics == {"toy_loss": 42.0, "toy_peak": 6.0, "toy_grad_norm": 21.0, "toy_lr": 0.1}
    assert float(worker.model.weight.detach()) == pytest.approx(2.0 - 0.1 * 21.0)
    assert worker.gradients() == {"weight": torch.tensor([[21.0]])}


def test_a_non_finite_step_is_skipped_and_named():
    worker = OneWeight(2.0)
    with pytest.raises(NonFiniteLossError, match="non-finite toy step: loss=inf"):
        worker._optimizer_step(batch_of([[1, float("inf")]]), 1.0, 1.0)
    assert float(worker.model.weight.detach()) == 2.0 and worker.gradients() == {}


def test_each_worker_keeps_only_its_own_part():
    """The step, gradient reduction, state files and process group are the core's, in both workers."""
    shared = (
        "_optimizer_step",
        "_apply_gradients",
        "_reduce_gradients",
        "_forward_rows",
        "_plan",
        "_dummy",
        "_save_states",
        "_restore_states",
        "_save_masters",
        "_save_adapters",
        "gradients",
        "master_weights",
        "ping",
        "whereabouts",
        "free_address",
        "_join_process_group",
    )
    for worker in (PolicyWorker, ValueWorker):
        assert issubclass(worker, WorkerCore)
        assert [name for name in shared if name in vars(worker)] == [], worker
        assert "_microbatch_loss" in vars(worker) and "_planner" in vars(worker)
