"""RewardFnEnv and import-path loading: a user's function or class, named by `module:attr`,
imported from a folder given as an import path (as the pool's actors do), never from grpo."""

import sys
import textwrap

import pytest

from grpo_envs import registry
from grpo_envs.pool import EnvPool
from grpo_envs.reward_fn import RewardFnEnv, reward_fn_arity

USER_MODULE = """
from grpo_envs.base import Environment, single_turn_output

def exact(response, env_info):
    return 1.0 if response.strip() == env_info["ground_truth"] else 0.0

def length(response):
    return len(response) / 10

def flag(response):
    return response == "yes"          # a bool is a number

def bad_value(response):
    return "high" if response == "x" else float("nan") if response == "nan" else 0.5

def boom(response):
    raise RuntimeError("user bug")

class Const(Environment):
    def __init__(self, value: float = 0.5):
        self.value = value
    def step(self, message_logs, env_infos):
        return single_turn_output([self.value] * len(message_logs), [{}] * len(message_logs), {})

class Half(Environment):
    pass                               # step not implemented

class Plain:
    pass
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    name = f"user_rewards_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    yield str(tmp_path), name
    sys.modules.pop(name, None)


def _logs(*responses):
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": r}] for r in responses]


def test_two_argument_function_gets_the_env_info(user_dir):
    path, mod = user_dir
    pool = EnvPool(
        "scored",
        {"reward_fn": f"{mod}:exact"},
        in_process=True,
        env_class="grpo_envs.reward_fn:RewardFnEnv",
        import_paths=[path],
    )
    out = pool.step(_logs("46", " 46 ", "45"), [{"ground_truth": "46"}] * 3)
    assert out.rewards == [1.0, 1.0, 0.0]
    assert out.terminateds == [True] * 3 and out.observations == [None] * 3
    assert out.metrics["reward_fn_calls"] == 3.0 and out.metrics["env/sample_errors"] == 0.0
    assert path not in sys.path  # the import path was used for the import only


def test_one_argument_function_and_bool_rewards(user_dir):
    path, mod = user_dir
    with registry.import_paths([path]):
        assert RewardFnEnv(f"{mod}:length").step(_logs("abcd", ""), [{}, {}]).rewards == [0.4, 0.0]
        assert RewardFnEnv(f"{mod}:flag").step(_logs("yes", "no"), [{}, {}]).rewards == [1.0, 0.0]


def test_bad_values_and_raising_functions_score_zero_and_count(user_dir):
    path, mod = user_dir
    pool = EnvPool(
        "v",
        {"reward_fn": f"{mod}:bad_value"},
        in_process=True,
        env_class="grpo_envs.reward_fn:RewardFnEnv",
        import_paths=[path],
    )
    out = pool.step(_logs("ok", "x", "nan"), [{}] * 3)
    assert out.rewards == [0.5, 0.0, 0.0]
    assert out.metrics["env/sample_errors"] == 2.0
    assert "expected a finite float" in out.metadata[1]["error"]
    pool = EnvPool(
        "b",
        {"reward_fn": f"{mod}:boom"},
        in_process=True,
        env_class="grpo_envs.reward_fn:RewardFnEnv",
        import_paths=[path],
    )
    out = pool.step(_logs("a"), [{}])
    assert out.rewards == [0.0] and "user bug" in out.metadata[0]["error"]


def test_arity_of_signatures():
    def one(r): ...
    def two(r, info): ...
    def two_default(r, info=None): ...
    def star(*args): ...
    def none(): ...
    def three(a, b, c): ...
    def kw_only(r, *, info): ...

    assert [reward_fn_arity(f) for f in (one, two, two_default, star)] == [1, 2, 2, 2]
    for f in (none, three, kw_only):
        with pytest.raises(TypeError, match=r"expected \(response: str\) or \(response: str, env_info: dict\)"):
            reward_fn_arity(f, "m:f")
    with pytest.raises(TypeError, match="'m:x' is 3, which is not callable"):
        reward_fn_arity(3, "m:x")


def test_env_class_by_import_path(user_dir):
    path, mod = user_dir
    pool = EnvPool("mine", {"value": 0.75}, in_process=True, env_class=f"{mod}:Const", import_paths=[path])
    assert pool.step(_logs("a", "b"), [{}, {}]).rewards == [0.75, 0.75]
    with registry.import_paths([path]):
        with pytest.raises(TypeError, match="not a subclass of grpo_envs.base.Environment"):
            registry.load_env_class(f"{mod}:Plain")
        with pytest.raises(TypeError, match="does not implement step"):
            registry.load_env_class(f"{mod}:Half")
        with pytest.raises(AttributeError, match=f"module '{mod}' has no attribute 'Nope'"):
            registry.load_env_class(f"{mod}:Nope")
    with pytest.raises(ImportError, match="cannot import module 'no_such_module_xyz'"):
        registry.load_object("no_such_module_xyz:Env")
    with pytest.raises(ImportError, match="not an import path"):
        registry.load_object("just_a_name")
