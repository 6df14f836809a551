"""The shipped demo config takes the on-policy shortcut it was tuned for (issue 23)."""

from __future__ import annotations

import torch

from grpo_cli.configs import CONFIG_DIR


def test_demo_reuses_prev_logprobs_from_the_training_forward():
    """grpo_arith_tiny.yaml: the driver leaves prev to the train call (train_step.reuses_prev_logprobs)
    and the worker takes it from the training forward (PolicyWorker.reuses_prev: the logprob and
    train planners cut the same micro-batches of a full step's ragged batch), so the demo runs one
    forward fewer per step; the bitwise equality of that shortcut is tested in grpo-train
    (test_policy_worker.test_reused_prev_logprobs_are_bitwise_the_separate_pass)."""
    from grpo_train.config import load_config
    from grpo_train.policy.worker import PolicyWorker
    from grpo_train.setup import resolve_model_path
    from grpo_train.train_step import reuses_prev_logprobs

    cfg, _ = load_config(CONFIG_DIR / "grpo_arith_tiny.yaml")
    assert reuses_prev_logprobs(cfg)
    policy = cfg.policy
    rows = policy.train_global_batch_size
    assert rows == cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt  # one optimizer step
    worker = PolicyWorker(resolve_model_path(policy.model_name), policy, cfg.loss_fn, seed=0)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, policy.max_total_sequence_length + 1, (rows,), generator=g)
    width = int(lengths.max())
    batch = {
        "input_ids": torch.randint(0, 32, (rows, width), generator=g),
        "attention_mask": (torch.arange(width)[None, :] < lengths[:, None]).long(),
    }
    assert worker.reuses_prev(batch, rows)
