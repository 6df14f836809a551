"""Loss options beyond NeMo RL's original set, pinned by hand arithmetic through the public
`grpo_kernels.clipped_pg_loss` (reference on CPU) and the interpreted Triton kernel:
GSPO's sequence-level importance weight, the KL true gradient, loss_aggregation, CISPO,
force_on_policy_ratio and VAPO's positive-example NLL. Formulas: docs/algorithms.md.
"""

import importlib.util
import logging
import math
from pathlib import Path

import pytest
import torch

import grpo_kernels
from grpo_kernels.loss_config import PGLossConfig

# The helpers of test_pg_loss.py (pytest's importlib mode does not make test modules importable).
_spec = importlib.util.spec_from_file_location("_pg_loss_cases", Path(__file__).with_name("test_pg_loss.py"))
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)
BETA0, CONFIGS, F64, NAN = _cases.BETA0, _cases.CONFIGS, _cases.F64, _cases.NAN
approx, mapprox, run, triton_loss = _cases.approx, _cases.mapprox, _cases.run, _cases.triton_loss
check_micro_batch_invariance = _cases.check_micro_batch_invariance

L = math.log
IS = dict(use_importance_sampling_correction=True, **BETA0)
GSPO = dict(sequence_level_importance_ratios=True, token_level_loss=False, **IS)
# seq0: 2 tokens, A = +1, prev - gen = ln 2, ln 1.5 -> sequence weight w0 = 2 * 1.5 = 3
# seq1: 3 tokens, A = -1, prev - gen = -ln 2, 0, 0  -> sequence weight w1 = 0.5
# curr = prev, so every GSPO ratio is 1 and each token's l = -A: -1 in seq0, +1 in seq1.
GSPO_CASE = dict(
    curr=[[0.0, 0.0, NAN], [0.0, 0.0, 0.0]],
    prev=[[0.0, 0.0, NAN], [0.0, 0.0, 0.0]],
    gen=[[-L(2.0), -L(1.5), NAN], [L(2.0), 0.0, 0.0]],
    adv=[[1.0, 1.0, NAN], [-1.0, -1.0, -1.0]],
    token_mask=[[1, 1, 0], [1, 1, 1]],
)


def public(*args, **kwargs):
    return grpo_kernels.clipped_pg_loss(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Defect 1: GSPO + importance-sampling correction weighs each sequence once
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "truncation, w, oob",
    [
        (None, (3.0, 0.5), 0.0),
        # tis to [0.6, 2]: w0 3 -> 2, w1 0.5 -> 0.6; both sequences were out of bounds
        (
            dict(
                truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=2.0,
                truncated_importance_sampling_ratio_min=0.6,
            ),
            (2.0, 0.6),
            1.0,
        ),
        # icepop to [0.4, 2.5]: w0 = 3 is dropped, w1 kept; one of two sequences out of bounds
        (
            dict(
                truncated_importance_sampling_type="icepop",
                truncated_importance_sampling_ratio=2.5,
                truncated_importance_sampling_ratio_min=0.4,
            ),
            (0.0, 0.5),
            0.5,
        ),
    ],
)
@pytest.mark.parametrize("triton", [False, True])
def test_gspo_importance_weight_is_one_per_sequence_by_hand(truncation, w, oob, triton):
    # loss = (w0 * mean(-1, -1) + w1 * mean(1, 1, 1)) / 2 sequences = (-w0 + w1) / 2.
    # r_i = exp(mean_t(curr - prev)): d l / d curr_t = -A r_i / n_i, times w_i / G_seq:
    # seq0 tokens -w0 / 4, seq1 tokens w1 / 6.
    impl = triton_loss() if triton else public
    loss, m, grad = run(dict(GSPO, **(truncation or {})), **GSPO_CASE, impl=impl)
    assert loss == approx((-w[0] + w[1]) / 2)
    assert grad.tolist() == [[approx(-w[0] / 4), approx(-w[0] / 4), 0.0], [approx(w[1] / 6)] * 3]
    assert m["sampling_importance_ratio"] == mapprox((w[0] + w[1]) / 2)  # mean over sequences
    assert m["is_oob_fraction"] == mapprox(oob)


