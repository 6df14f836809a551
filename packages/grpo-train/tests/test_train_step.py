"""The GRPO step's batch phase: rewards -> batch -> advantages and masks (no Ray, no model).

prepare_batch and add_advantages are the public path the sync and async loops take; the
numbers are hand-computed in the comments (shared/GRPO-MATH.md, docs/algorithms.md).
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_train import train_step
from grpo_train.batch import Rollout
from grpo_train.config import validate_config_dict
from grpo_train.policy.worker import pg_loss_config
from grpo_train.train_step import add_advantages, add_logprobs, prepare_batch

torch.set_num_threads(1)


def rollout(p: int, reward: float, n: int, truncated: bool = False, components: dict | None = None) -> Rollout:
    meta = {"reward_components": components} if components is not None else {}
    return Rollout(
        prompt_index=p,
        prompt_ids=[5, 6],
        response_ids=list(range(7, 7 + n)),
        gen_logprobs=[-0.5] * n,
        text="",
        truncated=truncated,
        reward=reward,
        env_metadata=meta,
    )


def cfg(group: int = 4, prompts: int = 1, **sections):
    grpo = {"num_prompts_per_step": prompts, "num_generations_per_prompt": group} | sections.pop("grpo", {})
    base = {"grpo": grpo, "policy": {"train_global_batch_size": group * prompts, "train_micro_batch_size": 1}}
    return validate_config_dict(base | sections)


def with_logprobs(batch, prev=None, ref=None):
    """prev = gen (on policy) unless given; ref only when given."""
    batch["prev_logprobs"] = batch["gen_logprobs"].clone() if prev is None else prev
    if ref is not None:
        batch["ref_logprobs"] = ref
    return batch


def test_overlong_filtering_keeps_truncated_samples_in_the_baseline():
    c = cfg(grpo={"overlong_filtering": True, "normalize_rewards": False, "use_leave_one_out_baseline": False})
    rollouts = [rollout(0, 1.0, 2), rollout(0, 0.0, 2), rollout(0, 0.0, 4, True), rollout(0, 0.0, 4, True)]
    batch, _ = prepare_batch(c.grpo, c.policy, rollouts, pad_id=0)
    metrics = add_advantages(c.grpo, c.loss_fn, rollouts, with_logprobs(batch))
    # baseline over all four: mean 0.25 -> the kept two get 0.75 and -0.25 (not 0.5 / -0.5)
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(batch["advantages"][:2, 2], torch.tensor([0.75, -0.25]))
    assert metrics["masked_samples"] == 2.0


def test_seq_logprob_error_threshold_masks_sequences_by_their_mean_exp_error():
    c = cfg(
        group=3,
        grpo={"seq_logprob_error_threshold": 2.5, "normalize_rewards": False, "use_leave_one_out_baseline": False},
    )
    rollouts = [rollout(0, 1.0, 2), rollout(0, 0.0, 2), rollout(0, 0.0, 1)]
    batch, _ = prepare_batch(c.grpo, c.policy, rollouts, pad_id=0)
    prev = batch["gen_logprobs"].clone()
    prev[1, 2] += math.log(3)  # row 1: mean(exp(|d|)) = (3 + 1) / 2 = 2.0 <= 2.5, kept
    prev[2, 2] -= math.log(5)  # row 2: 5.0 > 2.5, dropped
    metrics = add_advantages(c.grpo, c.loss_fn, rollouts, with_logprobs(batch, prev))
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 0.0]
    assert metrics["num_masked_seqs_by_logprob_error"] == 1.0
    assert metrics["max_seq_mult_prob_error"] == pytest.approx(5.0)
    # the dropped sample still counts in the baseline: mean 1/3
    torch.testing.assert_close(batch["advantages"][:, 2], torch.tensor([2 / 3, -1 / 3, -1 / 3]))


def test_seq_logprob_error_threshold_below_one_is_refused():
    from grpo_train.config import ConfigError

    with pytest.raises(ConfigError) as info:
        cfg(grpo={"seq_logprob_error_threshold": 0.5})
    assert info.value.key == "grpo.seq_logprob_error_threshold"


def test_kl_in_reward_for_grpo_goes_into_the_advantage_and_out_of_the_loss():
    c = cfg(
        group=2,
        grpo={"adv_estimator": {"name": "grpo", "normalize_rewards": False, "use_leave_one_out_baseline": False}},
        loss_fn={"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k2"},
    )
    rollouts = [rollout(0, 1.0, 2), rollout(0, 0.0, 2)]
    batch, _ = prepare_batch(c.grpo, c.policy, rollouts, pad_id=0)
    ref = batch["gen_logprobs"] - 1.0 * batch["token_mask"]  # ref - prev = -1: k2 = 0.5, beta * k2 = 0.05
    metrics = add_advantages(c.grpo, c.loss_fn, rollouts, with_logprobs(batch, ref=ref))
    torch.testing.assert_close(batch["advantages"][:, 2:4], torch.tensor([[0.45, 0.45], [-0.55, -0.55]]))
    assert metrics["reward_kl_penalty"] == pytest.approx(0.05)
    # the loss runs with beta 0 (the KL is applied once); the reference is still loaded (beta > 0 in loss_fn)
    assert pg_loss_config(c.loss_fn).reference_policy_kl_penalty == 0.0
    assert c.loss_fn.reference_policy_kl_penalty == 0.1
    plain = cfg(group=2)
    assert pg_loss_config(plain.loss_fn).reference_policy_kl_penalty == plain.loss_fn.reference_policy_kl_penalty


def test_gdpo_reads_the_environments_reward_components():
    c = cfg(
        group=2,
        prompts=2,
        grpo={"adv_estimator": {"name": "gdpo", "normalize_rewards": False, "use_leave_one_out_baseline": False}},
    )
    comps = [
        {"format": 1, "correct": 0},
        {"format": 0, "correct": 1},
        {"format": 1, "correct": 1},
        {"format": 1, "correct": 0},
    ]
    rollouts = [rollout(i // 2, 0.0, 1, components=cm) for i, cm in enumerate(comps)]
    batch, _ = prepare_batch(c.grpo, c.policy, rollouts, pad_id=0)
    add_advantages(c.grpo, c.loss_fn, rollouts, with_logprobs(batch))
    # sorted names (correct, format): groups give [-0.5, 0.5, 0.5, -0.5] + [0.5, -0.5, 0, 0] = [0, 0, 0.5, -0.5]
    s = 1 / math.sqrt(0.5 / 3)
    torch.testing.assert_close(batch["advantages"][:, 2], torch.tensor([0.0, 0.0, 0.5 * s, -0.5 * s]))
    rollouts[3].env_metadata = {"reward_components": {"format": 1}}
    with pytest.raises(ValueError, match="sample 3: reward_components"):
        add_advantages(
            c.grpo, c.loss_fn, rollouts, with_logprobs(prepare_batch(c.grpo, c.policy, rollouts, pad_id=0)[0])
        )


def test_kl_in_reward_refuses_the_loss_only_kl_options():
    from grpo_train.config import ConfigError

    with pytest.raises(ConfigError) as info:
        cfg(group=2, loss_fn={"use_kl_in_reward": True, "use_on_policy_kl_approximation": True})
    assert info.value.key == "loss_fn.use_kl_in_reward"


class RecordingPolicy:
    """A policy group stand-in: records each call and answers at once."""

    def __init__(self, rows: int, cols: int):
        self.calls: list[str] = []
        self.prev, self.ref = torch.full((rows, cols), -1.0), torch.full((rows, cols), -2.0)
        outer = self

        class Method:
            def __init__(self, name, answer):
                self.name, self.answer = name, answer

            def __call__(self, batch, **kwargs):
                outer.calls.append(self.name + ("(reference)" if kwargs.get("reference") else ""))
                return self.answer(kwargs)

        self.logprobs = Method("logprobs", lambda kw: self.ref if kw.get("reference") else self.prev)
        self.logprobs_and_reference = Method("logprobs_and_reference", lambda kw: torch.stack([self.prev, self.ref]))


@pytest.mark.parametrize("beta, calls", [(0.01, ["logprobs_and_reference"]), (0.0, ["logprobs"])])
def test_add_logprobs_asks_for_prev_and_ref_in_one_call(beta, calls):
    policy = RecordingPolicy(3, 4)
    batch = {"input_ids": torch.zeros(3, 4, dtype=torch.long)}
    # the logprob-error mask reads prev before training: the separate pass
    c = cfg(loss_fn={"reference_policy_kl_penalty": beta}, grpo={"seq_logprob_error_threshold": 2.0})
    add_logprobs(train_step.logprob_plan(c), policy, batch)
    assert policy.calls == calls
    assert torch.equal(batch["prev_logprobs"], policy.prev)
    if beta:
        assert torch.equal(batch["ref_logprobs"], policy.ref)
        assert batch["prev_logprobs"].untyped_storage().nbytes() == 3 * 4 * 4  # its own storage, not the pair's
    else:
        assert "ref_logprobs" not in batch


def test_process_age_counts_from_the_process_start():
    """A child sleeps 1 s before it imports and asks: its age lies between the sleep and the
    parent's stopwatch around the whole child."""
    import subprocess
    import sys
    import time

    code = "import time; time.sleep(1.0); from grpo_train.step import process_age_s; print(process_age_s())"
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    elapsed = time.perf_counter() - start
    assert 1.0 <= float(out) <= elapsed


