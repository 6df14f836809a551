"""Number guessing: a full multi-turn episode played by a scripted bisecting player."""

import pytest

import grpo_envs
from grpo_envs.number_guess import _less


def _play(env, target, guesses_fn, max_turns=None):
    log = [{"role": "user", "content": "Guess my number between 1 and 100."}]
    info = {"target": target} if max_turns is None else {"target": target, "max_turns": max_turns}
    history = []
    while True:
        log.append({"role": "assistant", "content": guesses_fn(log)})
        out = env.step([log], [info])
        history.append((out.rewards[0], out.terminateds[0], out.observations[0]))
        if out.terminateds[0]:
            return history
        log.append(out.observations[0])


def test_bisecting_player_wins():
    env = grpo_envs.make("number_guess", max_turns=8)
    lo, hi = 1, 100

    def bisect(log):
        nonlocal lo, hi
        last = log[-1]
        if last["role"] == "environment":
            guess = (lo + hi) // 2
            if last["content"] == "higher":
                lo = guess + 1
            else:
                hi = guess - 1
        return f"{(lo + hi) // 2}</s>"

    history = _play(env, 37, bisect)
    # hand-traced: 50 lower, 25 higher, 37 correct
    assert [h[2]["content"] if h[2] else None for h in history] == ["lower", "higher", None]
    assert [h[0] for h in history] == [0.0, 0.0, 1.0]
    assert history[-1][1] is True


def test_out_of_turns_and_garbage():
    env = grpo_envs.make("number_guess")
    history = _play(env, 5, lambda log: "no idea", max_turns=3)
    assert len(history) == 3
    assert [h[0] for h in history] == [0.0, 0.0, 0.0]
    assert history[0][2]["content"].startswith("no number found")
    assert history[-1] == (0.0, True, None)


def test_metrics_over_a_batch():
    env = grpo_envs.make("number_guess", max_turns=2)
    logs = [[{"role": "user", "content": "go"}, {"role": "assistant", "content": g}] for g in ["5", "9"]]
    logs[1] = logs[1] + [{"role": "environment", "content": "lower"}, {"role": "assistant", "content": "8"}]
    out = env.step(logs, [{"target": 5}, {"target": 3}])
    assert out.rewards == [1.0, 0.0]
    assert out.terminateds == [True, True]
    assert out.metrics == {"solved": 1.0, "failed": 1.0, "mean_turn": 1.5}


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("1", "2", True),
        ("2", "1", False),
        ("-5", "3", True),
        ("-5", "-7", False),
        ("99", "100", True),
        ("3", "3", False),
    ],
)
def test_less(a, b, expected):
    assert _less(a, b) is expected


def test_bad_target():
    with pytest.raises(ValueError, match="'target' must be an integer"):
        grpo_envs.make("number_guess").step([[]], [{"target": "abc"}])


def test_ground_truth_stands_in_for_target():
    from grpo_envs import make

    env = make("number_guess", max_turns=3)
    log = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "40"}]
    out = env.step([log], [{"ground_truth": "42"}])
    assert out.rewards == [0.0] and out.terminateds == [False]
    assert out.observations[0] == {"role": "environment", "content": "higher"}
    out = env.step([log[:1] + [{"role": "assistant", "content": "42"}]], [{"ground_truth": "42"}])
    assert out.rewards == [1.0] and out.terminateds == [True]
