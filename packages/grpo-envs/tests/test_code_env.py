"""Code env: test formats, rewards, and every hostile program scored 0 under the right metric."""

import os
import time

import pytest

import grpo_envs
from grpo_envs.code_env import parse_tests, values_equal
from grpo_envs.sandbox import runner

LIMITS = {"cpu_time_s": 1, "wall_time_s": 4, "memory_mb": 256, "max_processes": 8}
ADD_TESTS = {
    "tests": [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "10 -4\n", "output": "6"},
        {"input": "0 0", "output": "0\n\n"},
    ]
}


@pytest.fixture(scope="module")
def env():
    return grpo_envs.make("code", limits=LIMITS)


def _logs(responses):
    return [[{"role": "user", "content": "Write a program."}, {"role": "assistant", "content": r}] for r in responses]


def _fenced(code):
    return f"Here is my solution:\n```python\n{code}\n```\nIt reads two numbers."


def test_stdin_stdout_solutions(env):
    right = _fenced("a, b = map(int, input().split())\nprint(a + b)")
    off_by_one_on_zero = _fenced("a, b = map(int, input().split())\nprint(a + b if a else 1)")
    unfenced = "a, b = map(int, input().split())\nprint(a + b)"
    out = env.step(_logs([right, off_by_one_on_zero, unfenced, ""]), [ADD_TESTS] * 4)
    assert out.rewards == [1.0, pytest.approx(2 / 3), 1.0, 0.0]
    assert [m["status"] for m in out.metadata] == ["passed", "wrong_answer", "passed", "no_code"]
    assert out.metrics["pass_rate"] == pytest.approx((1 + 2 / 3 + 1 + 0) / 4)
    assert out.metrics["accuracy"] == 0.5
    assert out.metrics["wrong_answers"] == 1.0
    assert out.metrics["no_code"] == 1.0
    assert out.metrics["tests_run"] == 9.0


def test_function_call_solutions(env):
    info = {
        "fn_name": "solve",
        "tests": [
            {"args": [[3, 1, 2]], "expected": [1, 2, 3]},
            {"args": [[]], "expected": []},
            {"args": [[2.5, 1]], "kwargs": {}, "expected": [1, 2.5000000001]},
        ],
    }
    plain = _fenced("def solve(xs):\n    return sorted(xs)")
    leetcode = _fenced("class Solution:\n    def solve(self, xs):\n        return tuple(sorted(xs))")
    wrong = _fenced("def solve(xs):\n    return xs")
    missing = _fenced("def other(xs):\n    return xs")
    out = env.step(_logs([plain, leetcode, wrong, missing]), [info] * 4)
    assert out.rewards == [1.0, 1.0, pytest.approx(1 / 3), 0.0]
    assert out.metadata[3]["status"] == "runtime_error" and "defines no function 'solve'" in out.metadata[3]["error"]


def test_apps_format(env):
    stdin_row = {"input_output": '{"inputs": ["2\\n", "5\\n"], "outputs": ["4\\n", "25\\n"]}'}
    call_row = {"input_output": {"inputs": [[2, 3], [0, 0]], "outputs": [[5], [0]], "fn_name": "add"}}
    out = env.step(
        _logs([_fenced("n = int(input())\nprint(n * n)"), _fenced("def add(a, b):\n    return a + b")]),
        [stdin_row, call_row],
    )
    assert out.rewards == [1.0, 1.0]


def test_all_or_nothing_stops_early():
    env = grpo_envs.make("code", all_or_nothing=True, limits=LIMITS)
    half = _fenced("a, b = map(int, input().split())\nprint(a + b if b > 0 else -1)")
    out = env.step(_logs([half]), [ADD_TESTS])
    assert out.rewards == [0.0]
    assert out.metadata[0]["tests"] == ["passed", "wrong_answer"]  # the third test was skipped


HOSTILE = [
    ("infinite loop", "while True:\n    pass", "timeouts"),
    ("fork bomb", "import os\nwhile True:\n    os.fork()", "violations"),
    ("memory bomb", "x = bytearray(2 ** 34)", "memory_errors"),
    ("write outside", "open('/grpo-code-env-pwned.txt', 'w').write('x')", "runtime_errors"),  # read-only root
    ("read a file", "print(open('/etc/passwd').read())", "runtime_errors"),  # not in the jail
    ("socket", "import socket\nsocket.create_connection(('127.0.0.1', 22))", "violations"),
    ("print 100 MB", "import sys\nsys.stdout.write('1' * 100_000_000)", "output_limits"),
    ("kill the parent", f"import os\nos.kill({os.getpid()}, 9)", "violations"),
    ("deep recursion", "def f(n):\n    return f(n + 1)\nf(0)", "runtime_errors"),
    ("exit code", "import sys\nprint(3)\nsys.exit(1)", "runtime_errors"),
]


