"""env.<name>.step_timeout_s reaches the EnvPool (the per-step budget of env calls), and is not
passed to the environment as one of its own kwargs."""

import grpo_envs.pool
from grpo_train.config import validate_config_dict
from grpo_train.setup import build_envs


def test_step_timeout_from_config_reaches_the_pool(monkeypatch):
    made = {}

    class Recorder:
        def __init__(self, name, config, num_workers=1, **kwargs):
            made[name] = (config, num_workers, kwargs)

    monkeypatch.setattr(grpo_envs.pool, "EnvPool", Recorder)
    cfg = validate_config_dict({"env": {"math": {"num_workers": 2, "step_timeout_s": 30, "timeout_s": 2.0},
                                        "code": {}}})
    build_envs(cfg)
    one_cpu = {"num_cpus": 1, "num_gpus": 0}
    assert made["math"] == ({"timeout_s": 2.0}, 2, {"step_timeout_s": 30.0, "actor_options": one_cpu})
    assert made["code"] == ({}, 1, {"step_timeout_s": None, "actor_options": one_cpu})