def test_gspo_sequence_weight_differs_from_token_weights():
    # Per-token weights (the old behaviour) would give seq0 mean(-2, -1.5) = -1.75 and seq1
    # mean(0.5, 1, 1) = 5/6: loss -0.4583. The sequence weights give (-3 + 0.5) / 2 = -1.25.
    loss, _, _ = run(GSPO, **GSPO_CASE, impl=public)
    assert loss == approx(-1.25)
    assert loss != approx((-1.75 + 5 / 6) / 2)


def test_gspo_sequence_weight_with_clipped_ratio_and_masked_sample():
    # seq0: curr - prev = ln 1.44, 0 -> r = 1.2 (at the clip edge, inside), A = +1, w0 = 3:
    #       l = -1.2 per token; d l / d curr_t = -A r / n = -0.6; times w0 / G_seq (2 valid).
    # seq1 is sample-masked (w would be 0.5 but it counts nowhere, not in G_seq either).
    # seq2: one token, curr - prev = ln 2 -> r = 2 clipped to 1.2, A = +1: no gradient, l = -1.2;
    #       prev - gen = -ln 4 -> w2 = 0.25.
    case = dict(
        curr=[[L(1.44), 0.0], [0.0, 0.0], [L(2.0), NAN]],
        prev=[[0.0, 0.0], [0.0, 0.0], [0.0, NAN]],
        gen=[[-L(2.0), -L(1.5)], [L(2.0), 0.0], [L(4.0), NAN]],
        adv=[[1.0, 1.0], [-1.0, -1.0], [1.0, NAN]],
        token_mask=[[1, 1], [1, 1], [1, 0]],
        sample_mask=[1, 0, 1],
    )
    for impl in (public, triton_loss()):
        loss, m, grad = run(GSPO, **case, impl=impl)
        assert loss == approx((3 * -1.2 + 0.25 * -1.2) / 2)
        assert grad.tolist() == [[approx(-0.6 * 3 / 2)] * 2, [0.0, 0.0], [0.0, 0.0]]
        assert m["sampling_importance_ratio"] == mapprox((3 + 0.25) / 2)


def test_gspo_weight_nonfinite_sum_gives_zero():
    # gen = -inf on a valid token: prev - gen = +inf -> w = inf -> 0 (nan/inf -> 0), never NaN.
    case = dict(GSPO_CASE, gen=[[-math.inf, 0.0, NAN], [L(2.0), 0.0, 0.0]])
    for impl in (public, triton_loss()):
        loss, m, grad = run(GSPO, **case, impl=impl)
        assert loss == approx(0.5 / 2)
        assert torch.isfinite(grad).all() and grad[0].tolist() == [0.0, 0.0, 0.0]


def test_vapo_nll_routes_to_the_reference_and_says_so(caplog):
    args = dict(
        curr=torch.zeros(2, 3),
        prev=torch.zeros(2, 3),
        gen=torch.zeros(2, 3),
        ref=None,
        advantages=torch.ones(2, 3),
        token_mask=torch.ones(2, 3),
        sample_mask=torch.ones(2),
        global_valid_tokens=6,
        global_valid_seqs=2,
    )
    with caplog.at_level(logging.DEBUG, logger="grpo_kernels.dispatch"):
        grpo_kernels.clipped_pg_loss(config=PGLossConfig(positive_example_nll_weight=0.1, **BETA0), **args)
        grpo_kernels.clipped_pg_loss(config=PGLossConfig(**GSPO), **args)
    routes = [r.getMessage() for r in caplog.records if "clipped_pg_loss" in r.getMessage()]
    assert "reference (positive_example_nll_weight)" in routes[0]
    assert "reference (CPU tensors)" in routes[1]  # GSPO would go to Triton on a GPU


