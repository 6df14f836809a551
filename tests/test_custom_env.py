"""Custom environments and reward functions named in a config (`env.<name>.class`, `.reward_fn`).

The user code is tests/fixtures/custom_env (outside the grpo packages), found on PYTHONPATH as a
user's would be. Bad input is refused through the CLI's validation path with one line naming the
key; the Ray parts run with real actors (logical GPUs for `resources`); one short `grpo train` run
trains with both; the README's example is extracted and run so the docs cannot drift.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "custom_env"
DEMO = ROOT / "packages" / "grpo-cli" / "src" / "grpo_cli" / "configs" / "grpo_arith_tiny.yaml"


def _env_with_fixtures(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def _config(tmp_path: Path, env: dict, **sections) -> Path:
    path = tmp_path / "custom.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "defaults": str(DEMO),
                "env": {"_override_": True, **env},
                "data": {"validation": None, "train": {"env_name": next(iter(env))}},
                **sections,
            }
        )
    )
    return path


# --------------------------------------------------------------------------- bad input
BAD = [
    ({"x": {"class": "no_such_module_abc:Env"}}, "env.x.class", "cannot import module 'no_such_module_abc'"),
    ({"x": {"class": "my_env:Missing"}}, "env.x.class", "module 'my_env' has no attribute 'Missing'"),
    ({"x": {"class": "my_env:NotAnEnv"}}, "env.x.class", "not a subclass of grpo_envs.base.Environment"),
    ({"x": {"class": "not a path"}}, "env.x.class", "should match pattern"),
    ({"x": {"class": "my_env:OffByOneEnv", "partial": "big"}}, "env.x.partial", "valid number"),
    ({"x": {"reward_fn": "my_rewards:NOT_CALLABLE"}}, "env.x.reward_fn", "is 3.0, which is not callable"),
    (
        {"x": {"reward_fn": "my_rewards:three_args"}},
        "env.x.reward_fn",
        r"expected (response: str) or (response: str, env_info: dict)",
    ),
    (
        {"x": {"reward_fn": "my_rewards:score", "class": "my_env:OffByOneEnv"}},
        "env.x",
        "either `class` (an Environment) or `reward_fn` (a function), not both",
    ),
    ({"x": {"reward_fn": "my_rewards:score", "partial": 1.0}}, "env.x", "takes no settings of its own"),
    ({"x": {"class": "my_env:OffByOneEnv", "resources": {"TPU": 1}}}, "env.x.resources", "unknown resource(s) TPU"),
    (
        {"x": {"class": "my_env:OffByOneEnv", "resources": {"num_gpus": 1}}},
        "env.x.resources",
        "resource 'num_gpus': write 'GPU'",
    ),
    ({"x": {}}, "env.x", "unknown environment; registered:"),
]


@pytest.mark.parametrize(("env", "key", "message"), BAD, ids=[f"{k}-{m[:24]}" for _, k, m in BAD])
def test_bad_custom_env_is_one_line_naming_the_key(tmp_path, monkeypatch, capsys, env, key, message):
    from grpo_cli.main import main

    monkeypatch.syspath_prepend(str(FIXTURES))
    path = _config(tmp_path, env)
    assert main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"grpo: config error: {path}: {key}: "), err
    assert message in err, err


def test_unresolvable_annotations_still_check_setting_names(tmp_path, monkeypatch, capsys):
    from grpo_cli.main import main

    monkeypatch.syspath_prepend(str(FIXTURES))
    assert (
        main(
            [
                "config",
                "validate",
                str(_config(tmp_path, {"x": {"class": "my_env:CheckerOnlyAnnotations", "partial": 0.5}})),
            ]
        )
        == 0
    )
    bad = _config(tmp_path, {"x": {"class": "my_env:CheckerOnlyAnnotations", "partal": 0.5}})
    assert main(["config", "validate", str(bad)]) == 2
    assert f"{bad}: env.x.partal: unknown key (environment 'x' takes: partial)" in capsys.readouterr().err


def test_train_refuses_a_bad_class_before_any_actor_starts(tmp_path):
    """The real CLI process: exit 2, one line, and no Ray started (no session folder written)."""
    path = _config(tmp_path, {"x": {"class": "my_env:NotAnEnv"}})
    ray_tmp = tmp_path / "ray"
    result = subprocess.run(
        [sys.executable, "-m", "grpo_cli.main", "train", "-c", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env=_env_with_fixtures(RAY_TMPDIR=str(ray_tmp)),
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "env.x.class: 'my_env:NotAnEnv' is <class 'my_env.NotAnEnv'>, not a subclass" in result.stderr
    assert not ray_tmp.exists()


# ------------------------------------------------------------- Ray: GPUs and step budget
GPU_DRIVER = r"""
import json
import ray
from grpo_train.config import validate_config_dict
from grpo_train.config.checks import check_envs
from grpo_train.setup import actor_env_vars, build_envs

