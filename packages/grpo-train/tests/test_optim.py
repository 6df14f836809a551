"""The restored optimizer takes this run's config kwargs (policy/optim.apply_optimizer_config)."""

from __future__ import annotations

import pytest
import torch

from grpo_train.config.schema import OptimizerConfig, SchedulerEntry
from grpo_train.policy.optim import apply_optimizer_config, build_optimizer, build_scheduler

WARMUP_THEN_COSINE = [
    SchedulerEntry(name="torch.optim.lr_scheduler.LinearLR", kwargs={"start_factor": 0.1, "total_iters": 3}),
    SchedulerEntry(name="torch.optim.lr_scheduler.CosineAnnealingLR", kwargs={"T_max": 10}),
    SchedulerEntry(milestones=[3]),
]


def build(lr: float, weight_decay: float = 0.01):
    params = [torch.nn.Parameter(torch.ones(3))]
    cfg = OptimizerConfig(name="torch.optim.AdamW", kwargs={"lr": lr, "weight_decay": weight_decay})
    optimizer = build_optimizer(params, cfg)
    return optimizer, build_scheduler(optimizer, WARMUP_THEN_COSINE), cfg


def run(optimizer, scheduler, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        optimizer.param_groups[0]["params"][0].grad = torch.full((3,), 0.5)
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("resume_at", [2, 5])  # inside the warm-up, inside the cosine
def test_a_new_lr_follows_the_schedule_a_run_at_that_lr_would_have(resume_at):
    old_opt, old_sched, _ = build(3e-5)
    run(old_opt, old_sched, resume_at)
    new_opt, new_sched, new_cfg = build(1e-4, weight_decay=0.1)
    new_opt.load_state_dict(old_opt.state_dict())
    new_sched.load_state_dict(old_sched.state_dict())
    assert new_opt.param_groups[0]["lr"] < 3e-5  # loading alone keeps the old scale: the bug this fixes
    apply_optimizer_config(new_opt, new_sched, new_cfg)
    # The independent expectation: a run that used lr=1e-4 from the start, at the same step.
    ref_opt, ref_sched, _ = build(1e-4)
    run(ref_opt, ref_sched, resume_at)
    assert new_opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-9)
    assert new_opt.param_groups[0]["weight_decay"] == 0.1
    assert run(new_opt, new_sched, 6) == pytest.approx(run(ref_opt, ref_sched, 6), rel=1e-9)


def test_unchanged_config_leaves_the_restored_state_untouched():
    opt, sched, cfg = build(3e-5)
    run(opt, sched, 4)
    groups = [dict(g) for g in opt.param_groups]
    apply_optimizer_config(opt, sched, cfg)
    assert [dict(g) for g in opt.param_groups] == groups
