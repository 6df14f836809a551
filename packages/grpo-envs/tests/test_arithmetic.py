"""Arithmetic env: exact integer answers."""

import pytest

import grpo_envs


def _logs(responses):
    return [[{"role": "user", "content": "12+34="}, {"role": "assistant", "content": r}] for r in responses]


def test_rewards_and_accuracy():
    env = grpo_envs.make("arithmetic")
    responses = ["46", " 46 </s>", "46<|endoftext|><|endoftext|>", "047", "45", "garbage", "", "-46", "4 6"]
    out = env.step(_logs(responses), [{"ground_truth": "46"}] * len(responses))
    assert out.rewards == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert out.metrics["accuracy"] == pytest.approx(3 / 9)
    assert out.metrics["no_answer"] == 2.0
    assert out.terminateds == [True] * 9
    assert out.metadata[1] == {"answer": "46", "ground_truth": "46", "correct": True}


def test_negative_and_huge_integers():
    env = grpo_envs.make("arithmetic")
    huge = "9" * 100_000
    out = env.step(
        _logs(["-5", huge, huge + "1"]), [{"ground_truth": "-5"}, {"ground_truth": huge}, {"ground_truth": huge}]
    )
    assert out.rewards == [1.0, 1.0, 0.0]
    assert len(out.metadata[1]["answer"]) < 300  # metadata is clipped


def test_missing_assistant_message_scores_zero():
    env = grpo_envs.make("arithmetic")
    out = env.step([[{"role": "user", "content": "1+1="}]], [{"ground_truth": "2"}])
    assert out.rewards == [0.0]


def test_bad_ground_truth_is_a_clear_error():
    env = grpo_envs.make("arithmetic")
    with pytest.raises(ValueError, match="sample 0: ground_truth must be an integer string, got '4.5'"):
        env.step(_logs(["4"]), [{"ground_truth": "4.5"}])
