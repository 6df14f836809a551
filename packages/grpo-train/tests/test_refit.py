"""Weight refit into a running generator: a real vLLM engine (CPU build) in this process, and
through real Ray actors (slow test).

The oracle is the trainer's own model: after a push, the engine's logprobs on fixed sequences
must equal log_softmax(trainer logits / T) within 1e-4 (fp32), and before the push they must not
(so the check proves the new weights are live, the tied lm_head included)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from grpo_train.generation import HFGenerator, SamplingSpec, VllmGenerator, make_generation_actor
from grpo_train.refit.check import RefitMismatchError, check_refit
from grpo_train.refit.object_store import serialize_weights
from grpo_train.refit.tensors import state_dict_for_refit

TEMPERATURE = 0.7
MAX_MODEL_LEN = 256
ATOL = 1e-4
KV_GB = 0.25  # a quarter GiB of KV cache is thousands of tokens for this model
# Longer than one KV block (128 tokens on vLLM's CPU backend), so that a prefix cache kept from
# the old weights would be hit after a refit.
PROBE_PROMPTS = [[3 + (7 * i) % 60 for i in range(150)], [3 + (11 * i) % 60 for i in range(140)]]


def trainer_logprobs(model, sequences, prompt_lens, temperature=TEMPERATURE):
    """What the trainer computes: log_softmax(logits / T) on the response tokens."""
    out = []
    with torch.no_grad():
        for seq, plen in zip(sequences, prompt_lens):
            logits = model(torch.tensor([seq])).logits[0].float()  # [S, V]
            lp = torch.log_softmax(logits / temperature, dim=-1)[plen - 1 : -1]
            out.append(lp.gather(-1, torch.tensor(seq[plen:])[:, None])[:, 0].tolist())
    return out


def diff(a, b) -> float:
    return check_refit(a, b, threshold=float("inf"))


def trained_copy(model, steps: int = 3, lr: float = 1e-2, seed: int = 1):
    """The model after a few AdamW steps on random token sequences: every weight moves."""
    trained = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(trained.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, 64, (4, 24), generator=gen)
        loss = trained(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return trained.eval()


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_dir):
    return tiny_qwen2_dir


@pytest.fixture(scope="module")
def base_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


_LIVE_ENGINES: list[VllmGenerator] = []  # so the Ray test can stop this module's engine first


@pytest.fixture(scope="module")
def vllm_gen(model_dir):
    gen = VllmGenerator(
        model_dir, max_model_len=MAX_MODEL_LEN, temperature_for_logprobs=TEMPERATURE, kv_cache_space_gb=KV_GB
    )
    _LIVE_ENGINES.append(gen)
    yield gen
    gen.shutdown()
    _LIVE_ENGINES.remove(gen)


def direct(generator):
    """Call a generator's method in this process."""
    return lambda method, *args: getattr(generator, method)(*args)


def through_ray(ray, actor):
    """Call a generation actor's method through Ray and wait for it."""
    return lambda method, *args: ray.get(getattr(actor, method).remote(*args))


def check_refit_takes_effect(call, base_model, version: int, seed: int) -> dict[str, float]:
    """Generate with the current weights, push trained weights, and compare score and fresh
    samples with the trainer; returns the measured numbers."""
    sampling = SamplingSpec(temperature=TEMPERATURE, max_new_tokens=16, n=2)
    trained = trained_copy(base_model, seed=seed)
    before = call("generate", PROBE_PROMPTS, sampling)
    seqs = [r.prompt_ids + r.response_ids for r in before]
    plens = [len(r.prompt_ids) for r in before]
    expected = trainer_logprobs(trained, seqs, plens)
    stale = call("score", seqs, plens)
    stale_diff = diff(expected, stale)
    assert stale_diff > 0.05, "the optimizer steps did not move the logprobs enough to test refit"
    with pytest.raises(RefitMismatchError, match="threshold"):
        check_refit(expected, stale, ATOL)

    start = time.perf_counter()
    engine_seconds = call("update_weights", state_dict_for_refit(trained), version)
    round_trip = time.perf_counter() - start
    assert call("weight_version") == version

    score_diff = check_refit(expected, call("score", seqs, plens), ATOL)
    # Same prompts again: a prefix cache kept from the old weights would show here.
    after = call("generate", PROBE_PROMPTS, sampling)
    seqs2 = [r.prompt_ids + r.response_ids for r in after]
    plens2 = [len(r.prompt_ids) for r in after]
    sample_diff = check_refit(trainer_logprobs(trained, seqs2, plens2), [r.response_logprobs for r in after], ATOL)
    return {
        "engine_s": engine_seconds,
        "round_trip_s": round_trip,
        "before": stale_diff,
        "score_after": score_diff,
        "samples_after": sample_diff,
    }