@pytest.mark.parametrize(("name", "program", "metric"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_programs_score_zero(env, name, program, metric):
    out = env.step(_logs([_fenced(program)]), [{"tests": [{"input": "1 2\n", "output": "3\n"}]}])
    assert out.rewards == [0.0]
    assert out.metrics[metric] == 1.0, (out.metadata[0], out.metrics)
    others = {k: v for k, v in out.metrics.items() if k.endswith("s") and k not in (metric, "tests_run", "pass_rate")}
    assert all(v == 0.0 for v in others.values()), others
    assert not os.path.exists("/grpo-code-env-pwned.txt")


def test_hostile_batch_leaves_the_env_working(env):
    programs = [h[1] for h in HOSTILE] + ["print(3)"]
    out = env.step(_logs([_fenced(p) for p in programs]), [{"tests": [{"output": "3"}]}] * len(programs))
    assert out.rewards == [0.0] * len(HOSTILE) + [1.0]
    assert out.metrics["violations"] == 3.0


def test_parallel_runs_match_sequential():
    programs = [_fenced("a, b = map(int, input().split())\nprint(a + b)"), _fenced("print(0)"), "while True: pass"]
    infos = [ADD_TESTS, ADD_TESTS, {"tests": [{"input": "1 2", "output": "3"}]}]
    seq = grpo_envs.make("code", limits=LIMITS).step(_logs(programs), infos)
    par = grpo_envs.make("code", limits=LIMITS, max_parallel=3).step(_logs(programs), infos)
    assert par.rewards == seq.rewards == [1.0, pytest.approx(1 / 3), 0.0]


def test_bad_tests_are_clear_errors():
    with pytest.raises(ValueError, match="sample 2: env_info needs 'tests' or 'input_output'"):
        parse_tests({"ground_truth": "3"}, 2)
    with pytest.raises(ValueError, match="test 0: a function-call test needs 'expected'"):
        parse_tests({"tests": [{"fn_name": "f", "args": []}]})
    with pytest.raises(ValueError, match="equally long"):
        parse_tests({"input_output": {"inputs": ["1"], "outputs": []}})
    with pytest.raises(TypeError, match="unknown limits keys \\['cpu'\\]"):
        grpo_envs.make("code", limits={"cpu": 1})


def test_refuses_to_start_without_the_required_isolation(monkeypatch):
    monkeypatch.setattr(
        runner, "_modes", {(False,): runner._Mode(False, {"rlimits": True, "why": "no user namespaces"})}
    )
    with pytest.raises(
        ValueError,
        match="code env: required isolation not available here: mountns, pidns, netns, "
        "seccomp \\(no user namespaces\\); isolation.require",
    ):
        grpo_envs.make("code", limits=LIMITS)
    env = grpo_envs.make("code", limits=LIMITS, isolation={"require": []})  # said explicitly: trusted code only
    assert env.step(_logs([_fenced("print(3)")]), [{"tests": [{"output": "3"}]}]).rewards == [1.0]


def test_response_budget_spans_all_tests():
    """Three sleepy tests of 1.5 s each against a 2 s budget: the second is cut at the budget's
    end, the third never runs; the response costs ~2 s, not 3 x 4 s."""
    env = grpo_envs.make("code", limits=LIMITS, response_time_s=2.0)
    t0 = time.monotonic()
    out = env.step(_logs([_fenced("import time\ntime.sleep(1.5)\nprint(3)")]), [{"tests": [{"output": "3"}] * 3}])
    elapsed = time.monotonic() - t0
    assert out.metadata[0]["tests"] == ["passed", "timeout", "timeout"]
    assert out.metrics["timeouts"] == 2.0
    assert 1.9 < elapsed < 3.0


@pytest.mark.parametrize(
    ("got", "expected", "equal"),
    [
        ([1, 2], (1, 2), True),
        (0.1 + 0.2, 0.3, True),
        (1, 1.0, True),
        (True, 1, False),
        ({"a": [1]}, {"a": (1,)}, True),
        ("1", 1, False),
        ([1, 2], [2, 1], False),
        (None, None, True),
        (1e-12, 0, True),
        (1.0, 1.001, False),
    ],
)
def test_values_equal(got, expected, equal):
    assert values_equal(got, expected) is equal


def test_code_env_on_ray(ray_session):
    from grpo_envs.pool import EnvPool

    programs = [
        _fenced("a, b = map(int, input().split())\nprint(a + b)"),
        _fenced("import os\nos.system('kill -9 -1')"),
    ]
    with EnvPool("code", {"limits": LIMITS}, num_workers=2) as pool:
        out = pool.step(_logs(programs), [ADD_TESTS] * 2)
    assert out.rewards == [1.0, 0.0]
    assert out.metrics["violations"] == 3.0  # each of the three tests tried
    assert out.metrics["env/actor_restarts"] == 0.0
