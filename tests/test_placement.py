"""Every actor gets the GPUs the plan gives it: checked on CPU against Ray nodes with logical GPUs.

Two cluster shapes, one driver process: two Ray nodes on this machine with 4 logical GPUs each
(`ray start --num-gpus=4`, head and worker), then, after the driver leaves that cluster, one node
with 8 (`ray.init(num_gpus=8)` in the same driver: the single-node `ray start --head --num-gpus=8`
shape without a second CLI start-up). The driver runs the real placement code of each case
(PolicyGroup, setup's `start_generator`, ValueGroup, `env_actor_options`) with
`grpo_train.placement.PROBE` set, so the same placement groups and options start probes that load
nothing; each probe reports its node, bundle and the CUDA_VISIBLE_DEVICES Ray gave it. Nothing here
calls CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# The node helpers of test_multinode.py (pytest imports test files by path, not as a package).
_spec = importlib.util.spec_from_file_location("grpo_multinode_helpers", Path(__file__).with_name("test_multinode.py"))
_nodes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_nodes)
free_port, start_node, stop_nodes, wait_for_nodes = (
    _nodes.free_port,
    _nodes.start_node,
    _nodes.stop_nodes,
    _nodes.wait_for_nodes,
)

pytestmark = pytest.mark.slow

CASES = {
    "grpo_colocated": {
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4},
        "policy": {"num_workers": 8, "train_global_batch_size": 8, "train_micro_batch_size": 1},
    },
    "grpo_separate": {
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4},
        "policy": {
            "num_workers": 4,
            "train_global_batch_size": 8,
            "train_micro_batch_size": 2,
            "generation": {
                "colocated": {"enabled": False, "resources": {"gpus_per_node": 4, "num_nodes": 1}},
                "vllm_cfg": {"tensor_parallel_size": 2},
            },
        },
    },
    "grpo_async": {
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "async_grpo": {"enabled": True}},
        "loss_fn": {"use_importance_sampling_correction": True},
        "policy": {
            "num_workers": 4,
            "train_global_batch_size": 8,
            "train_micro_batch_size": 2,
            "generation": {
                "colocated": {"enabled": False, "resources": {"gpus_per_node": 2, "num_nodes": 1}},
                "vllm_cfg": {"tensor_parallel_size": 2},
            },
        },
        "env": {"math": {"num_workers": 1}, "reward_model": {"num_workers": 1, "resources": {"GPU": 1}}},
    },
    "ppo_reward_model": {
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
        "policy": {"num_workers": 2, "train_global_batch_size": 4, "train_micro_batch_size": 2},
        "ppo": {},
        "value": {"num_workers": 2},
        "env": {"reward_model": {"num_workers": 1, "resources": {"GPU": 1}}},
    },
}

DRIVER = r"""
import json, sys
import ray
from ray.util.placement_group import PlacementGroup, placement_group_table
from grpo_train import placement
from grpo_train.config import validate_config_dict
from grpo_train.placement import PlacementProbe
from grpo_train.policy.group import PolicyGroup
from grpo_train.ppo.value_group import ValueGroup
from grpo_train.setup import actor_env_vars, env_actor_options, init_ray, start_generator

placement.PROBE = True
address, model, cases, one_node_dir = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
probe = ray.remote(PlacementProbe)


def run_cases(cluster):
    names = {n["NodeID"]: ("a" if "grpo_node_a" in n["Resources"] else "b") for n in ray.nodes() if n["Alive"]}
    return {case: run_case(validate_config_dict({**sections, "cluster": cluster}), names) for case, sections in cases.items()}


def run_case(cfg, names):
    policy = PolicyGroup(model, cfg.policy, cfg.loss_fn, cfg.cluster, 0,
                         colocated_generation=cfg.policy.generation.colocated.enabled, start=False)
    actors = {f"policy {r}": w for r, w in enumerate(policy.workers)}
    actors |= {f"engine {e}": h for e, h in enumerate(start_generator(cfg, model, policy).engines)}
    if cfg.ppo is not None:
        value = ValueGroup(model, cfg.value, cfg.value_loss_fn, cfg.cluster, 4, 0, start=False)
        actors |= {f"value {r}": w for r, w in enumerate(value.workers)}
    for name, env in cfg.env.items():
        for w in range(env.num_workers):
            actors[f"env {name} {w}"] = probe.options(**env_actor_options(env.resources)).remote(f"env {name}")
    report = {}
    for key, handle in actors.items():
        where = ray.get(handle.where.remote(), timeout=300)  # actor start-ups queue on a loaded 2-core box
        where["node"] = names[where.pop("node_id")]
        report[key] = where
    for handle in actors.values():
        ray.kill(handle)
    for pg_id, info in placement_group_table().items():
        if info["state"] != "REMOVED":
            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    return report


init_ray(validate_config_dict({"cluster": {"address": address}}).cluster, actor_env_vars())
out = {"two_nodes": run_cases({"address": address, "gpus_per_node": 4, "num_nodes": 2})}
ray.shutdown()
ray.init(num_cpus=16, num_gpus=8, resources={"grpo_node_a": 1}, include_dashboard=False, log_to_driver=False,
         _temp_dir=one_node_dir, runtime_env={"env_vars": actor_env_vars()})