def report(label: str, m: dict[str, float]) -> None:
    print(
        f"\n[measure] {label}: refit {m['engine_s'] * 1e3:.0f} ms in the generator, "
        f"{m['round_trip_s'] * 1e3:.0f} ms round trip; max |dlogprob| before {m['before']:.3f}, "
        f"after: score {m['score_after']:.2e}, samples {m['samples_after']:.2e}"
    )


def test_vllm_refit_takes_effect(vllm_gen, base_model):
    report("vllm in-process", check_refit_takes_effect(direct(vllm_gen), base_model, 1, seed=1))


def test_refit_of_tied_embedding_reaches_lm_head(vllm_gen, base_model):
    model = copy.deepcopy(base_model)
    old_embedding = model.model.embed_tokens.weight.detach().clone()
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.2 * torch.randn_like(old_embedding))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    weights = state_dict_for_refit(model)
    assert "lm_head.weight" not in weights

    seqs = [p + [5, 6, 7, 8, 9, 10] for p in PROBE_PROMPTS]
    plens = [len(p) for p in PROBE_PROMPTS]
    expected = trainer_logprobs(model, seqs, plens)
    # What a stale lm_head would give: new hidden states, old output embedding.
    with torch.no_grad():
        stale_head = []
        for seq, plen in zip(seqs, plens):
            hidden = model.model(torch.tensor([seq])).last_hidden_state[0]  # [S, H]
            lp = torch.log_softmax(hidden @ old_embedding.T / TEMPERATURE, dim=-1)[plen - 1 : -1]
            stale_head.append(lp.gather(-1, torch.tensor(seq[plen:])[:, None])[:, 0].tolist())
    assert diff(expected, stale_head) > 0.05, "noise too small to tell a stale lm_head apart"

    vllm_gen.update_weights(weights, 2)
    assert check_refit(expected, vllm_gen.score(seqs, plens), ATOL) < ATOL


def test_refit_as_safetensors_bytes(vllm_gen, base_model):
    """The transport used when the engine's workers live in other processes."""
    trained = trained_copy(base_model, seed=3)
    seqs = [p + [11, 12, 13] for p in PROBE_PROMPTS]
    plens = [len(p) for p in PROBE_PROMPTS]
    blob = serialize_weights(state_dict_for_refit(trained))
    assert isinstance(blob, bytes)
    vllm_gen.llm.collective_rpc("grpo_receive_object_store", args=(blob,))
    vllm_gen.llm.reset_prefix_cache()
    check_refit(trainer_logprobs(trained, seqs, plens), vllm_gen.score(seqs, plens), ATOL)


def test_hf_generator_refit_takes_effect(model_dir, base_model):
    gen = HFGenerator(model_dir, max_model_len=MAX_MODEL_LEN, temperature_for_logprobs=TEMPERATURE)
    report("hf in-process", check_refit_takes_effect(direct(gen), base_model, 5, seed=4))