cfg = validate_config_dict({"env": {"probe": {"class": "my_env:GpuProbeEnv", "num_workers": 2, "resources": {"GPU": 1}}}})
check_envs(cfg)
ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
         runtime_env={"env_vars": actor_env_vars()})
pool = build_envs(cfg)["probe"]
log = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": t}] for t in ("a", "b")]
print("PROBE " + json.dumps(pool.step(log, [{}, {}]).metadata))
pool.shutdown()
"""


def test_resources_give_each_env_actor_its_own_gpu(tmp_path):
    """A Ray of two logical GPUs (its own: the session's has none); the class found on PYTHONPATH."""
    result = subprocess.run(
        [sys.executable, "-c", GPU_DRIVER],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=_env_with_fixtures(),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    probe = json.loads(next(x for x in result.stdout.splitlines() if x.startswith("PROBE "))[len("PROBE ") :])
    assert len({m["pid"] for m in probe}) == 2  # two workers, one sample each
    gpus = [m["gpu_ids"] for m in probe]
    assert all(len(g) == 1 for g in gpus) and sorted(g[0] for g in gpus) == ["0", "1"]
    assert [m["cuda_visible"] for m in probe] == [g[0] for g in gpus]  # Ray hands the device to CUDA


def test_step_timeout_and_reward_fn_from_config_in_env_actors(ray_session, monkeypatch):
    """Run from the fixtures' folder, as a user runs grpo next to their modules: the actors import
    the class and the function from the run directory. A step past step_timeout_s scores 0, is
    counted, and the pool goes on."""
    from grpo_train.config import validate_config_dict
    from grpo_train.setup import build_envs

    monkeypatch.chdir(FIXTURES)
    cfg = validate_config_dict(
        {
            "env": {
                "slow": {"class": "my_env:SlowEnv", "step_timeout_s": 1.0, "delay_s": 600},
                "scored": {"reward_fn": "my_rewards:score"},
            }
        }
    )
    pools = build_envs(cfg)
    try:
        first = pools["slow"].step(_logs("fast", "slow"), [{}, {}])
        after = pools["slow"].step(_logs("fast"), [{}])
        scored = pools["scored"].step(_logs("46", "7"), [{"ground_truth": "46"}, {"ground_truth": "8"}])
    finally:
        for pool in pools.values():
            pool.shutdown()
    assert first.rewards == [1.0, 0.0]  # only the slow sample loses its reward
    assert first.metrics["env/step_timeouts"] == 3.0  # the chunk twice, then the slow sample alone
    assert first.metrics["env/crashed_samples"] == 1.0 and first.metrics["env/actor_restarts"] == 3.0
    assert after.rewards == [1.0]
    assert scored.rewards == [1.0, -1.0] and scored.metrics["reward_fn_calls"] == 2.0  # -1: only my_rewards.score


def _logs(*texts: str) -> list[list[dict]]:
    return [[{"role": "user", "content": "q"}, {"role": "assistant", "content": t}] for t in texts]


# ------------------------------------------------------------------------ grpo train
@pytest.mark.slow
def test_custom_env_and_reward_fn_train_through_grpo_train(tmp_path):
    """Two training datasets of the demo, one scored by a custom `class`, one by a `reward_fn`."""
    calls = tmp_path / "calls.jsonl"
    train = {"dataset_name": "arithmetic", "size": 1000, "digits": 2, "processor": "plain"}
    path = tmp_path / "custom.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "defaults": str(DEMO),
                "grpo": {
                    "num_prompts_per_step": 8,
                    "max_num_steps": 2,
                    "val_period": 0,
                    "val_at_start": False,
                    "val_at_end": False,
                },
                "policy": {"train_global_batch_size": 64, "train_micro_batch_size": 32},
                "data": {
                    "validation": None,
                    "train": [{**train, "seed": 1, "env_name": "near"}, {**train, "seed": 3, "env_name": "scored"}],
                },
                "env": {
                    "_override_": True,
                    "near": {"class": "my_env:OffByOneEnv", "partial": 0.25},
                    "scored": {"reward_fn": "my_rewards:score"},
                },
                "logger": {"wandb_enabled": False, "tensorboard_enabled": False, "plot_enabled": False},
                "checkpointing": {"enabled": False},
            }
        )
    )
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "grpo_cli.main", "train", "-c", str(path), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        env=_env_with_fixtures(MY_REWARDS_LOG=str(calls)),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2]
    # the reward function ran once per sample routed to it (the calls log), and only it gives -1
    logged = [json.loads(x)["reward"] for x in calls.read_text().splitlines()]
    counts = [int(r["env/scored/reward_fn_calls"]) for r in train_rows]
    assert len(logged) == sum(counts) and all(0 < c < 64 for c in counts) and -1.0 in logged
    # each step's reward_mean is made of exactly these two sources: the function's logged rewards
    # and the class's 1 (exact) / 0.25 (off by one) / 0, rebuilt from the class's own metrics
    start = 0
    for row, n_scored in zip(train_rows, counts, strict=True):
        scored = logged[start : start + n_scored]
        start += n_scored
        n_near = 64 - n_scored
        exact, off = row["env/near/exact"] * n_near, row["env/near/off_by_one"]
        assert row["reward_mean"] == pytest.approx((sum(scored) + exact + 0.25 * off) / 64, abs=1e-5)
        assert row["accuracy"] == pytest.approx((scored.count(1.0) + exact + off) / 64, abs=1e-5)


