"""env.<name>.step_timeout_s reaches the EnvPool (the per-step budget of env calls), and is not
passed to the environment as one of its own kwargs; `class` / `reward_fn` choose what the pool runs."""

import grpo_envs.pool
from grpo_train.config import validate_config_dict
from grpo_train.setup import build_envs


def test_step_timeout_from_config_reaches_the_pool(monkeypatch):
    made = {}

    class Recorder:
        def __init__(self, name, config, num_workers=1, **kwargs):
            made[name] = (config, num_workers, kwargs)

    monkeypatch.setattr(grpo_envs.pool, "EnvPool", Recorder)
    cfg = validate_config_dict(
        {"env": {"math": {"num_workers": 2, "step_timeout_s": 30, "timeout_s": 2.0}, "code": {}}}
    )
    build_envs(cfg)
    one_cpu = {"num_cpus": 1, "num_gpus": 0}
    builtin = {"env_class": None, "import_paths": ()}
    assert made["math"] == ({"timeout_s": 2.0}, 2, {"step_timeout_s": 30.0, "actor_options": one_cpu, **builtin})
    assert made["code"] == ({}, 1, {"step_timeout_s": None, "actor_options": one_cpu, **builtin})


def test_custom_class_and_reward_fn_reach_the_pool(monkeypatch, tmp_path):
    """`class` and `reward_fn` become the pool's env_class (imported in each actor, after the
    directory grpo runs from); the class's other keys are its settings, the function its only one."""
    made = {}

    class Recorder:
        def __init__(self, name, config, num_workers=1, **kwargs):
            made[name] = (config, kwargs["env_class"], kwargs["import_paths"], kwargs["actor_options"])

    monkeypatch.setattr(grpo_envs.pool, "EnvPool", Recorder)
    monkeypatch.chdir(tmp_path)
    cfg = validate_config_dict(
        {
            "env": {
                "mine": {"class": "my_pkg.envs:MyEnv", "level": 3, "resources": {"GPU": 1, "CPU": 2}},
                "scored": {"reward_fn": "my_pkg.rewards:score"},
            }
        }
    )
    build_envs(cfg)
    assert made["mine"] == ({"level": 3}, "my_pkg.envs:MyEnv", [str(tmp_path)], {"num_cpus": 2, "num_gpus": 1})
    assert made["scored"] == (
        {"reward_fn": "my_pkg.rewards:score"},
        "grpo_envs.reward_fn:RewardFnEnv",
        [str(tmp_path)],
        {"num_cpus": 1, "num_gpus": 0},
    )