@pytest.mark.parametrize("beta", [0.01, 0.0])
def test_add_logprobs_leaves_prev_and_ref_to_the_train_call_where_prev_may_be_reused(beta):
    """Sync GRPO, one worker, nothing reading prev or ref before training: no logprob call at all
    (the policy's train call takes prev from its forward, or runs the pass itself, and runs the
    reference forward beside training or first: test_policy_worker)."""
    policy = RecordingPolicy(3, 4)
    batch = {"input_ids": torch.zeros(3, 4, dtype=torch.long)}
    add_logprobs(train_step.logprob_plan(cfg(loss_fn={"reference_policy_kl_penalty": beta})), policy, batch)
    assert policy.calls == []
    assert "prev_logprobs" not in batch and "ref_logprobs" not in batch


def test_prev_reuse_only_where_nothing_needs_its_own_pass():
    base = cfg()
    assert train_step.reuses_prev_logprobs(base)
    refused = {
        "async": base.model_copy(
            update={
                "grpo": base.grpo.model_copy(
                    update={"async_grpo": base.grpo.async_grpo.model_copy(update={"enabled": True})}
                )
            }
        ),
        "ppo": cfg(ppo={}),
        "kl in reward": cfg(loss_fn={"use_kl_in_reward": True, "reference_policy_kl_penalty": 0.01}),
        "logprob-error mask": cfg(grpo={"seq_logprob_error_threshold": 2.0}),
        "two workers": base.model_copy(update={"policy": base.policy.model_copy(update={"num_workers": 2})}),
    }
    for why, c in refused.items():
        assert not train_step.reuses_prev_logprobs(c), why


