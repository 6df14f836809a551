"""Math env: a table of equivalence cases checked against hand-decided truth, timeouts, metrics."""

import os
import time

import pytest

from grpo_envs.math_env import MathEnv

# (response, ground truth, expected reward). The expectation is decided by hand: is the
# response's final answer mathematically equal to the gold answer?
CASES = [
    # plain numbers
    ("The sum is \\boxed{46}.", "46", 1.0),
    ("\\boxed{47}", "46", 0.0),
    ("\\boxed{-7}", "-7", 1.0),
    ("\\boxed{7}", "-7", 0.0),
    ("\\boxed{0.5}", "0.5", 1.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1000000}", "10^6", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{12}", "\\boxed{12}", 1.0),
    # fractions
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{1/2}", "\\frac12", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),
    ("\\boxed{\\frac{3}{2}}", "\\frac{2}{3}", 0.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    # LaTeX expressions
    ("\\boxed{2\\pi}", "2\\pi", 1.0),
    ("\\boxed{\\pi \\cdot 2}", "2\\pi", 1.0),
    ("\\boxed{6.28}", "2\\pi", 0.0),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{3}", 0.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
    ("\\boxed{2^{10}}", "1024", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{x=5}", "5", 1.0),
    ("\\boxed{\\sin(\\pi/6)}", "\\frac{1}{2}", 1.0),
    # sets and intervals
    ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", 0.0),
    ("\\boxed{(0,1]}", "(0,1]", 1.0),
    ("\\boxed{[0,1]}", "(0,1]", 0.0),
    ("\\boxed{(-\\infty, 2)}", "(-\\infty,2)", 1.0),
    ("\\boxed{2, 3}", "3, 2", 1.0),
    # DAPO style "Answer:" lines and extraction rules
    ("Some work.\nAnswer: 3/4", "\\frac{3}{4}", 1.0),
    ("Answer: $\\sqrt{2}$.", "\\sqrt2", 1.0),
    ("answer: 12\nmore text after", "12", 1.0),
    ("First \\boxed{1}, then corrected: \\boxed{2}", "2", 1.0),
    ("First \\boxed{2}, then corrected: \\boxed{1}", "2", 0.0),
    ("\\boxed{\\text{(A)}}", "A", 1.0),
    # empty, garbage, hostile and huge responses
    ("", "5", 0.0),
    ("I don't know", "5", 0.0),
    ("5", "5", 0.0),  # no \boxed{} and no Answer: line: nothing to extract
    ("\\boxed{}", "5", 0.0),
    ("\\boxed{5", "5", 0.0),
    ("}}}{{{\\boxed{{{", "5", 0.0),
    ("\\boxed{\\frac{1}{0}}", "5", 0.0),
    ("\\boxed{" + "9" * 5000 + "}", "5", 0.0),
    ("x" * 2_000_000 + "\\boxed{5}", "5", 1.0),
    ("\\boxed{3}" * 50_000, "3", 1.0),
]


@pytest.fixture(scope="module")
def env():
    env = MathEnv(timeout_s=2.0)
    yield env
    env.close()


def _logs(responses):
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": r}] for r in responses]


def test_equivalence_table(env):
    assert len(CASES) >= 40
    out = env.step(_logs([r for r, _, _ in CASES]), [{"ground_truth": g} for _, g, _ in CASES])
    wrong = [
        (r[:60], g, expected, got, meta["status"])
        for (r, g, expected), got, meta in zip(CASES, out.rewards, out.metadata)
        if got != expected
    ]
    assert not wrong
    assert out.terminateds == [True] * len(CASES)
    assert out.observations == [None] * len(CASES)
    assert out.metrics["accuracy"] == pytest.approx(sum(e for _, _, e in CASES) / len(CASES))


def test_metrics_count_parse_failures_and_timeouts(env):
    responses = ["\\boxed{46}", "no answer here", "\\boxed{10^{10^{10}}}", "\\boxed{" + "1" * 2000 + "}"]
    t0 = time.monotonic()
    out = env.step(_logs(responses), [{"ground_truth": "46"}] * 4)
    elapsed = time.monotonic() - t0
    assert out.rewards == [1.0, 0.0, 0.0, 0.0]
    assert [m["status"] for m in out.metadata] == ["correct", "parse_failure", "timeout", "parse_failure"]
    assert out.metrics["timeouts"] == 1.0
    assert out.metrics["parse_failures"] == 2.0
    assert out.metrics["accuracy"] == 0.25
    # The deadline held (2 s) and the spare worker took over without a cold start.
    assert elapsed < 2.0 + 1.5
    # The verifier is healthy after the timeout.
    again = env.step(_logs(["\\boxed{\\frac{1}{2}}"]), [{"ground_truth": "0.5"}])
    assert again.rewards == [1.0]


def test_hostile_answers_in_a_row_cost_their_timeout_each(env):
    """Four answers that each blow the 2 s deadline: each costs ~2 s (a forked, warm spare takes
    over at once), never a cold sympy start (10+ s on this machine) on top."""
    for _ in range(4):
        t0 = time.monotonic()
        out = env.step(_logs(["\\boxed{9^{9^{9^{9^{9}}}}}"]), [{"ground_truth": "1"}])
        assert out.metadata[0]["status"] == "timeout"
        assert time.monotonic() - t0 < 2.0 + 0.7
    assert env.step(_logs(["\\boxed{2}"]), [{"ground_truth": "2"}]).rewards == [1.0]


def test_worker_crash_is_contained(env):
    os.kill(env.verifier._workers[0].pid, 9)  # simulate a segfault of math-verify mid-run
    out = env.step(_logs(["\\boxed{1}", "\\boxed{2}"]), [{"ground_truth": "1"}, {"ground_truth": "2"}])
    assert [m["status"] for m in out.metadata] == ["error", "correct"]
    assert out.rewards == [0.0, 1.0]
    assert out.metrics["errors"] == 1.0


def test_missing_ground_truth_is_a_clear_error(env):
    with pytest.raises(KeyError, match="sample 0: env_info has no 'ground_truth'"):
        env.step(_logs(["\\boxed{1}"]), [{}])


def test_works_from_a_thread(env):
    """math-verify's signal.alarm timeouts fail in threads; ours do not use signals."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        out = pool.submit(env.step, _logs(["\\boxed{2}"]), [{"ground_truth": "2"}]).result()
    assert out.rewards == [1.0]


def test_bad_config():
    with pytest.raises(ValueError, match="must be positive"):
        MathEnv(timeout_s=0)


def test_math_on_ray_workers(ray_session):
    from grpo_envs.pool import EnvPool

    cases = CASES[:20]
    with EnvPool("math", {"timeout_s": 2.0}, num_workers=2) as pool:
        out = pool.step(_logs([r for r, _, _ in cases]), [{"ground_truth": g} for _, g, _ in cases])
    assert out.rewards == [e for _, _, e in cases]
    assert out.metrics["accuracy"] == pytest.approx(sum(e for _, _, e in cases) / len(cases))
    assert out.metrics["env/actor_restarts"] == 0.0
