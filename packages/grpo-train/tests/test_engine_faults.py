"""Engine faults survived (grpo_train.engine_faults): `grpo train`'s entry point (`run.train`, in
process, on the session's Ray) with the generation engine's process SIGKILLed mid-step.

The engine is the HF backend (the cheapest real engine with the same protocol and seeding; its
start-up is seconds, where vLLM's is most of a minute), the policy is a real worker, the rewards
come from real environment actors. The oracle is an uninterrupted run of the same config: a
retried step must sample what it would have sampled (per-step seeds, the same prompts, the
current weights pushed into the new engine), so every metric but wall time equals the
uninterrupted run's. Async GRPO runs with max_trajectory_age_steps 0, where it samples what the
sync loop samples (tests/test_e2e_async.py), so the same uninterrupted sync run is its oracle.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import ray
import torch

torch.set_num_threads(1)

PROMPTS, SAMPLES = 4, 4
WALL_TIME = ("timing/", "tokens_per_s", "async/")


def config(steps: int, restarts: int, backend: str = "hf", **grpo):
    from grpo_train.config import validate_config_dict

    raw = {
        "grpo": {
            "num_prompts_per_step": PROMPTS,
            "num_generations_per_prompt": SAMPLES,
            "max_num_steps": steps,
            "seed": 7,
            "val_period": 0,
            "val_at_start": False,
            "val_at_end": False,
            **grpo,
        },
        "policy": {
            "model_name": "builtin:arith-tiny",
            "precision": "float32",
            "train_global_batch_size": 16,
            "train_micro_batch_size": 16,
            "max_total_sequence_length": 32,
            "generation_batch_size": 2,
            "generation": {
                "backend": backend,
                "max_new_tokens": 8,
                "max_engine_restarts": restarts,
                "vllm_cfg": {"max_model_len": 32, "kv_cache_space_gb": 0.25},
            },
        },
        "data": {
            "max_input_seq_length": 16,
            "train": {
                "dataset_name": "arithmetic",
                "size": 1000,
                "seed": 1,
                "digits": 2,
                "processor": "plain",
                "env_name": "arithmetic",
            },
        },
        "env": {"arithmetic": {"num_workers": 1}},
        "loss_fn": {"use_importance_sampling_correction": True},  # as async GRPO requires, in both loops
        "checkpointing": {"enabled": False},
        "logger": {"wandb_enabled": False, "tensorboard_enabled": False, "plot_enabled": False},
    }
    return validate_config_dict(raw), raw


def train(tmp_path, name: str, cfg, raw) -> tuple[int, list[dict]]:
    from grpo_train.run import train as run_train

    run_dir = tmp_path / name
    code = run_train(cfg, raw, name, str(run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return code, [r for r in rows if r["split"] == "train"]


def without_wall_time(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(WALL_TIME)}


def kill_engine_process(engine) -> None:
    """SIGKILL the engine actor's process and wait until it is gone."""
    pid = ray.get(engine.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory):
    code, rows = train(tmp_path_factory.mktemp("straight"), "straight", *config(steps=3, restarts=0))
    assert code == 0 and [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["generation/engine_restarts"] == 0 for r in rows)
    return rows


