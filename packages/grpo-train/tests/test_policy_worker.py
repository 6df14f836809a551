"""The policy worker in-process: micro-batch invariance, temperature, reference, save/load."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from grpo_train.config.schema import LossConfig, PolicyConfig
from grpo_train.policy.worker import NonFiniteLossError, PolicyWorker

VOCAB = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def policy_cfg(**kw) -> PolicyConfig:
    base = dict(
        precision="float32",
        train_global_batch_size=8,
        train_micro_batch_size=8,
        logprob_batch_size=3,
        max_grad_norm=None,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}},
        generation={"temperature": 0.7},
    )
    base.update(kw)
    return PolicyConfig(**base)


def make_batch(seed: int = 0, B: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 12, (B,), generator=g)
    S = int(lengths.max())
    input_ids = torch.randint(0, VOCAB, (B, S), generator=g)
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    token_mask = attention_mask.float().clone()
    token_mask[:, :3] = 0  # 3 prompt tokens
    adv = torch.randn(B, generator=g)
    sample_mask = torch.ones(B)
    sample_mask[1] = 0
    gen = -torch.rand(B, S, generator=g) * token_mask
    return {
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": gen,
        "advantages": adv[:, None] * token_mask,
        "sample_mask": sample_mask,
    }


def train_once(model_dir, batch, **kw):
    worker = PolicyWorker(model_dir, policy_cfg(**kw), LossConfig(reference_policy_kl_penalty=0.05), seed=0)
    batch = dict(batch)
    batch["prev_logprobs"] = worker.logprobs(batch)
    batch["ref_logprobs"] = worker.logprobs(batch, reference=True)
    grads = {}
    step = worker.optimizer.step

    def capture_then_step(*args, **kwargs):
        grads.update({k: v.grad.detach().clone() for k, v in worker.model.named_parameters()})
        return step(*args, **kwargs)

    worker.optimizer.step = capture_then_step
    metrics = worker.train(batch)
    return metrics, grads


@pytest.mark.parametrize("micro", [4, 2, 1])
def test_loss_and_gradients_do_not_depend_on_micro_batch_size(model_dir, micro):
    batch = make_batch()
    ref_metrics, ref_grads = train_once(model_dir, batch, train_micro_batch_size=8)
    metrics, grads = train_once(model_dir, batch, train_micro_batch_size=micro)
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-6, abs=1e-9)
    flat = torch.cat([grads[k].double().flatten() for k in sorted(grads)])
    ref_flat = torch.cat([ref_grads[k].double().flatten() for k in sorted(grads)])
    rel = float((flat - ref_flat).norm() / ref_flat.norm())
    assert rel <= 1e-6, f"relative gradient difference {rel:.2e}"
    # Per tensor, against the global scale: some gradients (e.g. k_proj.bias, which softmax's
    # shift invariance makes exactly 0 in exact arithmetic) are pure rounding noise.
    scale = float(ref_flat.abs().max())
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6 * scale, msg=name)


def test_gradients_are_not_zero(model_dir):
    _, grads = train_once(model_dir, make_batch())
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0


def test_logprobs_use_temperature_and_match_naive(model_dir):
    worker = PolicyWorker(model_dir, policy_cfg(), LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    batch = make_batch(seed=3)
    lp = worker.logprobs(batch)
    with torch.no_grad():
        logits = worker.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    naive = F.log_softmax(logits[:, :-1].double() / 0.7, dim=-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    naive = F.pad(naive, (1, 0)) * batch["attention_mask"]
    torch.testing.assert_close(lp.double() * batch["attention_mask"], naive, rtol=1e-5, atol=1e-5)
    assert worker.reference is None
    with pytest.raises(ValueError, match="reference_policy_kl_penalty is 0"):
        worker.logprobs(batch, reference=True)


def test_score_matches_logprobs(model_dir):
    worker = PolicyWorker(model_dir, policy_cfg(), LossConfig(), seed=0)
    seqs = [[1, 2, 3, 4, 5], [7, 8, 9]]
    scores = worker.score(seqs, [2, 1])
    ids = torch.tensor([[1, 2, 3, 4, 5], [7, 8, 9, 0, 0]])
    lp = worker.logprobs({"input_ids": ids, "attention_mask": (torch.arange(5) < torch.tensor([[5], [3]])).long()})
    assert scores[0] == pytest.approx(lp[0, 2:5].tolist(), abs=1e-6)
    assert scores[1] == pytest.approx(lp[1, 1:3].tolist(), abs=1e-6)


def test_non_finite_loss_stops_without_stepping(model_dir):
    worker = PolicyWorker(model_dir, policy_cfg(), LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    batch = make_batch()
    batch["prev_logprobs"] = worker.logprobs(batch)
    batch["advantages"] = batch["advantages"] * float("nan")
    before = copy.deepcopy(worker.model.state_dict())
    with pytest.raises(NonFiniteLossError, match="optimizer step was skipped"):
        worker.train(batch)
    for k, v in worker.model.state_dict().items():
        assert torch.equal(v, before[k])


def test_save_and_load_round_trip(model_dir, tmp_path):
    batch = make_batch()
    a = PolicyWorker(
        model_dir, policy_cfg(optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}}), LossConfig(), seed=0
    )
    batch["prev_logprobs"] = a.logprobs(batch)
    batch["ref_logprobs"] = a.logprobs(batch, reference=True)
    a.train(batch)
    a.save(str(tmp_path / "ckpt"))
    b = PolicyWorker(
        model_dir, policy_cfg(optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}}), LossConfig(), seed=0
    )
    b.load(str(tmp_path / "ckpt"))
    for (k, va), (_, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(va, vb), k
    # The next step is identical too (optimizer state restored).
    a.train(batch)
    b.train(batch)
    for (k, va), (_, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(va, vb), k


@pytest.mark.parametrize(
    "loss_keys",
    [
        {},
        {"loss_aggregation": "seq-mean-token-sum-norm", "loss_scale_factor": 16.0},
        {"positive_example_nll_weight": 0.5},
    ],
)
def test_loss_fn_keys_change_the_training_loss(model_dir, loss_keys):
    """The loss the worker trains on follows loss_fn: at the first step curr = prev (ratio 1,
    beta 0), so the actor loss is sum(-A) over valid tokens divided by the configured normaliser,
    plus mu * the NLL of the positive-advantage sequences (docs/algorithms.md)."""
    loss_cfg = LossConfig(reference_policy_kl_penalty=0.0, **loss_keys)
    worker = PolicyWorker(model_dir, policy_cfg(train_micro_batch_size=4), loss_cfg, seed=0)
    batch = make_batch(seed=1)
    batch["prev_logprobs"] = worker.logprobs(batch)
    metrics = worker.train(batch)
    valid = batch["token_mask"].bool() & batch["sample_mask"].bool()[:, None]
    g_tok, g_seq = float(valid.sum()), float(batch["sample_mask"].sum())
    actor_sum = float(-batch["advantages"][valid].sum())
    positive = valid & (batch["advantages"] > 0)
    nll = float(-batch["prev_logprobs"][positive].sum()) / g_tok
    expected = {
        "": actor_sum / g_tok,
        "loss_aggregation": actor_sum / (g_seq * 16.0),
        "positive_example_nll_weight": actor_sum / g_tok + 0.5 * nll,
    }[next(iter(loss_keys), "")]
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert metrics["positive_nll"] == pytest.approx(
        nll if loss_keys.get("positive_example_nll_weight") else 0.0, rel=1e-5, abs=1e-6
    )


# ------------------------------------------------- on-policy prev-logprob reuse (issue 23)
PACKED_SAME = {
    "sequence_packing": {"enabled": True, "train_mb_tokens": 48, "logprob_mb_tokens": 48, "sequence_length_round": 4}
}


def train_recording(model_dir, batch, monkeypatch, **kw):
    """A fresh worker's train(batch): the prev logprobs each micro-batch's loss received, the
    gradients before the optimizer step, the metrics and the updated weights."""
    import grpo_kernels

    worker = PolicyWorker(model_dir, policy_cfg(**kw), LossConfig(reference_policy_kl_penalty=0.05), seed=0)
    batch = {**batch, "ref_logprobs": worker.logprobs(batch, reference=True)}
    loss_fn = getattr(grpo_kernels.clipped_pg_loss, "unrecorded", grpo_kernels.clipped_pg_loss)
    seen, grads, step = [], {}, worker.optimizer.step

    def recording_loss(curr, prev, *args):
        seen.append(prev.detach().clone())
        return loss_fn(curr, prev, *args)

    recording_loss.unrecorded = loss_fn

    def capture_then_step(*args, **kwargs):
        grads.update({k: v.grad.detach().clone() for k, v in worker.model.named_parameters()})
        return step(*args, **kwargs)

    monkeypatch.setattr(grpo_kernels, "clipped_pg_loss", recording_loss)
    worker.optimizer.step = capture_then_step
    metrics = worker.train(batch)
    return worker, seen, grads, metrics


@pytest.mark.parametrize(
    "kw",
    [{"logprob_batch_size": 8}, {"logprob_batch_size": 4, "train_micro_batch_size": 4}, PACKED_SAME],
    ids=["padded-1mb", "padded-2mb", "packed"],
)
def test_reused_prev_logprobs_are_bitwise_the_separate_pass(model_dir, monkeypatch, kw):
    """One optimizer step over the whole batch, logprob and train micro-batches alike: prev taken
    from the training forward equals the separate pass bitwise, and so do the loss, every
    gradient, every metric and the updated weights."""
    from grpo_train.train_step import seq_mult_prob_error

    batch = make_batch()
    probe = PolicyWorker(model_dir, policy_cfg(**kw), LossConfig(reference_policy_kl_penalty=0.05), seed=0)
    assert probe.reuses_prev(batch, 8)
    separate_prev = probe.logprobs(batch)  # [B, S], what train_step.add_logprobs would have sent
    w_sep, seen_sep, grads_sep, m_sep = train_recording(
        model_dir, {**batch, "prev_logprobs": separate_prev}, monkeypatch, **kw
    )
    w_re, seen_re, grads_re, m_re = train_recording(model_dir, batch, monkeypatch, **kw)  # no prev: reused
    assert len(seen_re) == len(seen_sep) >= 1
    for a, b in zip(seen_re, seen_sep):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    assert sorted(grads_re) == sorted(grads_sep)
    for name in grads_sep:
        assert torch.equal(grads_re[name], grads_sep[name]), name
    for (name, a), (_, b) in zip(w_re.model.named_parameters(), w_sep.model.named_parameters()):
        assert torch.equal(a, b), name
    # add_advantages logs this metric from the separate pass; the reusing train call logs it itself
    expected_err = float(seq_mult_prob_error({**batch, "prev_logprobs": separate_prev}).max())
    assert m_re.pop("max_seq_mult_prob_error") == expected_err
    assert "max_seq_mult_prob_error" not in m_sep
    assert m_re == m_sep


@pytest.mark.parametrize(
    "kw, rows, why",
    [
        ({"logprob_batch_size": 3}, 8, "logprob micro-batches of 3 rows, train of 8: other matmul shapes"),
        (
            {"logprob_batch_size": 8, "train_global_batch_size": 4, "train_micro_batch_size": 4},
            8,
            "two optimizer steps: the second step's prev is the start-of-step weights', not its own forward's",
        ),
        ({"logprob_batch_size": 8}, 6, "a batch other than train_global_batch_size"),
    ],
    ids=["other-microbatches", "two-steps", "other-batch-size"],
)
def test_without_reuse_train_runs_the_separate_pass_itself(model_dir, monkeypatch, kw, rows, why):
    """Where reuse is not provably bitwise, a train call without prev computes it first (before
    any optimizer step), exactly as the driver's separate pass would."""
    batch = make_batch(B=rows)
    probe = PolicyWorker(model_dir, policy_cfg(**kw), LossConfig(reference_policy_kl_penalty=0.05), seed=0)
    assert not probe.reuses_prev(batch, probe.cfg.train_global_batch_size), why
    separate_prev = probe.logprobs(batch)
    w_sep, seen_sep, grads_sep, m_sep = train_recording(
        model_dir, {**batch, "prev_logprobs": separate_prev}, monkeypatch, **kw
    )
    w_own, seen_own, grads_own, m_own = train_recording(model_dir, batch, monkeypatch, **kw)
    assert len(seen_own) == len(seen_sep)
    for a, b in zip(seen_own, seen_sep):
        assert torch.equal(a, b)
    for name in grads_sep:
        assert torch.equal(grads_own[name], grads_sep[name]), name
    assert m_own == m_sep  # no reuse metric: add_advantages logs it from the batch's prev


