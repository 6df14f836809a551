"""EnvPool: ordering, merged metrics, exception isolation, and recovery from dead workers.

The Ray tests use real actors (the session's ``ray_session``). The test-only environments
below die with ``os._exit`` on hostile inputs, as a segfaulting verifier would.
"""

import os
import sys
import threading
import time

import pytest

import grpo_envs
from grpo_envs.base import Environment, EnvOutput, response_text
from grpo_envs.pool import EnvPool, _split


class EchoEnv(Environment):
    """Reward = the integer in the response; hostile responses crash, raise or hang."""

    COUNT_METRICS = frozenset({"seen"})

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s

    def step(self, message_logs, env_infos):
        rewards = []
        for log, info in zip(message_logs, env_infos):
            text = response_text(log)
            if text == "RAISE":
                raise ValueError("hostile input")
            if text == "POISON":
                os._exit(3)
            if text == "CRASH_ONCE" and not os.path.exists(info["marker"]):
                open(info["marker"], "w").close()
                os._exit(4)
            if text == "HANG":
                time.sleep(3600)
            time.sleep(self.delay_s)
            rewards.append(float(info["value"]))
        n = len(rewards)
        return EnvOutput(
            rewards,
            [None] * n,
            [True] * n,
            [{"pid": os.getpid()} for _ in range(n)],
            {"mean_reward": sum(rewards) / n, "seen": float(n)},
        )

    def global_post_process_and_metrics(self, batch_metadata):
        return {"distinct_workers": float(len({m.get("pid") for m in batch_metadata}))}


grpo_envs.register("test_echo", EchoEnv, overwrite=True)


@pytest.fixture(scope="module")
def ray_env(ray_session):
    # Test modules are not importable inside Ray workers: ship this one's classes by value.
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_session


def _batch(responses, values, **info):
    logs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": r}] for r in responses]
    return logs, [{"value": v, **info} for v in values]


def test_split_is_contiguous_and_balanced():
    assert _split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert _split(2, 4) == [(0, 1), (1, 2)]
    assert _split(0, 3) == []


def test_in_process_isolates_exceptions():
    pool = EnvPool("test_echo", {}, num_workers=4, in_process=True)
    logs, infos = _batch(["1", "RAISE", "3"], [1, 2, 3])
    out = pool.step(logs, infos)
    assert out.rewards == [1.0, 0.0, 3.0]
    assert "hostile input" in out.metadata[1]["error"]
    assert out.metrics["env/sample_errors"] == 1.0
    assert out.metrics["env/actor_restarts"] == 0.0
    assert out.metrics["mean_reward"] == 2.0  # over the two samples that were scored
    assert out.metrics["seen"] == 2.0
    assert pool.global_post_process_and_metrics(out.metadata) == {"distinct_workers": 2.0}  # a pid and None
    pool.shutdown()


def test_in_process_arithmetic_matches_direct_env():
    logs, _ = _batch(["46", "45", "x"], [0, 0, 0])
    infos = [{"ground_truth": "46"}] * 3
    with EnvPool("arithmetic", {}, num_workers=1, in_process=True) as pool:
        out = pool.step(logs, infos)
    assert out.rewards == grpo_envs.make("arithmetic").step(logs, infos).rewards == [1.0, 0.0, 0.0]


def test_ray_pool_merges_in_order(ray_env):
    values = list(range(11))
    logs, infos = _batch([str(v) for v in values], values)
    with EnvPool("test_echo", {}, num_workers=3) as pool:
        out = pool.step(logs, infos)
        assert out.rewards == [float(v) for v in values]
        assert len({m["pid"] for m in out.metadata}) == 3  # really spread over three workers
        assert out.metrics["mean_reward"] == pytest.approx(5.0)
        assert out.metrics["seen"] == 11.0
        assert out.metrics["env/actor_restarts"] == 0.0
        empty = pool.step([], [])
        assert empty.rewards == [] and empty.metrics["env/actor_restarts"] == 0.0
        assert pool.global_post_process_and_metrics(out.metadata) == {"distinct_workers": 3.0}


def test_ray_pool_arithmetic(ray_env):
    logs, _ = _batch(["46", " 46 </s>", "45", "??"], [0] * 4)
    infos = [{"ground_truth": "46"}] * 4
    with EnvPool("arithmetic", {}, num_workers=2) as pool:
        out = pool.step(logs, infos)
    assert out.rewards == [1.0, 1.0, 0.0, 0.0]
    assert out.metrics["accuracy"] == 0.5