# ---------------------------------------------------------------------------- README
def _readme_blocks() -> tuple[str, list[str]]:
    """The python module and the `grpo train` command line of the README's section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Custom environments and rewards", 1)[1].split("\n## ", 1)[0]
    python = re.search(r"```python\n(.*?)```", section, re.S)
    command = re.search(r"```bash\n(.*?)```", section, re.S)
    assert python and command, "README's custom-environment section lost its python or bash block"
    return python.group(1), shlex.split(command.group(1).replace("\\\n", " "))


def test_readme_custom_reward_example_runs(tmp_path, monkeypatch):
    """The README's module saved where a user runs grpo, and its command line: the config it
    makes validates, and the pool it builds scores with the README's function."""
    code, argv = _readme_blocks()
    module = re.match(r"# (\w+)\.py", code)
    assert module, "the README's python block starts with '# <module>.py'"
    assert argv[:4] == ["grpo", "train", "-c", "grpo_arith_tiny.yaml"], argv
    (tmp_path / f"{module.group(1)}.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, module.group(1), raising=False)  # the fixtures' module of that name
    from grpo_cli.main import main

    assert main(["config", "validate", *argv[3:]]) == 0
    from grpo_cli.main import CONFIG_DIR
    from grpo_envs.pool import EnvPool
    from grpo_train.config import load_config
    from grpo_train.config.checks import env_import_paths
    from grpo_train.setup import REWARD_FN_ENV

    cfg, _ = load_config(argv[3], argv[4:], [CONFIG_DIR])
    ((name, env_cfg),) = cfg.env.items()
    assert cfg.data.train.env_name == name and env_cfg.reward_fn == f"{module.group(1)}:score"
    try:
        pool = EnvPool(
            name,
            {"reward_fn": env_cfg.reward_fn},
            in_process=True,
            env_class=REWARD_FN_ENV,
            import_paths=env_import_paths(),
        )
        logs = [
            [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": answer}]
            for answer in ("46", "46 is it", "45", "")
        ]
        out = pool.step(logs, [{"ground_truth": "46"}] * 4)
    finally:
        sys.modules.pop(module.group(1), None)
    assert out.rewards == [1.0, 0.5, 0.0, 0.0]  # hand-computed from the README's function