out["one_node"] = run_cases({"gpus_per_node": 8, "num_nodes": 1})
print("PLACEMENT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def placements(tmp_path_factory):
    """Start the two logical-GPU nodes once, run every case's placement, stop the nodes."""
    import os

    import ray

    from grpo_train.assets import builtin_model_path

    logs = tmp_path_factory.mktemp("placement")
    ray_dir = tempfile.mkdtemp(prefix="grpo-ray-", dir="/tmp")  # Ray's socket paths stay short
    one_node_dir = tempfile.mkdtemp(prefix="grpo-ray1-", dir="/tmp")
    port = free_port()
    address = f"{ray.util.get_node_ip_address()}:{port}"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    env.pop("RAY_ADDRESS", None)
    procs = [
        start_node(
            [
                "--head",
                f"--port={port}",
                "--num-cpus=8",
                "--num-gpus=4",
                '--resources={"grpo_node_a": 1}',
                "--include-dashboard=false",
                f"--temp-dir={ray_dir}",
            ],
            env,
            logs / "head.log",
        )
    ]
    try:
        procs.append(
            start_node(
                [f"--address={address}", "--num-cpus=8", "--num-gpus=4", '--resources={"grpo_node_b": 1}'],
                env,
                logs / "worker.log",
            )
        )
        wait_for_nodes([logs / "head.log", logs / "worker.log"], procs)
        model = str(builtin_model_path("arith-tiny"))
        result = subprocess.run(
            [sys.executable, "-c", DRIVER, address, model, json.dumps(CASES), one_node_dir],
            env=env,
            capture_output=True,
            text=True,
            timeout=500,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        line = next(x for x in result.stdout.splitlines() if x.startswith("PLACEMENT "))
        yield json.loads(line.removeprefix("PLACEMENT "))
    finally:
        stop_nodes(procs)
        shutil.rmtree(ray_dir, ignore_errors=True)
        shutil.rmtree(one_node_dir, ignore_errors=True)


def devices(where: dict) -> set[tuple[str, str]]:
    """The (node, GPU) pairs an actor sees, from the CUDA_VISIBLE_DEVICES Ray set for it."""
    assert sorted(where["gpu_ids"]) == sorted(
        (where["cuda_visible_devices"] or "").split(",") if where["gpu_ids"] else []
    )
    return {(where["node"], gpu) for gpu in where["gpu_ids"]}


SHAPES = pytest.mark.parametrize("shape", ["two_nodes", "one_node"])


@SHAPES
def test_colocated_engines_share_their_rank_gpu(placements, shape):
    p = placements[shape]["grpo_colocated"]
    for r in range(8):
        rank, engine = p[f"policy {r}"], p[f"engine {r}"]
        assert rank["bundles"] == engine["bundles"] == [r]  # the engine sits in its rank's bundle
        assert rank["placement_group"] == engine["placement_group"]
        assert len(devices(rank)) == 1 and devices(rank) == devices(engine)  # half a GPU each, the same GPU
        assert rank["gpus"] == engine["gpus"] == 0.5
    ranks = [devices(p[f"policy {r}"]).pop() for r in range(8)]
    assert len(set(ranks)) == 8  # every GPU of the cluster, once
    assert sorted(node for node, _ in ranks) == (["a"] * 4 + ["b"] * 4 if shape == "two_nodes" else ["a"] * 8)


@SHAPES
def test_separate_engines_get_their_own_gpus(placements, shape):
    p = placements[shape]["grpo_separate"]
    policy = set().union(*(devices(p[f"policy {r}"]) for r in range(4)))
    assert len(policy) == 4 and len({n for n, _ in policy}) == 1  # PACK: one node
    engines = [devices(p[f"engine {e}"]) for e in range(2)]
    assert all(len(e) == 2 for e in engines)  # tensor_parallel_size 2: two GPUs each
    assert engines[0].isdisjoint(engines[1]) and policy.isdisjoint(engines[0] | engines[1])
    assert [p[f"engine {e}"]["bundles"] for e in range(2)] == [[0], [1]]
    assert p["engine 0"]["placement_group"] != p["policy 0"]["placement_group"]


@SHAPES
def test_async_engine_and_reward_model_get_gpus_of_their_own(placements, shape):
    p = placements[shape]["grpo_async"]
    policy = set().union(*(devices(p[f"policy {r}"]) for r in range(4)))
    engine, reward = devices(p["engine 0"]), devices(p["env reward_model 0"])
    assert len(engine) == 2 and len(reward) == 1  # vllm_cfg.tensor_parallel_size GPUs; env.reward_model.resources
    assert policy.isdisjoint(engine) and policy.isdisjoint(reward) and engine.isdisjoint(reward)
    assert devices(p["env math 0"]) == set()  # no GPU asked, none given


@SHAPES
def test_ppo_value_ranks_and_reward_model_beside_the_policy(placements, shape):
    p = placements[shape]["ppo_reward_model"]
    groups = [devices(p[k]) for k in ("policy 0", "policy 1", "value 0", "value 1", "env reward_model 0")]
    assert all(len(g) == 1 for g in groups)
    assert len(set().union(*groups)) == 5  # five different GPUs
    for r in range(2):
        assert devices(p[f"engine {r}"]) == devices(p[f"policy {r}"])  # colocated: the rank's GPU
    assert p["value 0"]["placement_group"] != p["policy 0"]["placement_group"]