def test_dropout_disables_reuse(model_dir):
    worker = PolicyWorker(model_dir, policy_cfg(logprob_batch_size=8), LossConfig(), seed=0)
    batch = make_batch()
    assert worker.reuses_prev(batch, 8)
    worker.model.config.attention_dropout = 0.1  # each forward would draw its own mask
    assert not worker.reuses_prev(batch, 8)


# ------------------------------------------- the reference forward beside training (issue 23)
def train_seeing_ref(model_dir, batch, monkeypatch, **kw):
    """A fresh worker's train(batch) (prev reused): the ref logprobs each micro-batch's loss
    received, the metrics, the updated weights, and how many ReferenceAhead threads ran."""
    import grpo_kernels
    from grpo_train.policy import reference_ahead

    worker = PolicyWorker(model_dir, policy_cfg(**kw), LossConfig(reference_policy_kl_penalty=0.05), seed=0)
    loss_fn = getattr(grpo_kernels.clipped_pg_loss, "unrecorded", grpo_kernels.clipped_pg_loss)
    start = getattr(reference_ahead.start, "unrecorded", reference_ahead.start)
    seen, threads = [], []

    def recording_loss(curr, prev, gen, ref, *args):
        seen.append(ref.detach().clone())
        return loss_fn(curr, prev, gen, ref, *args)

    def counting_start(*args):
        threads.append(1)
        return start(*args)

    recording_loss.unrecorded, counting_start.unrecorded = loss_fn, start
    monkeypatch.setattr(grpo_kernels, "clipped_pg_loss", recording_loss)
    monkeypatch.setattr(reference_ahead, "start", counting_start)
    metrics = worker.train(batch)
    return worker, seen, metrics, len(threads)


