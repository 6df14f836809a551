"""Colocated memory choreography: the order of moves on a GPU the trainer and the engine share,
proven on CPU by a recorded lifecycle trace.

The real sync GRPO, PPO and async GRPO loops run two steps against recording fakes (a policy
group, a generator group, a value group; the async loop's collector and buffer actors with Ray's
`get`/`put` replaced by the identity), so each fake records what it is asked to do in the order
the loop asks: offload / reload / sleep / wake /
generate / logprobs / train / push / validate / save. The expected sequences below are written by
hand from the order colocation.py documents; the choreography's own trace must agree with what the
actors received. Then: the phase rule (active only when colocated on GPUs), the per-part moves
(every tensor of each part leaves the device; checked on the meta device), and the memory
arithmetic (grpo_train.plan's colocated peak is the largest phase, not the sum).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import torch

from grpo_train import async_loop, engine_faults, sync_loop
from grpo_train import step as shared_step
from grpo_train.colocation import FULL_OFFLOAD, REFIT_OFFLOAD, MemoryChoreography, colocated_on_gpus
from grpo_train.config.schema import GRPOMasterConfig
from grpo_train.policy.offload import move_parts, state_tensors
from grpo_train.policy.precision import MasterWeights
from grpo_train.ppo import ppo_loop
from grpo_train.run_state import TrainerState


class _Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class Recorder:
    """A fake group (plain methods) or, with `actor=True`, a fake actor (`.remote`): each listed
    method appends (event, detail) to the shared trace."""

    def __init__(self, trace: list, actor: bool = False, **methods):
        for name, event in methods.items():
            fn = self._recording(trace, event)
            setattr(self, name, _Call(fn) if actor else fn)

    @staticmethod
    def _recording(trace, event):
        def fn(*args, **kwargs):
            if event is not None:
                detail = ",".join(args[0]) if event == "offload" else "ref" if kwargs.get("reference") else ""
                trace.append((event, detail))
            if event == "logprobs_and_reference":
                return torch.zeros(2, 2, 3)  # [2, B, S]: prev and ref in one call
            return {} if event in ("train", "value_train") else torch.zeros(2, 3) if event == "logprobs" else None

        return fn


def fake_run(trace: list, value: bool = False):
    policy = Recorder(
        trace,
        offload="offload",
        reload="reload",
        logprobs="logprobs",
        train="train",
        logprobs_and_reference="logprobs_and_reference",
    )
    policy.start = lambda: trace.append(("trainer_start", ""))
    engine = Recorder(trace, ready="engine_ready", sleep="sleep", wake_up="wake", reseed=None)
    memory = MemoryChoreography(policy, engine, active=True)
    data = SimpleNamespace(state_dict=dict, load_state_dict=lambda state: None)  # the loop rewinds on a retry
    parts = SimpleNamespace(
        policy=policy,
        generator=engine,
        memory=memory,
        train_data=data,
        tokenizer=SimpleNamespace(pad_token_id=0),
        val_datums=[1],
        value=Recorder(trace, train="value_train") if value else None,
        extra_workers={},
    )
    return parts, memory


@pytest.fixture
def recorded(monkeypatch):
    """The loops' phases outside the choreography, as recorded events (or no-ops)."""
    trace: list = []
    rollout = SimpleNamespace(rollouts=[], generate_s=0.0, reward_s=0.0, env_metrics={})
    batch = lambda *a, **k: ({"input_ids": torch.zeros(2, 3)}, {})  # noqa: E731
    # The loops' shared phases are step.py's (generation, weight push, validation, checkpoint), and
    # all check through engine_faults.
    monkeypatch.setattr(
        shared_step, "collect_rollouts", lambda *a, **k: (trace.append(("generate", "")), rollout)[1:] + ({},)
    )
    monkeypatch.setattr(engine_faults, "check_refit", lambda *a, **k: trace.append(("refit_check", "")) or {})
    monkeypatch.setattr(shared_step, "push_weights", lambda *a, **k: trace.append(("push", "")))
    monkeypatch.setattr(shared_step, "run_validation", lambda *a, **k: trace.append(("validate", "")) or {})
    monkeypatch.setattr(sync_loop, "prepare_batch", batch)
    monkeypatch.setattr(sync_loop, "add_advantages", lambda *a, **k: {})
    monkeypatch.setattr(shared_step, "save_checkpoint", lambda *a, **k: trace.append(("save", "")))
    monkeypatch.setattr(ppo_loop, "prepare_ppo_batch", batch)
    monkeypatch.setattr(ppo_loop, "mask_by_logprob_error", lambda *a, **k: {})
    monkeypatch.setattr(ppo_loop, "add_values_and_advantages", lambda *a, **k: trace.append(("values", "")) or {})
    monkeypatch.setattr(ray, "get", lambda x, **k: x)
    monkeypatch.setattr(ray, "put", lambda x, **k: x)
    return trace