def test_advantages_without_prev_leave_the_logprob_error_metric_to_the_train_call():
    c = cfg(group=2)
    rollouts = [rollout(0, 1.0, 3), rollout(0, 0.0, 3)]
    batch, _ = prepare_batch(c.grpo, c.policy, rollouts, pad_id=0)
    metrics = add_advantages(c.grpo, c.loss_fn, rollouts, batch)
    assert "max_seq_mult_prob_error" not in metrics
    assert torch.equal(batch["advantages"][:, 2:] != 0, batch["token_mask"][:, 2:] > 0)


def test_invalid_tool_call_advantage_replaces_the_advantage_of_the_bad_turns_tokens():
    """NeMo RL's grpo.invalid_tool_call_advantage: the tokens of a turn with invalid tool calls take
    the value in place of the estimator's advantage, after clipping; the sample's other turns, its
    observation tokens and the other samples keep theirs."""
    c = cfg(
        group=2,
        grpo={
            "max_rollout_turns": 3,
            "invalid_tool_call_advantage": -5.0,
            "normalize_rewards": False,
            "use_leave_one_out_baseline": False,
            "advantage_clip_low": -1.0,
        },
    )
    # Row 0: turn 1 (2 tokens, its calls invalid), an observation token, turn 2 (1 token). Row 1 marks
    # only an observation token, which is not trained on either way.
    rows = [
        Rollout(
            prompt_index=0,
            prompt_ids=[5, 6],
            response_ids=[7, 8, 9, 10],
            gen_logprobs=[-0.5, -0.5, 0.0, -0.5],
            text="",
            truncated=False,
            reward=r,
            response_mask=[1, 1, 0, 1],
            turns=2,
            invalid_call_mask=m,
        )
        for r, m in ((1.0, [1, 1, 0, 0]), (0.0, [0, 0, 1, 0]))
    ]
    batch, _ = prepare_batch(c.grpo, c.policy, rows, pad_id=0)
    metrics = add_advantages(c.grpo, c.loss_fn, rows, with_logprobs(batch))
    # Rewards 1 and 0, mean 0.5: advantages +0.5 and -0.5 on the trained tokens (positions 2, 3, 5).
    torch.testing.assert_close(
        batch["advantages"], torch.tensor([[0.0, 0.0, -5.0, -5.0, 0.0, 0.5], [0.0, 0.0, -0.5, -0.5, 0.0, -0.5]])
    )
    assert metrics["invalid_tool_call_tokens"] == 2.0
    assert metrics["advantage_abs_mean"] == pytest.approx((5 + 5 + 0.5 + 0.5 * 3) / 6)
    # Off (the default): the estimator's advantages are untouched.
    plain = cfg(group=2, grpo={"max_rollout_turns": 3, "normalize_rewards": False, "use_leave_one_out_baseline": False})
    batch, _ = prepare_batch(plain.grpo, plain.policy, rows, pad_id=0)
    assert "invalid_tool_call_tokens" not in add_advantages(plain.grpo, plain.loss_fn, rows, with_logprobs(batch))
    assert batch["advantages"][0].tolist() == [0.0, 0.0, 0.5, 0.5, 0.0, 0.5]


