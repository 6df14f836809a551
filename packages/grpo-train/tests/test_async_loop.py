"""The async pipeline's parts on real Ray and vLLM's async engine (CPU build): the collector's
timing rule, weight pushes into the async engine (waiting and in flight, over the object store
and the collective transport), the loop's metrics.

End-to-end async runs (sync equivalence, kill and resume) are in the root tests/test_e2e_async.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from grpo_train.replay_buffer import GroupEntry

torch.set_num_threads(1)

STEPS = 4
PROMPTS = 4
SAMPLES = 4


@pytest.fixture(scope="module")
def cfg():
    from grpo_train.config.schema import GRPOMasterConfig

    return GRPOMasterConfig.model_validate(
        {
            "grpo": {
                "num_prompts_per_step": PROMPTS,
                "num_generations_per_prompt": SAMPLES,
                "max_num_steps": STEPS,
                "seed": 7,
                "async_grpo": {"enabled": True, "max_trajectory_age_steps": 1},
            },
            "loss_fn": {"use_importance_sampling_correction": True},
            "policy": {
                "model_name": "builtin:arith-tiny",
                "train_global_batch_size": 16,
                "train_micro_batch_size": 16,
                "max_total_sequence_length": 32,
                "generation": {"max_new_tokens": 8, "vllm_cfg": {"max_model_len": 32, "kv_cache_space_gb": 0.25}},
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
        }
    )


@pytest.fixture(scope="module")
def model_path():
    from grpo_train.assets import builtin_model_path

    return str(builtin_model_path("arith-tiny"))


@pytest.fixture(scope="module")
def engine(ray_session, model_path):
    from grpo_train.generation.async_vllm import make_async_generation_actor

    actor = make_async_generation_actor(model_path, dtype="float32", max_model_len=32, seed=7, kv_cache_space_gb=0.25)
    ray_session.get(actor.ready.remote())
    yield actor
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


def perturbed_weights(model_path: str, seed: int):
    """(HF-named weights to push, the HF model holding them)."""
    from transformers import AutoModelForCausalLM

    from grpo_train.refit.tensors import state_dict_for_refit

    model = AutoModelForCausalLM.from_pretrained(model_path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return state_dict_for_refit(model), model


def wait_until(predicate, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_collector_stays_within_the_age_bound_and_pushes_wait_for_older_batches(ray_session, cfg, model_path, engine):
    from transformers import AutoTokenizer

    from grpo_train.collector import SharedParts, make_collector_actor
    from grpo_train.generation.group import GeneratorGroup
    from grpo_train.replay_buffer import make_replay_buffer_actor
    from grpo_train.setup import build_datasets, build_envs

    ray = ray_session
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    envs = build_envs(cfg)  # the driver's pools: the collector calls their actors
    shared = SharedParts(tokenizer, build_datasets(cfg, tokenizer)[0], envs)
    buffer = make_replay_buffer_actor(max_age=1)
    collector = make_collector_actor(
        cfg, shared, GeneratorGroup([engine]), buffer, STEPS, next_target=1, version=0, dataloader_state=None
    )
    try:
        ray.get(collector.start.remote())
        # Steps 1 and 2 need versions >= -1 and >= 0: both come from version 0, then it waits.
        wait_until(lambda: ray.get(buffer.count.remote(2)) == PROMPTS)
        time.sleep(1.0)
        assert ray.get(buffer.count.remote(3)) == 0 and ray.get(collector.stats.remote())["next_target"] == 3
        weights, _ = perturbed_weights(model_path, seed=1)
        for version in (1, 2):  # train step `version`, then push; step version + 2 may then start
            taken = ray.get(buffer.take.remote(version, version - 1, PROMPTS))
            assert taken.stale == [] and [len(g.rollouts) for g in taken.fresh] == [SAMPLES] * PROMPTS
            ray.get(collector.hold.remote(version))
            ray.get(engine.update_weights.remote(weights, version))
            ray.get(collector.weights_loaded.remote(version))
            ray.get(collector.release.remote())
        wait_until(lambda: ray.get(buffer.count.remote(4)) == PROMPTS)
        entries: list[GroupEntry] = ray.get(buffer.state_dict.remote())["entries"]
        assert sorted({(e.target_step, e.weight_version) for e in entries}) == [(3, 1), (4, 2)]
        assert all(r["age"] <= 1 for r in ray.get(buffer.state_dict.remote())["records"])
        stats = ray.get(collector.stats.remote())
        assert stats["batches"] == STEPS and stats["idle_s"] > 0.5  # it waited for the weights
    finally:
        ray.get(collector.shutdown.remote())
        ray.kill(collector)
        ray.kill(buffer)
        for pool in envs.values():
            pool.shutdown()


def test_in_flight_weight_push_lands_while_a_batch_decodes(ray_session, model_path, engine):
    """The push returns while long requests are still running; they finish; new requests and
    scores see the new weights (checked against the HF model)."""
    from grpo_train.generation.base import SamplingSpec

    ray = ray_session
    weights, model = perturbed_weights(model_path, seed=2)
    prompts = [[3, 4, 5, 6]] * 8
    running = engine.generate.remote(prompts, SamplingSpec(max_new_tokens=24, n=16))
    wait_until(lambda: ray.get(engine.num_running.remote()) > 0)
    ray.get(engine.update_weights.remote(weights, 5, True, True))
    assert ray.get(engine.weight_version.remote()) == 5
    assert len(ray.get(running)) == 8 * 16
    sequences = [[3, 4, 5, 6, 7, 8, 9, 10]]
    scored = ray.get(engine.score.remote(sequences, [4]))[0]
    with torch.no_grad():
        logits = model(torch.tensor(sequences)).logits[0].float()
    expected = torch.log_softmax(logits, -1)[3:7].gather(-1, torch.tensor([[7], [8], [9], [10]]))[:, 0]
    assert torch.allclose(torch.tensor(scored), expected, atol=1e-4)


def test_collective_push_into_the_async_engine_equals_the_object_store_push(ray_session, model_path, engine, tmp_path):
    """A real policy worker holding other weights broadcasts them in buckets over gloo into the
    async engine's worker, around the same pause as an object-store push. Before the push the
    engine's scores differ from the trainer's; after it, its samples and scores equal bitwise
    those after an object-store push of the same weights, and the trainer's scores to 1e-5. A
    push in flight (requests frozen mid-decode) lands too."""
    from transformers import AutoModelForCausalLM

    from grpo_train.config.schema import ClusterConfig, LossConfig, PolicyConfig
    from grpo_train.generation.base import SamplingSpec
    from grpo_train.policy.group import PolicyGroup
    from grpo_train.refit import make_transport
    from grpo_train.refit.check import check_refit
    from grpo_train.refit.tensors import state_dict_for_refit

    ray = ray_session
    weights, model = perturbed_weights(model_path, seed=3)
    model.save_pretrained(tmp_path / "trainer")  # the trainer starts from the perturbed weights
    policy = PolicyGroup(
        str(tmp_path / "trainer"),
        PolicyConfig(precision="float32", train_global_batch_size=4, train_micro_batch_size=4),
        LossConfig(reference_policy_kl_penalty=0.0),
        ClusterConfig(),
        seed=0,
    )
    probe, probe_lens = [[3, 4, 5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10, 11, 12]], [4, 4]

    def sample() -> tuple[list, list]:
        ray.get(engine.reseed.remote(11))
        out = ray.get(engine.generate.remote([[3, 4, 5, 6], [4, 5, 6]], SamplingSpec(max_new_tokens=8, n=4)))
        return [(r.response_ids, r.response_logprobs) for r in out], ray.get(engine.score.remote(probe, probe_lens))

    try:
        ray.get(
            engine.update_weights.remote(state_dict_for_refit(AutoModelForCausalLM.from_pretrained(model_path)), 20)
        )
        _, scores_before = sample()
        transport = make_transport("collective", 16 / (1 << 20))  # 16 KiB buckets: hundreds per push
        transport.connect(policy, [engine])
        transport.push(policy, [engine], 21, in_flight=False, reset_running_kv=False)
        assert ray.get(engine.weight_version.remote()) == 21
        over_collective = sample()
        ray.get(engine.update_weights.remote(weights, 22))
        assert sample() == over_collective  # object store, same weights: bitwise the same
        trainer_scores = policy.score(probe, probe_lens)
        assert check_refit(trainer_scores, scores_before, float("inf")) > 1e-2
        assert check_refit(trainer_scores, over_collective[1], float("inf")) <= 1e-5

        running = engine.generate.remote([[3, 4, 5, 6]] * 8, SamplingSpec(max_new_tokens=24, n=16))
        wait_until(lambda: ray.get(engine.num_running.remote()) > 0)
        transport.push(policy, [engine], 23, in_flight=True, reset_running_kv=True)
        assert ray.get(engine.weight_version.remote()) == 23
        assert len(ray.get(running)) == 8 * 16
    finally:
        policy.close()


def test_async_config_refuses_the_ipc_transport_naming_the_key(cfg):
    from pydantic import ValidationError

    from grpo_train.config.schema import GRPOMasterConfig

    raw = cfg.model_dump()
    raw["policy"]["generation"]["weight_transport"] = "collective"
    assert GRPOMasterConfig.model_validate(raw).policy.generation.weight_transport == "collective"
    raw["policy"]["generation"]["weight_transport"] = "ipc"
    with pytest.raises(ValidationError, match="policy.generation.weight_transport 'ipc'"):
        GRPOMasterConfig.model_validate(raw)


def test_pipeline_metrics():
    from grpo_train.async_loop import pipeline_metrics
    from grpo_train.step import PhaseTimer

    groups = [GroupEntry(5, 4, 0, None), GroupEntry(5, 3, 1, None)]
    timer = PhaseTimer()
    timer.add("wait_for_groups", 0.5)
    before = {"idle_s": 1.0, "generate_s": 2.0}
    metrics = pipeline_metrics(groups, 3, {"idle_s": 1.25, "generate_s": 3.0}, before, timer, push_wait=0.25)
    assert metrics["async/trajectory_age_mean"] == 0.5 and metrics["async/trajectory_age_max"] == 1.0
    assert metrics["async/buffer_size"] == 3.0 and metrics["async/generation_idle_s"] == 0.25
    assert metrics["async/trainer_starvation_s"] == 0.5 and metrics["async/exposed_generation_s"] == 0.75
    assert metrics["timing/generate_s"] == 1.0
