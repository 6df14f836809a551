"""Registry: built-in names, registration, errors, cheap import."""

import subprocess
import sys

import pytest

import grpo_envs
from grpo_envs.arithmetic import ArithmeticEnv
from grpo_envs.base import Environment, EnvOutput


def test_builtin_names():
    assert {"math", "arithmetic", "code", "reward_model", "number_guess"} <= set(grpo_envs.names())
    assert grpo_envs.get("arithmetic") is ArithmeticEnv


def test_register_and_make():
    class Constant(Environment):
        def __init__(self, value=0.5):
            self.value = value

        def step(self, message_logs, env_infos):
            n = len(message_logs)
            return EnvOutput([self.value] * n, [None] * n, [True] * n, [{}] * n)

    grpo_envs.register("test_constant", Constant)
    env = grpo_envs.make("test_constant", value=0.25)
    assert env.step([[]], [{}]).rewards == [0.25]
    with pytest.raises(ValueError, match="already registered"):
        grpo_envs.register("test_constant", ArithmeticEnv)
    grpo_envs.register("test_constant", ArithmeticEnv, overwrite=True)
    assert grpo_envs.get("test_constant") is ArithmeticEnv


def test_errors_name_the_problem():
    with pytest.raises(KeyError, match="unknown environment 'nope'; registered: .*arithmetic"):
        grpo_envs.make("nope")
    with pytest.raises(TypeError, match="expected an Environment subclass"):
        grpo_envs.register("bad", dict)
    with pytest.raises(TypeError, match="environment 'arithmetic' \\(ArithmeticEnv\\): bad config"):
        grpo_envs.make("arithmetic", no_such_option=1)


def test_import_is_cheap():
    code = (
        "import sys, grpo_envs; print(sorted(m for m in ('ray', 'math_verify', 'torch', 'sympy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