# Tests that push into `vllm_gen` must come before test_generation_actors_through_ray, which shuts it down,
# and before any test that starts and shuts down an engine of its own (vLLM's shutdown tears down the
# process-wide parallel state the module's engine runs on).
def trained_lora_worker(model_dir, refit: str = "merged"):
    """A LoRA policy worker (dim 4, alpha 8) after two AdamW steps: its adapters are non-zero."""
    from grpo_train.config.schema import LossConfig, PolicyConfig
    from grpo_train.policy.worker import PolicyWorker

    cfg = PolicyConfig(
        precision="float32",
        train_global_batch_size=4,
        train_micro_batch_size=4,
        logprob_batch_size=4,
        max_grad_norm=None,
        generation={"temperature": TEMPERATURE},
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 5e-2, "weight_decay": 0.0}},
        dtensor_cfg={"lora_cfg": {"enabled": True, "dim": 4, "alpha": 8, "refit": refit}},
    )
    worker = PolicyWorker(model_dir, cfg, LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        train_lora_step(worker, gen)
    return worker


def train_lora_step(worker, gen: torch.Generator) -> None:
    ids = torch.randint(3, 64, (4, 24), generator=gen)
    mask = torch.ones_like(ids)
    token_mask = mask.float()
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "token_mask": token_mask,
        "sample_mask": torch.ones(4),
        "gen_logprobs": torch.zeros(4, 24),
        "advantages": torch.randn(4, 1, generator=gen) * token_mask,
    }
    worker.train(batch)


def lora_probe(worker) -> tuple[list[list[int]], list[int], list[list[float]]]:
    """Probe sequences, their prompt lengths and the LoRA worker's scores of them; checks that the
    adapters moved the policy away from the base (else agreeing with the trainer proves nothing)."""
    seqs = [p + [5, 6, 7, 8, 9, 10] for p in PROBE_PROMPTS]
    plens = [len(p) for p in PROBE_PROMPTS]
    expected = worker.score(seqs, plens)
    with torch.no_grad():
        base = worker.logprobs(
            {"input_ids": torch.tensor([seqs[0]]), "attention_mask": torch.ones(1, len(seqs[0]))}, reference=True
        )[0, plens[0] :].tolist()
    assert diff([expected[0]], [base]) > 0.05
    return seqs, plens, expected


def test_lora_merged_refit_passes_the_gate(vllm_gen, model_dir):
    """LoRA (policy.dtensor_cfg.lora_cfg, refit: merged): the engine gets plain base-named
    weights with B.A merged in, and scores like the trainer's adapted model within the fp32
    gate; the trainer's own weights are bitwise the same after the push (no merge left behind)."""
    from grpo_train.refit.check import DEFAULT_LIMITS, gate_refit

    worker = trained_lora_worker(model_dir)
    seqs, plens, expected = lora_probe(worker)
    before = {k: v.clone() for k, v in worker.model.state_dict().items()}
    weights = worker.weights()
    assert not any(".lora_" in k or ".base_layer" in k for k in weights)
    vllm_gen.update_weights(weights, 11)
    assert all(torch.equal(before[k], v) for k, v in worker.model.state_dict().items())
    stats = gate_refit(expected, vllm_gen.score(seqs, plens), DEFAULT_LIMITS["float32"])
    print(f"\n[measure] LoRA merged refit: max |dlogprob| {stats.max_abs_diff:.2e}, mean {stats.mean_abs_diff:.2e}")


class InProcess:
    """The in-process engine behind an actor's `.method.remote(...)` calls (ObjectRef arguments resolved
    as Ray resolves them for an actor), so the weight transports' own code drives it."""

    def __init__(self, generator) -> None:
        self.generator = generator

    def __getattr__(self, method: str):
        import ray

        def remote(*args, **kwargs):
            args = [ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args]
            return ray.put(getattr(self.generator, method)(*args, **kwargs))

        return type("Method", (), {"remote": staticmethod(remote)})