def test_triton_kernel_refuses_what_dispatch_routes_away():
    impl = triton_loss()
    with pytest.raises(ValueError, match="positive_example_nll_weight is served by reference.clipped_pg_loss"):
        run(dict(positive_example_nll_weight=0.1, **BETA0), curr=[[0.0]], prev=[[0.0]], adv=[[1.0]], impl=impl)


# ---------------------------------------------------------------------------------------------
# The KL true gradient: expectation of the per-sample gradient = gradient of KL(pi || ref)
# ---------------------------------------------------------------------------------------------
def expected_kl_gradient(cfg, theta, ref_logp, gen_logp=None, impl=public):
    """sum_x q(x) d loss(x) / d theta, samples x ~ q (q = gen, or pi when gen is None): the
    expectation of the gradient that one sampled token gives, enumerated exactly."""
    pi_logp = torch.log_softmax(theta, 0)
    q_logp = pi_logp.detach() if gen_logp is None else gen_logp
    total = torch.zeros_like(theta)
    for x in range(theta.numel()):
        th = theta.detach().clone().requires_grad_()
        curr = torch.log_softmax(th, 0)[x].reshape(1, 1)
        loss, _ = impl(
            curr,
            curr.detach(),
            q_logp[x].reshape(1, 1),
            ref_logp[x].reshape(1, 1),
            torch.zeros(1, 1, dtype=F64),
            torch.ones(1, 1, dtype=F64),
            torch.ones(1, dtype=F64),
            PGLossConfig(**cfg),
            1,
            1,
        )
        (grad,) = torch.autograd.grad(loss, th)
        total += q_logp[x].exp() * grad
    return total


def true_kl_gradient(theta, ref_logp):
    th = theta.detach().clone().requires_grad_()
    logp = torch.log_softmax(th, 0)
    kl = (logp.exp() * (logp - ref_logp)).sum()  # KL(pi || ref), exactly
    return torch.autograd.grad(kl, th)[0]


THETA = torch.tensor([0.3, -1.2, 0.8, 0.1], dtype=F64)
REF = torch.log_softmax(torch.tensor([-0.5, 0.4, 0.2, 1.0], dtype=F64), 0)
GEN = torch.log_softmax(torch.tensor([0.0, -0.3, 0.6, 0.5], dtype=F64), 0)
KL_BASE = dict(reference_policy_kl_penalty=1.0, kl_input_clamp_value=None, kl_output_clamp_value=None)


@pytest.mark.parametrize("kl_type", ["k1", "k3"])
@pytest.mark.parametrize("on_policy_weight", [False, True])
def test_kl_true_gradient_is_the_gradient_of_the_kl(kl_type, on_policy_weight):
    # E_pi[k1] = E_pi[k3] = KL(pi || ref), so with the weight in the graph the expected sampled
    # gradient equals autograd of the exact KL. With on-policy KL the samples come from gen and
    # the weight exp(curr - gen) corrects them to pi.
    cfg = dict(KL_BASE, reference_policy_kl_type=kl_type, use_on_policy_kl_approximation=on_policy_weight)
    gen = GEN if on_policy_weight else None
    expected = true_kl_gradient(THETA, REF)
    got = expected_kl_gradient(dict(cfg, kl_true_gradient=True), THETA, REF, gen)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    detached = expected_kl_gradient(dict(cfg, kl_true_gradient=False), THETA, REF, gen)
    assert (detached - expected).abs().max() > 1e-2  # the detached weight is a different gradient


def test_kl_true_gradient_through_triton_matches_the_kl():
    impl = triton_loss()
    cfg = dict(KL_BASE, reference_policy_kl_type="k3", use_on_policy_kl_approximation=True, kl_true_gradient=True)
    got = expected_kl_gradient(cfg, THETA, REF, GEN, impl=impl)
    torch.testing.assert_close(got, true_kl_gradient(THETA, REF), rtol=1e-10, atol=1e-12)