def config(**grpo) -> GRPOMasterConfig:
    return GRPOMasterConfig(
        grpo={"max_num_steps": 2, "val_period": 1, "val_at_start": True, **grpo}, checkpointing={"save_period": 1}
    )


LOGGER = SimpleNamespace(log=lambda *a, **k: None, log_samples=lambda *a, **k: None)
START = [("engine_ready", ""), ("sleep", ""), ("trainer_start", "")]
FULL, REFIT = ("offload", ",".join(FULL_OFFLOAD)), ("offload", ",".join(REFIT_OFFLOAD))
TO_GENERATION_FROM_START = [FULL, ("wake", "")]  # trainer resident, engines asleep
TO_TRAINING = [("sleep", ""), ("reload", "")]
TO_REFIT = [REFIT, ("wake", "")]
TO_GENERATION_FROM_REFIT = [("offload", "weights")]  # the rest is on the host already, engines awake
END_OF_STEP = [*TO_GENERATION_FROM_REFIT, ("validate", ""), *TO_TRAINING, ("save", "")]


def moves(trace):
    return [e for e in trace if e[0] in ("offload", "reload", "sleep", "wake", "engine_ready", "trainer_start")]


def issued(memory):
    """The choreography's own trace (a reload names what it brings back; the fake records no argument)."""
    return [(e, "" if e == "reload" else d) for e, d in memory.trace]


def test_sync_grpo_order(recorded):
    parts, memory = fake_run(recorded)
    memory.start_engines_first()
    sync_loop.train_sync(config(), parts, LOGGER, object(), TrainerState())
    # one worker, one optimizer step, no reader of prev or ref before training: prev comes from the
    # training forward and ref from the train call's own reference forward (train_step.reuses_prev_logprobs)
    step = [("generate", ""), *TO_TRAINING, ("train", ""), *TO_REFIT, ("push", ""), ("refit_check", ""), *END_OF_STEP]
    assert recorded == [
        *START,
        *TO_GENERATION_FROM_START,
        ("validate", ""),
        *step,  # step 1 (generation phase already entered for the validation)
        *TO_GENERATION_FROM_START,
        *step,
    ]  # step 2 starts from the checkpoint's training phase
    assert issued(memory) == moves(recorded)  # the hook's record is what the actors received


def test_ppo_order_is_the_sync_order_with_values(recorded):
    parts, memory = fake_run(recorded, value=True)
    memory.start_engines_first()
    cfg = GRPOMasterConfig(
        grpo={"max_num_steps": 2, "val_period": 1, "val_at_start": True},
        checkpointing={"save_period": 1},
        value={},
        ppo={"ppo_epochs": 1},
        loss_fn={"reference_policy_kl_penalty": 0.0},
    )
    ppo_loop.train_ppo(cfg, parts, LOGGER, object(), TrainerState())
    step = [
        ("generate", ""),
        *TO_TRAINING,
        ("logprobs", ""),
        ("values", ""),
        ("value_train", ""),
        ("train", ""),
        *TO_REFIT,
        ("push", ""),
        ("refit_check", ""),
        *END_OF_STEP,
    ]
    assert recorded == [*START, *TO_GENERATION_FROM_START, ("validate", ""), *step, *TO_GENERATION_FROM_START, *step]
    assert issued(memory) == moves(recorded)