def test_sync_run_survives_a_killed_engine_then_stops_with_one_line(uninterrupted, tmp_path, monkeypatch, capsys):
    """The engine dies between the two generation calls of step 2 (weights version 1) and again in
    step 3. With one restart allowed: step 2 is retried on a new engine and equals the
    uninterrupted step 2 in every metric, the first call's samples come back bitwise the same;
    step 3's death ends the run with one line, exit 1, and step 3 is never logged."""
    from grpo_train.rollout import single_turn as rollout_module

    real = rollout_module.generate_in_chunks
    chunks: list[tuple[int, list]] = []  # (training generation call number, samples)
    kills = {4, 7}  # before the 2nd call of step 2 (calls 3, 4) and the 2nd call of step 3 (6, 7)

    def generate_in_chunks(generator, prompts, sampling, chunk_size):
        results = []
        for start in range(0, len(prompts), chunk_size):
            call = len(chunks) + 1
            if call in kills:
                kills.discard(call)
                kill_engine_process(generator.engines[0])
            chunk = real(generator, prompts[start : start + chunk_size], sampling, None)
            chunks.append((call, [(r.response_ids, r.response_logprobs) for r in chunk]))
            for r in chunk:
                r.prompt_index += start
            results += chunk
        return results

    monkeypatch.setattr(rollout_module, "generate_in_chunks", generate_in_chunks)
    capsys.readouterr()
    code, rows = train(tmp_path, "killed", *config(steps=3, restarts=1))
    err = capsys.readouterr().err
    assert code == 1
    # Calls: step 1 = 1, 2; step 2 = 3, (killed before 4), retried as 4, 5; step 3 = 6, (killed before 7).
    numbers = [c for c, _ in chunks]
    assert numbers == [1, 2, 3, 4, 5, 6]
    assert chunks[3][1] == chunks[2][1]  # step 2's first call, before and after the restart
    assert [r["step"] for r in rows] == [1, 2]
    for got, expected in zip(rows, uninterrupted[:2]):
        assert without_wall_time({**got, "generation/engine_restarts": 0.0}) == without_wall_time(expected)
    assert [r["generation/engine_restarts"] for r in rows] == [0.0, 1.0]
    said = [line for line in re.split(r"[\r\n]", err) if line.startswith("grpo: ")]  # not the progress bar's
    assert said[-1] == (
        "grpo: run stopped at step 3: generation engine 0 of 1 died during generation "
        "(ActorDiedError) after 1 restart(s) (policy.generation.max_engine_restarts=1); the last "
        "checkpoint stays intact"
    ), err
    assert "Traceback" not in err and err.count("ActorDiedError") == 1, err


def test_async_run_survives_a_killed_engine_under_the_collector(uninterrupted, tmp_path, monkeypatch):
    """Async GRPO, age 0: the engine dies right after the version-1 push, as the collector starts
    step 2's batch on it (and the loop's refit check calls it). The loop restarts it, pushes
    version 1 again and hands it to the collector, which generates the same prompts again: the run
    finishes with the uninterrupted sync run's metrics, one restart, and every step trained on
    exactly its own prompts, once, from the weights before it."""
    from grpo_train import async_loop, setup
    from grpo_train.refit import push_weights

    cfg, raw = config(steps=3, restarts=1, backend="vllm", async_grpo={"enabled": True, "max_trajectory_age_steps": 0})
    hf_cfg, _ = config(steps=3, restarts=1)  # async GRPO's config names vLLM; the engine here is HF all the same
    real_factories = setup.engine_factories
    monkeypatch.setattr(setup, "engine_factories", lambda _cfg, path, policy: real_factories(hf_cfg, path, policy))
    taken = []

    def push_for_collector(cfg, parts, collector, version):
        # The loop's push without the async engine's pause options (the HF engine takes none; with
        # in-flight updates off they change nothing).
        push_weights(parts.policy, version)
        if version == 1:
            kill_engine_process(parts.generator.engines[0])  # before the collector may start step 2's batch with it
        ray.get(collector.weights_loaded.remote(version))

    def take_groups(*args):
        groups = real_take(*args)
        taken.append([(g.target_step, g.weight_version, int(g.datum.idx)) for g in groups])
        return groups

    real_take = async_loop.take_groups
    monkeypatch.setattr(async_loop, "push_for_collector", push_for_collector)
    monkeypatch.setattr(async_loop, "take_groups", take_groups)
    code, rows = train(tmp_path, "async", cfg, raw)
    assert code == 0
    assert [r["generation/engine_restarts"] for r in rows] == [1.0, 1.0, 1.0]
    for got, expected in zip(rows, uninterrupted, strict=True):
        assert {
            k: v for k, v in without_wall_time(got).items() if k in expected and k != "generation/engine_restarts"
        } == without_wall_time({k: v for k, v in expected.items() if k != "generation/engine_restarts"})
    assert [[(t, v) for t, v, _ in step] for step in taken] == [[(s, s - 1)] * PROMPTS for s in (1, 2, 3)]
    indices = [i for step in taken for _, _, i in step]
    assert len(indices) == len(set(indices)) == 3 * PROMPTS