def test_kl_true_gradient_by_hand_and_the_input_clamp_detaches_the_weight():
    # k3, logr = ref - curr = 0.5 and 3 (input clamp 2): value e^logr - 1 - logr as before.
    # Gradient w (k + dk/dcurr) with w = 1: t0 (e^.5 - 1.5) + (1 - e^.5) = -0.5 = -logr (= k1's
    # d/dcurr of KL's score term); t1 is input-clamped: no gradient at all. beta 0.5, 2 tokens.
    cfg = dict(reference_policy_kl_penalty=0.5, kl_input_clamp_value=2.0, kl_output_clamp_value=None)
    for impl in (public, triton_loss()):
        loss, m, grad = run(cfg, curr=[[0.0, 0.0]], prev=[[0.0, 0.0]], ref=[[0.5, 3.0]], impl=impl)
        assert m["kl_penalty"] == mapprox((math.exp(0.5) - 1.5 + math.exp(2) - 3) / 2)
        assert grad.tolist() == [[approx(0.5 * -0.5 / 2), 0.0]]


# ---------------------------------------------------------------------------------------------
# loss_aggregation
# ---------------------------------------------------------------------------------------------
# r = 1 so l = -A. seq0: one token, A = 2 -> -2. seq1: three tokens, A = -1 -> 1 each.
AGG_CASE = dict(
    curr=[[0.0, NAN, NAN], [0.0, 0.0, 0.0]],
    prev=[[0.0, NAN, NAN], [0.0] * 3],
    adv=[[2.0, 0.0, 0.0], [-1.0] * 3],
    token_mask=[[1, 0, 0], [1, 1, 1]],
)


@pytest.mark.parametrize(
    "agg, loss, grad_seq0, grad_seq1",
    [
        ("token-mean", (-2 + 3) / 4, -2 / 4, 1 / 4),  # / 4 tokens
        ("seq-mean-token-mean", (-2 + 1) / 2, -2 / 2, 1 / 6),  # per-sequence means / 2 sequences
        ("seq-mean-token-sum", (-2 + 3) / 2, -2 / 2, 1 / 2),  # per-sequence sums / 2 sequences
        ("seq-mean-token-sum-norm", (-2 + 3) / (2 * 4), -2 / 8, 1 / 8),  # / (2 sequences * L = 4)
    ],
)
@pytest.mark.parametrize("triton", [False, True])
def test_loss_aggregation_by_hand(agg, loss, grad_seq0, grad_seq1, triton):
    cfg = dict(loss_aggregation=agg, **BETA0)
    if agg == "seq-mean-token-sum-norm":
        cfg["loss_scale_factor"] = 4
    got, _, grad = run(cfg, **AGG_CASE, impl=triton_loss() if triton else public)
    assert got == approx(loss)
    assert grad.tolist() == [[approx(grad_seq0), 0.0, 0.0], [approx(grad_seq1)] * 3]


def test_token_level_loss_maps_onto_loss_aggregation():
    assert PGLossConfig().loss_aggregation == "token-mean"
    assert PGLossConfig(token_level_loss=False).loss_aggregation == "seq-mean-token-mean"
    assert PGLossConfig(loss_aggregation="seq-mean-token-mean").token_level_loss is False
    assert PGLossConfig(loss_aggregation="seq-mean-token-sum").token_level_loss is False
    assert PGLossConfig(loss_aggregation="token-mean", token_level_loss=True).token_level_loss is True