@pytest.mark.slow
def test_refit_from_a_tensor_parallel_trainer_passes_the_gate(ray_session, vllm_gen, model_dir, base_model):
    """policy.dtensor_cfg.tensor_parallel_size 2 (two Ray actors, a gloo TP mesh, DTensor-sharded weights)
    after one SGD step, pushed over each CPU transport's own code into the real engine: the engine's
    logprobs pass the fp32 gate against the TP trainer's own (vocab-parallel) scores, and fail it before
    each push (the engine is first put back on the starting weights)."""
    from grpo_train.config.schema import ClusterConfig, DTensorConfig, LossConfig, PolicyConfig
    from grpo_train.policy.group import PolicyGroup
    from grpo_train.refit import push_weights
    from grpo_train.refit.check import DEFAULT_LIMITS, gate_refit, refit_stats
    from grpo_train.refit.collective import CollectiveTransport
    from grpo_train.refit.object_store import ObjectStoreTransport

    cfg = PolicyConfig(
        precision="float32",
        train_global_batch_size=4,
        train_micro_batch_size=4,
        logprob_batch_size=4,
        max_grad_norm=None,
        num_workers=2,
        generation={"temperature": TEMPERATURE},
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
        dtensor_cfg=DTensorConfig(tensor_parallel_size=2),
    )
    group = PolicyGroup(model_dir, cfg, LossConfig(reference_policy_kl_penalty=0.0), ClusterConfig(), seed=0)
    try:
        ids = torch.randint(3, 64, (4, 24), generator=torch.Generator().manual_seed(5))
        mask = torch.ones_like(ids)
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "token_mask": mask.float(),
            "sample_mask": torch.ones(4),
            "gen_logprobs": torch.zeros(4, 24),
            "advantages": torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]) * mask,
        }
        group.train({**batch, "prev_logprobs": group.logprobs(batch)})
        seqs = [p + [5, 6, 7, 8, 9, 10] for p in PROBE_PROMPTS]
        plens = [len(p) for p in PROBE_PROMPTS]
        trainer = group.score(seqs, plens)
        start = state_dict_for_refit(base_model)
        for version, transport in enumerate((ObjectStoreTransport(64 * 1024), CollectiveTransport(64 * 1024)), 21):
            vllm_gen.update_weights(start, version - 10)
            assert refit_stats(trainer, vllm_gen.score(seqs, plens)).max_abs_diff > 0.05, "the step moved too little"
            group.attach(transport, [InProcess(vllm_gen)])
            push_weights(group, version)
            assert vllm_gen.weight_version() == version
            stats = gate_refit(trainer, vllm_gen.score(seqs, plens), DEFAULT_LIMITS["float32"])
            print(f"\n[measure] TP=2 trainer -> engine over {transport.name}: max |dlogprob| {stats.max_abs_diff:.2e}")
    finally:
        group.close()


def test_generation_actors_through_ray(ray_session, model_dir, base_model):
    """generate / update_weights / score / reseed via .remote() on a vLLM actor, then an HF one."""
    ray = ray_session
    for engine in _LIVE_ENGINES:  # one engine at a time: this module's in-process one goes first
        engine.shutdown()
    for backend in ("vllm", "hf"):
        start = time.perf_counter()
        extra = {"kv_cache_space_gb": KV_GB} if backend == "vllm" else {}
        actor = make_generation_actor(
            backend,
            model_dir,
            num_cpus=1,
            max_model_len=MAX_MODEL_LEN,
            temperature_for_logprobs=TEMPERATURE,
            **extra,
        )
        try:
            engine_seconds = ray.get(actor.ready.remote())
            print(
                f"\n[measure] {backend} actor up in {time.perf_counter() - start:.1f} s "
                f"(generator start {engine_seconds:.1f} s)"
            )
            measured = check_refit_takes_effect(through_ray(ray, actor), base_model, 1, seed=1)
            report(f"{backend} through Ray", measured)
            spec = SamplingSpec(temperature=1.0, max_new_tokens=8, n=2)
            runs = []
            for _ in range(2):
                ray.get(actor.reseed.remote(5))
                runs.append([r.response_ids for r in ray.get(actor.generate.remote(PROBE_PROMPTS, spec))])
            assert runs[0] == runs[1]
            ray.get(actor.shutdown.remote())
        finally:
            ray.kill(actor)