@pytest.mark.parametrize(
    "sections, words",
    [
        ({"grpo": {"invalid_tool_call_advantage": -1.0}}, "needs grpo.max_rollout_turns > 1"),
        ({"grpo": {"invalid_tool_call_advantage": -1.0, "max_rollout_turns": 2}, "ppo": {}}, "PPO's come from GAE"),
    ],
)
def test_invalid_tool_call_advantage_is_refused_where_it_would_do_nothing(sections, words):
    from grpo_train.config import ConfigError

    with pytest.raises(ConfigError) as info:
        cfg(group=2, **sections)
    assert words in str(info.value) and "grpo.invalid_tool_call_advantage" in str(info.value)


def test_refit_check_scores_on_both_sides_at_the_same_time():
    """The trainer and the engine score the probe at the same time: each scorer waits at a
    two-party barrier inside its call, which only passes when both calls are in flight at once
    (one after the other, the barrier times out). The gate then sees the two sides' numbers
    (hand-computed: |d| = 0.25 on token 1 of sequence 0, above fp32's 1e-3)."""
    import threading

    barrier = threading.Barrier(2, timeout=10)
    answers = {"trainer": [[-1.0, -0.5]], "engine": [[-1.0, -0.75]]}
    seen: list[int] = []

    class Scorer:
        def __init__(self, name):
            self.name = name

        def score(self, sequences, prompt_lens):
            seen.append(len(sequences))
            barrier.wait()
            return answers[self.name]

    probe = [rollout(0, 1.0, 2), rollout(0, 0.0, 0)]  # the empty response is not scored
    config = cfg(group=2, grpo={"refit_check": {"enabled": True}})
    from grpo_train.refit.check import RefitMismatchError

    with pytest.raises(RefitMismatchError, match=r"sequence 0, token 1 .* \|diff\| 0\.25"):
        train_step.check_refit(config, Scorer("trainer"), Scorer("engine"), probe)
    assert seen == [1, 1]
    answers["engine"] = [[-1.0, -0.5]]
    assert (
        train_step.check_refit(config, Scorer("trainer"), Scorer("engine"), probe)["refit/max_abs_logprob_diff"] == 0.0
    )
