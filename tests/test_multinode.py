"""Multi-node placement, simulated on this machine: two Ray nodes started with `ray start`
(each with its own resources), and a driver that joins them through `cluster.address` and
trains data-parallel policy ranks spread over both nodes.

Every process started here is stopped here by its pid (`ray start --block` stops its node's
processes when it ends); `ray stop` would stop every Ray on the machine."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

RAY = str(Path(sys.executable).with_name("ray"))
NODE_START_TIMEOUT_S = 120
# `ray start --block` is slow to act on SIGTERM (over 10 s here); its node is then killed with
# SIGKILL to its process group (GCS, raylet; their workers exit with the raylet).
STOP_TIMEOUT_S = 3

DRIVER = r"""
import json, sys
import ray, torch
torch.set_num_threads(1)
from grpo_train.config.schema import ClusterConfig, LossConfig, PolicyConfig
from grpo_train.policy.group import PolicyGroup
from grpo_train.setup import actor_env_vars, init_ray

cluster = ClusterConfig(address=sys.argv[1], num_nodes=2)
init_ray(cluster, actor_env_vars())
cfg = PolicyConfig(precision="float32", num_workers=2, train_global_batch_size=4, train_micro_batch_size=2,
                   optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.1}}, generation={"temperature": 1.0})
group = PolicyGroup(sys.argv[2], cfg, LossConfig(reference_policy_kl_penalty=0.0), cluster, seed=0, num_threads=1)
g = torch.Generator().manual_seed(0)
mask = torch.ones(4, 10, dtype=torch.long)
token_mask = mask.float().clone()
token_mask[:, :3] = 0
batch = {"input_ids": torch.randint(3, 20, (4, 10), generator=g), "attention_mask": mask, "token_mask": token_mask,
         "sample_mask": torch.ones(4), "gen_logprobs": torch.zeros(4, 10), "advantages": torch.randn(4, 1, generator=g) * token_mask}
batch["prev_logprobs"] = group.logprobs(batch)
metrics = group.train(batch)
print(json.dumps({"ranks": group.whereabouts(), "loss": metrics["loss"],
                  "grad_norm": metrics["grad_norm"], "nodes": len(ray.nodes())}))
group.close()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def start_node(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_nodes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each `ray start --block` (in its own session: that node's processes only), then wait."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for_nodes(logs: list[Path], procs: list[subprocess.Popen]) -> None:
    """Until every `ray start` says its node runs (it prints this after joining the cluster)."""
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a `ray start` process ended early: " + " / ".join(
            log.read_text()[-2000:] for log in logs
        )
        if all(log.exists() and "Ray runtime started" in log.read_text() for log in logs):
            return
        time.sleep(0.5)
    raise TimeoutError(f"{len(logs)} Ray nodes did not come up in {NODE_START_TIMEOUT_S} s")


@pytest.fixture
def two_node_cluster(tmp_path):
    """A head and a worker node on this machine, 2 logical CPUs each; yields the address."""
    import shutil
    import tempfile

    # Ray's socket paths must stay under 108 bytes: a short folder, not pytest's tmp_path.
    ray_dir = tempfile.mkdtemp(prefix="grpo-ray-", dir="/tmp")
    port = free_port()
    import ray

    address = f"{ray.util.get_node_ip_address()}:{port}"  # the IP the nodes register under
    # A local simulation: no token to share between the two nodes (see README for real clusters).
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    env.pop("RAY_ADDRESS", None)
    procs = [
        start_node(
            [
                "--head",
                f"--port={port}",
                "--num-cpus=2",
                '--resources={"grpo_node_a": 1}',
                "--include-dashboard=false",
                f"--temp-dir={ray_dir}",
            ],
            env,
            tmp_path / "head.log",
        )
    ]
    try:
        procs.append(
            start_node(
                [f"--address={address}", "--num-cpus=2", '--resources={"grpo_node_b": 1}'], env, tmp_path / "worker.log"
            )
        )
        wait_for_nodes([tmp_path / "head.log", tmp_path / "worker.log"], procs)
        yield address, env
    finally:
        stop_nodes(procs)
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_policy_ranks_are_placed_on_both_nodes(two_node_cluster):
    from grpo_train.assets import builtin_model_path

    address, env = two_node_cluster
    model = str(builtin_model_path("arith-tiny"))
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, address, model], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["nodes"] == 2
    assert sorted(r["rank"] for r in report["ranks"]) == [0, 1]
    assert len({r["node_id"] for r in report["ranks"]}) == 2  # STRICT_SPREAD over cluster.num_nodes=2
    assert report["grad_norm"] > 0 and report["loss"] == report["loss"]