def test_a_dead_engine_of_a_group_is_replaced_alone_with_the_current_weights(ray_session, tiny_qwen2_dir):
    """Two HF engines behind a `GeneratorGroup`, holding pushed weights (version 3, not the model
    folder's). Engine 1's process is killed; the retried call restarts engine 1 only (engine 0 keeps
    its actor), pushes version 3 into it and returns bitwise the samples of the call before the
    kill. A second death with the one restart spent raises `EngineFailed` naming engine 1; an
    error that is not an engine's passes through untouched."""
    from functools import partial
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from grpo_train.engine_faults import EngineFailed, EngineSupervisor
    from grpo_train.generation import SamplingSpec, make_generation_actor
    from grpo_train.generation.group import GeneratorGroup
    from grpo_train.refit.object_store import ObjectStoreTransport
    from grpo_train.refit.tensors import state_dict_for_refit

    class Trainer:  # the policy side of an object-store push: its current weights
        def __init__(self, path: str) -> None:
            model = AutoModelForCausalLM.from_pretrained(path)
            gen = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
            self.state = state_dict_for_refit(model)

        def weights(self):
            return self.state

    class TrainerGroup:
        """The policy group's refit side (`attach`, `submit_weights`) over the trainer actor."""

        def __init__(self, actor) -> None:
            self.actor, self.transport, self.generators = actor, ObjectStoreTransport(1), []

        def attach(self, transport, generators: list) -> None:
            self.transport, self.generators = transport, list(generators)

        def submit_weights(self):
            return self.actor.weights.remote()

    start = partial(make_generation_actor, "hf", tiny_qwen2_dir, num_cpus=1, max_model_len=64, seed=0)
    group = GeneratorGroup([start(), start()])
    trainer = ray.remote(num_cpus=0)(Trainer).remote(tiny_qwen2_dir)
    parts = SimpleNamespace(generator=group, policy=TrainerGroup(trainer), engine_factories=[start, start])
    prompts = [[3 + (5 * i + j) % 60 for j in range(6 + i)] for i in range(4)]

    def sample():
        group.reseed(5)
        return [
            (r.prompt_index, r.response_ids, r.response_logprobs)
            for r in group.generate(prompts, SamplingSpec(max_new_tokens=4, n=2))
        ]

    try:
        group.update_weights(trainer.weights.remote(), 3)
        before = sample()
        first, second = group.engines
        supervisor = EngineSupervisor(parts, max_restarts=1, version=lambda: 3)
        kill_engine_process(second)
        assert supervisor.retry("generation", sample) == before
        assert group.engines[0] is first and group.engines[1] is not second
        assert ray.get([e.weight_version.remote() for e in group.engines]) == [3, 3]
        assert supervisor.metrics() == {"generation/engine_restarts": 1.0}
        with pytest.raises(ValueError, match="not an engine's"):
            supervisor.retry("generation", lambda: (_ for _ in ()).throw(ValueError("not an engine's")))
        kill_engine_process(group.engines[1])
        with pytest.raises(
            EngineFailed,
            match=r"^generation engine 1 of 2 died during generation \(ActorDiedError\) "
            r"after 1 restart\(s\) \(policy.generation.max_engine_restarts=1\)",
        ):
            supervisor.retry("generation", sample)
    finally:
        group.close()
        ray.kill(trainer)


def test_max_engine_restarts_is_refused_below_zero_at_its_key_path():
    from grpo_train.config import validate_config_dict
    from grpo_train.config.errors import ConfigError

    assert (
        validate_config_dict(
            {"policy": {"generation": {"max_engine_restarts": 0}}}
        ).policy.generation.max_engine_restarts
        == 0
    )
    with pytest.raises(ConfigError, match="policy.generation.max_engine_restarts"):
        validate_config_dict({"policy": {"generation": {"max_engine_restarts": -1}}})