def test_actor_killed_mid_batch_is_restarted(ray_env):
    values = list(range(8))
    logs, infos = _batch([str(v) for v in values], values)
    with EnvPool("test_echo", {"delay_s": 0.5}, num_workers=2) as pool:
        victim = pool._actors[1]
        killer = threading.Timer(0.8, lambda: ray_env.kill(victim, no_restart=True))
        killer.start()
        out = pool.step(logs, infos)
        killer.join()
        assert out.rewards == [float(v) for v in values]
        assert out.metrics["env/actor_restarts"] == 1.0
        assert out.metrics["env/crashed_samples"] == 0.0
        assert pool.total_restarts == 1
        # the replacement worker serves the next step
        assert pool.step(logs, infos).rewards == [float(v) for v in values]


def test_transient_crash_retries_the_chunk(ray_env, tmp_path):
    logs, infos = _batch(["1", "CRASH_ONCE", "3", "4"], [1, 2, 3, 4], marker=str(tmp_path / "crashed"))
    with EnvPool("test_echo", {}, num_workers=2) as pool:
        out = pool.step(logs, infos)
    assert out.rewards == [1.0, 2.0, 3.0, 4.0]
    assert out.metrics["env/actor_restarts"] == 1.0
    assert out.metrics["env/crashed_samples"] == 0.0


def test_poison_sample_is_isolated(ray_env):
    logs, infos = _batch(["1", "2", "POISON", "4", "5", "6"], [1, 2, 3, 4, 5, 6])
    with EnvPool("test_echo", {}, num_workers=2) as pool:
        out = pool.step(logs, infos)
        assert out.rewards == [1.0, 2.0, 0.0, 4.0, 5.0, 6.0]
        assert "crashed" in out.metadata[2]["error"]
        # chunk [0:3] killed a worker twice, then its culprit killed one more
        assert out.metrics["env/actor_restarts"] == 3.0
        assert out.metrics["env/crashed_samples"] == 1.0
        assert out.metrics["seen"] == 5.0
        assert pool.step(*_batch(["7"], [7])).rewards == [7.0]


def test_hung_worker_is_replaced(ray_env):
    logs, infos = _batch(["1", "HANG"], [1, 2])
    with EnvPool("test_echo", {}, num_workers=1, step_timeout_s=1.0) as pool:
        t0 = time.monotonic()
        out = pool.step(logs, infos)
        assert time.monotonic() - t0 < 30
        assert pool.step(*_batch(["7"], [7])).rewards == [7.0]  # the run goes on with a fresh worker
    assert out.rewards == [1.0, 0.0]
    assert out.metrics["env/crashed_samples"] == 1.0
    # the chunk overran twice, then its samples one at a time: only "HANG" overran again
    assert out.metrics["env/step_timeouts"] == 3.0


def test_give_up_when_workers_cannot_survive(ray_env):
    logs, infos = _batch(["POISON"] * 3, [0, 0, 0])
    with EnvPool("test_echo", {}, num_workers=1, max_restarts_per_step=2) as pool:
        with pytest.raises(RuntimeError, match="workers died 3 times in one step"):
            pool.step(logs, infos)


def test_bad_config_fails_at_start(ray_env):
    with pytest.raises(RuntimeError, match="failed to start with config"):
        EnvPool("test_echo", {"no_such_option": 1}, num_workers=1)


def test_needs_ray_init_or_in_process():
    import subprocess

    code = "from grpo_envs.pool import EnvPool; EnvPool('arithmetic', {}, num_workers=1)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "call ray.init() before creating the pool" in out.stderr


def test_env_class_by_import_path_is_imported_in_the_actor(ray_env, tmp_path):
    """The class lives in a folder the actor knows only through import_paths: it is imported
    there by name, not pickled from the driver."""
    (tmp_path / "pool_user_env.py").write_text(
        "import os, sys\n"
        "from grpo_envs.base import Environment, single_turn_output\n"
        "class Where(Environment):\n"
        "    def __init__(self, bonus: float = 0.0):\n"
        "        self.bonus = bonus\n"
        "    def step(self, logs, infos):\n"
        "        return single_turn_output([1.0 + self.bonus] * len(logs),\n"
        "                                  [{'pid': os.getpid(), 'path0': sys.path[0]} for _ in logs], {})\n"
    )
    try:
        with EnvPool(
            "where", {"bonus": 0.5}, num_workers=1, env_class="pool_user_env:Where", import_paths=[str(tmp_path)]
        ) as pool:
            out = pool.step(*_batch(["a", "b"], [0, 0]))
    finally:
        sys.modules.pop("pool_user_env", None)
    assert out.rewards == [1.5, 1.5]
    assert out.metadata[0]["pid"] != os.getpid() and out.metadata[0]["path0"] == str(tmp_path)
    assert str(tmp_path) not in sys.path