# ---------------------------------------------------------------------------------------------
# CISPO, force_on_policy_ratio, VAPO's positive-example NLL
# ---------------------------------------------------------------------------------------------
def test_cispo_by_hand():
    # r = 1.5 (A = +1, clipped to 1.2), 0.5 (A = +1, clipped to 0.8), 1.1 (A = -1, inside).
    # l = -A * sg(r_c) * curr; d l / d curr = -A r_c: every token keeps a gradient, the first
    # one included (PPO's clip would give it none).
    case = dict(curr=[[L(1.5), L(0.5), L(1.1)]], prev=[[0.0] * 3], adv=[[1.0, 1.0, -1.0]])
    for impl in (public, triton_loss()):
        loss, m, grad = run(dict(use_cispo=True, **BETA0), **case, impl=impl)
        assert loss == approx((-1.2 * L(1.5) - 0.8 * L(0.5) + 1.1 * L(1.1)) / 3)
        assert grad.tolist() == [[approx(-1.2 / 3), approx(-0.8 / 3), approx(1.1 / 3)]]
        assert m["clipped_ratio_max"] == mapprox(1.2) and m["ratio_max"] == mapprox(1.5)
    _, _, ppo_grad = run(BETA0, **case)
    assert ppo_grad[0, 0] == 0.0


def test_force_on_policy_ratio_by_hand():
    # curr - prev = ln 2 (PPO would clip: r = 2 > 1.2, A > 0 -> no gradient); forced r = 1:
    # l = -A, d l / d curr = -A. With IS (prev - gen = ln 3) the weight 3 still applies.
    case = dict(curr=[[L(2.0), L(2.0)]], prev=[[0.0, 0.0]], gen=[[-L(3.0), 0.0]], adv=[[1.0, -2.0]])
    for impl in (public, triton_loss()):
        loss, m, grad = run(dict(force_on_policy_ratio=True, **IS), **case, impl=impl)
        assert loss == approx((-1 * 3 + 2 * 1) / 2)
        assert grad.tolist() == [[approx(-3 / 2), approx(2 / 2)]]
        assert m["ratio_mean"] == mapprox(1.0) and m["clip_fraction"] == 0.0


def test_positive_example_nll_by_hand():
    # r = 1. seq0 (A = +1) curr = ln .5, ln .25; seq1 (A = -1) curr = ln .5. Token mean over 3.
    # actor = (-1 - 1 + 1) / 3; NLL over the positive sequence = (ln 2 + ln 4) / 3 = ln 2.
    # d/dcurr: seq0 -1/3 (actor) - 0.1/3 (NLL); seq1 +1/3.
    case = dict(
        curr=[[L(0.5), L(0.25)], [L(0.5), NAN]],
        prev=[[L(0.5), L(0.25)], [L(0.5), NAN]],
        adv=[[1.0, 1.0], [-1.0, NAN]],
        token_mask=[[1, 1], [1, 0]],
    )
    loss, m, grad = run(dict(positive_example_nll_weight=0.1, **BETA0), **case, impl=public)
    assert loss == approx(-1 / 3 + 0.1 * L(2.0))
    assert m["positive_nll"] == mapprox(L(2.0)) and m["actor_loss"] == mapprox(-1 / 3)
    assert grad.tolist() == [[approx(-1.1 / 3)] * 2, [approx(1 / 3), 0.0]]


# ---------------------------------------------------------------------------------------------
# Micro-batch invariance of every variant: the variants are entries of test_pg_loss.CONFIGS, so
# the reference's micro-batch and packed-vs-padded tests and Triton-vs-reference run them too.
# ---------------------------------------------------------------------------------------------
VARIANTS = ["seq_sum", "seq_sum_norm", "cispo", "force_on_policy", "vapo_nll", "gspo_tis", "kl_detached"]


def test_every_variant_is_in_the_invariance_configs():
    assert set(VARIANTS) <= set(CONFIGS)


@pytest.mark.parametrize("name", ["seq_sum_norm", "cispo", "force_on_policy", "gspo_tis"])
def test_triton_variants_split_into_micro_batches(name):
    check_micro_batch_invariance(triton_loss(), name, n_micro=2, B=4)