def test_partial_or_unknown_weights_are_refused(vllm_gen, model_dir, base_model):
    """A push missing a tensor would leave that layer on old weights (vLLM only warns)."""
    full = state_dict_for_refit(base_model)
    partial = {k: v for k, v in full.items() if "layers.1." not in k}
    bogus = {**full, "model.not_a_layer.weight": torch.zeros(2)}
    for gen in (vllm_gen, HFGenerator(model_dir)):
        version = gen.weight_version()
        with pytest.raises(KeyError, match=r"missing \['model.layers.1"):
            gen.update_weights(partial, version + 1)
        with pytest.raises(KeyError, match="unexpected .'model.not_a_layer.weight'"):
            gen.update_weights(bogus, version + 1)
        assert gen.weight_version() == version


def test_lora_adapter_refit_passes_the_gate(model_dir):
    """LoRA with refit: adapter: the push is the adapter tensors only (peft's saved names, their bytes
    exactly the trainable parameters'), the LoRA-enabled engine serves the checkpoint's base until the
    first push and the adapted policy after it, in score and in generate, within the fp32 gate; a second
    push replaces the adapter (new LoRA id, the old folder removed); a full-weight push is refused."""
    from grpo_train.refit.check import DEFAULT_LIMITS, gate_refit

    worker = trained_lora_worker(model_dir, refit="adapter")
    seqs, plens, expected = lora_probe(worker)
    engine = VllmGenerator(
        model_dir,
        max_model_len=MAX_MODEL_LEN,
        temperature_for_logprobs=TEMPERATURE,
        kv_cache_space_gb=KV_GB,
        lora_adapter={"dim": 4, "alpha": 8},
    )
    try:
        with torch.no_grad():
            base = [
                worker.logprobs(
                    {"input_ids": torch.tensor([s]), "attention_mask": torch.ones(1, len(s))}, reference=True
                )[0, p:].tolist()
                for s, p in zip(seqs, plens)
            ]
        assert engine.lora_request_id() is None
        gate_refit(base, engine.score(seqs, plens), DEFAULT_LIMITS["float32"])  # the base, before any push

        weights = worker.weights()
        trainable = {n: p for n, p in worker.model.named_parameters() if p.requires_grad}
        assert len(weights) == len(trainable) > 0
        assert all(
            k.startswith("base_model.model.") and (".lora_A.weight" in k or ".lora_B.weight" in k) for k in weights
        )
        for name, param in trainable.items():  # model.layers.0.self_attn.q_proj.lora_A.default.weight
            assert torch.equal(weights["base_model.model." + name.replace(".default.", ".")], param.detach())
        pushed = sum(t.numel() * t.element_size() for t in weights.values())
        assert pushed == 4 * sum(p.numel() for p in trainable.values())
        full = sum(t.numel() * t.element_size() for t in state_dict_for_refit(worker.model).values())
        print(f"\n[measure] adapter push {pushed} bytes vs merged {full} bytes")

        seconds = engine.update_weights(weights, 1)
        assert engine.lora_request_id() == 2 and engine.weight_version() == 1
        stats = gate_refit(expected, engine.score(seqs, plens), DEFAULT_LIMITS["float32"])
        print(f"[measure] LoRA adapter refit: {seconds:.3f} s, max |dlogprob| {stats.max_abs_diff:.2e}")
        sampled = engine.generate([PROBE_PROMPTS[0]], SamplingSpec(temperature=TEMPERATURE, max_new_tokens=8))[0]
        trainer = worker.score([sampled.prompt_ids + sampled.response_ids], [len(sampled.prompt_ids)])
        gate_refit(trainer, [sampled.response_logprobs], DEFAULT_LIMITS["float32"])

        folders = engine._adapters
        assert folders is not None and folders.current is not None
        first = folders.current
        train_lora_step(worker, torch.Generator().manual_seed(8))
        expected2 = worker.score(seqs, plens)
        assert diff(expected, expected2) > 1e-3  # the step moved the adapters
        engine.update_weights(worker.weights(), 2)
        assert engine.lora_request_id() == 3 and not first.exists()
        assert [p.name for p in folders.root.iterdir()] == ["v2"]
        gate_refit(expected2, engine.score(seqs, plens), DEFAULT_LIMITS["float32"])
        with pytest.raises(ValueError, match="not a peft adapter tensor"):
            engine.update_weights(state_dict_for_refit(worker.model), 3)
    finally:
        engine.shutdown()
    assert engine._adapters is not None and not engine._adapters.root.exists()


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown generation backend 'sglang'"):
        make_generation_actor("sglang", "/nowhere")