BESIDE = {"reference_beside_training": True}


@pytest.mark.parametrize(
    "kw, beside",
    [
        ({"logprob_batch_size": 4, "train_micro_batch_size": 4, **BESIDE}, True),
        ({**PACKED_SAME, **BESIDE}, True),
        ({"logprob_batch_size": 3, **BESIDE}, False),  # other micro-batches than training's: the reference pass first
        ({"logprob_batch_size": 4, "train_micro_batch_size": 4}, False),  # the default: off
    ],
    ids=["padded-2mb", "packed", "other-microbatches", "default-off"],
)
def test_reference_beside_training_is_bitwise_the_reference_pass_first(model_dir, monkeypatch, kw, beside):
    """A train call left without ref_logprobs computes them itself, in a second thread beside the
    training micro-batches where reference_ahead.usable allows (else first): every micro-batch's
    loss gets bitwise the reference logprobs of the driver's separate pass, and the metrics and
    updated weights are bitwise those of a train call given them. The thread's cases have two or
    more micro-batches, so a later one's rows are waited for while training runs."""
    batch = make_batch()
    probe = PolicyWorker(model_dir, policy_cfg(**kw), LossConfig(reference_policy_kl_penalty=0.05), seed=0)
    driver_ref = probe.logprobs(batch, reference=True)  # [B, S]: what train_step.add_logprobs used to send
    w_sent, seen_sent, m_sent, n_sent = train_seeing_ref(
        model_dir, {**batch, "ref_logprobs": driver_ref}, monkeypatch, **kw
    )
    w_own, seen_own, m_own, n_own = train_seeing_ref(model_dir, batch, monkeypatch, **kw)
    assert (n_sent, n_own) == (0, int(beside))
    assert len(seen_own) == len(seen_sent) >= (2 if beside else 1)
    for a, b in zip(seen_own, seen_sent):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    assert m_own == m_sent
    for (name, a), (_, b) in zip(w_own.model.named_parameters(), w_sent.model.named_parameters()):
        assert torch.equal(a, b), name
    assert w_own._ahead is None  # the thread is joined and dropped when train returns


def test_reference_beside_training_hands_its_error_to_the_train_call(model_dir, monkeypatch):
    """A failing reference forward in the thread fails the train call (no silent zeros)."""
    worker = PolicyWorker(
        model_dir,
        policy_cfg(logprob_batch_size=4, train_micro_batch_size=4, **BESIDE),
        LossConfig(reference_policy_kl_penalty=0.05),
        seed=0,
    )

    own = worker._microbatch_logprobs

    def broken_reference(model, *args):
        if model is worker.reference:
            raise RuntimeError("reference forward broke")
        return own(model, *args)

    monkeypatch.setattr(worker, "_microbatch_logprobs", broken_reference)
    with pytest.raises(RuntimeError, match="reference forward broke"):
        worker.train(make_batch())
    assert worker._ahead is None