def test_async_grpo_calls_the_same_phases_at_the_trainer_points(recorded, monkeypatch):
    """Async GRPO's engine never shares the trainer's GPUs (refused by the schema, and
    `colocated_on_gpus` is false), so in a real run these calls issue nothing; driven with an active
    choreography, the trainer side follows the sync order (generation is the collector's, not the loop's)."""
    parts, memory = fake_run(recorded)
    memory.start_engines_first()
    collector = Recorder(recorded, actor=True, start=None, stats=None, hold=None, release=None, shutdown=None)
    collector.stats = _Call(lambda: {"idle_s": 0.0, "generate_s": 0.0})
    collector.hold = _Call(lambda *a: 0.0)  # seconds waited (None would mean the engine died under it)
    buffer = Recorder(recorded, actor=True, size=None)
    group = SimpleNamespace(rollouts=[], epoch=0, env_metrics={})
    monkeypatch.setattr(async_loop, "make_collector", lambda *a, **k: (buffer, collector))
    monkeypatch.setattr(async_loop, "take_groups", lambda *a, **k: (recorded.append(("take_groups", "")), [group])[1])
    monkeypatch.setattr(async_loop, "push_for_collector", lambda *a, **k: recorded.append(("push", "")))
    monkeypatch.setattr(async_loop, "prepare_batch", lambda *a, **k: ({"input_ids": torch.zeros(2, 3)}, {}))
    monkeypatch.setattr(async_loop, "add_advantages", lambda *a, **k: {})
    monkeypatch.setattr(async_loop, "pipeline_metrics", lambda *a, **k: {})
    monkeypatch.setattr(async_loop, "save_async_checkpoint", lambda *a, **k: recorded.append(("save", "")))
    monkeypatch.setattr(async_loop, "stop_collector", lambda *a, **k: None)
    cfg = GRPOMasterConfig(
        grpo={"max_num_steps": 2, "val_period": 1, "val_at_start": True, "async_grpo": {"enabled": True}},
        checkpointing={"save_period": 1},
        loss_fn={"use_importance_sampling_correction": True},
    )
    async_loop.train_async(cfg, parts, LOGGER, object(), TrainerState())  # async: prev and ref in one call

    def step(to_training):
        return [
            ("take_groups", ""),
            *to_training,
            ("logprobs_and_reference", ""),
            ("train", ""),
            *TO_REFIT,
            ("push", ""),
            ("refit_check", ""),
            *END_OF_STEP,
        ]

    # step 2 starts in the checkpoint's training phase: no rollout phase in this loop to leave it
    assert recorded == [*START, *TO_GENERATION_FROM_START, ("validate", ""), *step(TO_TRAINING), *step([])]
    assert issued(memory) == moves(recorded)


def test_inactive_choreography_issues_nothing(recorded):
    """CPU runs (and separate engines, and async GRPO): the loop runs as before, with no move at all."""
    parts, _ = fake_run(recorded)
    parts.memory = None  # components built without one -> MemoryChoreography.of gives an inactive one
    sync_loop.train_sync(config(), parts, LOGGER, object(), TrainerState())
    assert moves(recorded) == []
    assert [e for e, _ in recorded].count("train") == 2


def test_active_exactly_when_colocated_on_gpus():
    def cfg(gpus: int, colocated: bool, is_async: bool = False) -> GRPOMasterConfig:
        return GRPOMasterConfig.model_construct(**GRPOMasterConfig().model_copy(deep=True).__dict__).model_copy(
            update={
                "cluster": GRPOMasterConfig().cluster.model_copy(update={"gpus_per_node": gpus}),
                "policy": GRPOMasterConfig().policy.model_copy(
                    update={
                        "generation": GRPOMasterConfig().policy.generation.model_copy(
                            update={
                                "colocated": GRPOMasterConfig().policy.generation.colocated.model_copy(
                                    update={"enabled": colocated}
                                )
                            }
                        )
                    }
                ),
                "grpo": GRPOMasterConfig().grpo.model_copy(
                    update={"async_grpo": GRPOMasterConfig().grpo.async_grpo.model_copy(update={"enabled": is_async})}
                ),
            }
        )

    assert colocated_on_gpus(cfg(1, True))
    assert not colocated_on_gpus(cfg(0, True))  # the CPU default: nothing moves
    assert not colocated_on_gpus(cfg(2, False))  # separate engines
    assert not colocated_on_gpus(cfg(2, True, is_async=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_part_moves_every_tensor_it_names(dtype):
    """On the meta device, so that a tensor left behind shows (CPU to CPU would move nothing)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 10))
    model.register_buffer("table", torch.arange(4.0))
    reference = torch.nn.Linear(4, 10)
    master = MasterWeights(model, dtype)
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-3)
    model(torch.tensor([1, 2])).float().sum().backward()
    master.accumulate()
    optimizer.step()  # optimizer state exists, gradients stay set
    before = state_tensors(model, master.parameters(), optimizer, reference)
    assert all(before[p] for p in ("weights", "gradients", "optimizer", "reference"))

    move_parts(REFIT_OFFLOAD, "meta", model, master.parameters(), optimizer, reference)
    after = state_tensors(model, master.parameters(), optimizer, reference)
    assert after["gradients"] == []  # freed: torch keeps a gradient on its parameter's device
    assert all(t.is_meta for part in REFIT_OFFLOAD for t in after[part])
    assert not any(t.is_meta for t in after["weights"])  # the weights stay for the push
    move_parts(("weights",), "meta", model, master.parameters(), optimizer, reference)
    after = state_tensors(model, master.parameters(), optimizer, reference)
    assert all(t.is_meta for part in FULL_OFFLOAD for t in after[part])
    assert all(isinstance(s["step"], torch.Tensor) and not s["step"].is_meta for s in optimizer.state.values())
    assert optimizer.param_groups[0]["params"][0] is master.parameters()[0]  # same Parameter objects