def test_check_refit_reports_max_diff_and_location():
    trainer = [[-1.0, -2.0], [-0.5]]
    assert check_refit(trainer, [[-1.0, -2.00001], [-0.5]], 1e-4) == pytest.approx(1e-5, abs=1e-9)
    with pytest.raises(RefitMismatchError) as info:
        check_refit(trainer, [[-1.0, -2.0], [-0.8]], 1e-3)
    err = info.value
    assert err.max_abs_diff == pytest.approx(0.3)
    assert err.where == (1, 0)
    message = str(err)
    assert "0.3" in message and "0.001" in message and "sequence 1, token 0" in message
    with pytest.raises(RefitMismatchError):
        check_refit([[0.0]], [[float("nan")]], 1.0)
    with pytest.raises(ValueError, match="sequence 0"):
        check_refit([[0.0, 1.0]], [[0.0]], 1.0)
    with pytest.raises(ValueError, match="2 trainer sequences"):
        check_refit([[0.0], [0.0]], [[0.0]], 1.0)


def test_state_dict_for_refit_names_and_tied_weights(base_model):
    weights = state_dict_for_refit(base_model)
    hf_names = set(base_model.state_dict())
    assert set(weights) == hf_names - {"lm_head.weight"}  # tied: sent once, as the embedding
    for name, tensor in weights.items():
        assert tensor.device.type == "cpu" and tensor.is_contiguous()
        assert torch.equal(tensor, base_model.state_dict()[name])
    half = state_dict_for_refit(base_model, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())

    from transformers import Qwen2Config, Qwen2ForCausalLM

    untied = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=64,
            tie_word_embeddings=False,
        )
    )
    assert "lm_head.weight" in state_dict_for_refit(untied)


def test_eval_checkpoint_of_a_lora_run_scores_like_the_trainer(model_dir, tmp_path):
    """`grpo eval --checkpoint` on a LoRA checkpoint: the run's checkpoint writer (CheckpointManager
    with the worker's save, as run_state does) and eval's own resolution (`checkpoint_model_path`)
    give a folder that a fresh vLLM engine loads as a plain model and that scores like the LoRA
    trainer that saved it, within the fp32 refit gate."""
    from grpo_train.checkpoint import CheckpointManager
    from grpo_train.refit.check import DEFAULT_LIMITS, gate_refit
    from grpo_train.run import checkpoint_model_path

    worker = trained_lora_worker(model_dir)
    seqs, plens, expected = lora_probe(worker)
    saved = CheckpointManager(tmp_path / "checkpoints").save(
        2, lambda folder: worker.save(str(folder / "policy")), {"step": 2}
    )
    engine = VllmGenerator(
        checkpoint_model_path(str(saved)),
        max_model_len=MAX_MODEL_LEN,
        temperature_for_logprobs=TEMPERATURE,
        kv_cache_space_gb=KV_GB,
    )
    try:
        stats = gate_refit(expected, engine.score(seqs, plens), DEFAULT_LIMITS["float32"])
    finally:
        engine.shutdown()
    print(f"\n[measure] LoRA checkpoint served by a fresh engine: max |dlogprob| {stats.max_abs_diff:.2e}")
