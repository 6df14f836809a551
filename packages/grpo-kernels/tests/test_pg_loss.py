"""The clipped PG loss: the reference pinned by hand arithmetic, its invariances, and the
interpreted Triton kernels (TRITON_INTERPRET=1, set by the root conftest) against it.

Every hand case states the per-token numbers in comments; `L` = ln, r = exp(curr - prev).
"""

import math

import pytest
import torch

from grpo_kernels import reference as R
from grpo_kernels.loss_config import PGLossConfig

NAN, INF = float("nan"), float("inf")
L = math.log
F64 = torch.float64
BETA0 = dict(reference_policy_kl_penalty=0.0)


def t(rows, dtype=F64):
    return torch.tensor(rows, dtype=dtype)


def run(
    cfg,
    curr,
    prev,
    gen=None,
    ref=None,
    adv=None,
    token_mask=None,
    sample_mask=None,
    g_tok=None,
    g_seq=None,
    cu_seqlens=None,
    impl=R.clipped_pg_loss,
):
    """-> loss, metrics (as floats), d loss / d curr. Rows are [B, S] lists (or [T] + cu)."""
    curr = t(curr).requires_grad_()
    prev = t(prev)
    gen = prev.clone() if gen is None else t(gen)
    ref = None if ref is None else t(ref)
    adv = torch.zeros_like(prev) if adv is None else t(adv)
    token_mask = torch.ones_like(prev) if token_mask is None else t(token_mask)
    n_seqs = prev.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    sample_mask = torch.ones(n_seqs, dtype=F64) if sample_mask is None else t(sample_mask)
    valid = token_mask.bool()
    if cu_seqlens is None:
        valid = valid & sample_mask.bool()[:, None]
    g_tok = int(valid.sum()) if g_tok is None else g_tok
    g_seq = int(sample_mask.sum()) if g_seq is None else g_seq
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    loss, metrics = impl(curr, prev, gen, ref, adv, token_mask, sample_mask, PGLossConfig(**cfg), g_tok, g_seq, cu)
    loss.backward()
    return loss.item(), {k: v.item() for k, v in metrics.items()}, curr.grad


def approx(x, rel=1e-12, abs=1e-12):
    """Loss and gradients: float64 end to end."""
    return pytest.approx(x, rel=rel, abs=abs)


def mapprox(x):
    """Metrics: reported as float32."""
    return pytest.approx(x, rel=1e-6, abs=1e-7)


# ---------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------
def test_ppo_clipping_by_hand():
    # Position 0 is a prompt token: masked, and full of garbage that must not leak.
    # t1: r=1.5 A=+1 -> -A r=-1.5, -A clamp(r)=-1.2, max=-1.2 (clipped, no grad)
    # t2: r=0.5 A=+1 -> -0.5 vs -0.8 -> -0.5 (unclipped, d/dcurr = -A r = -0.5)
    # t3: r=1   A=-1 ->  1 vs 1 -> 1 (tie: half grad to each branch, total -A r = 1)
    # t4: r=1.1 A=-2 -> 2.2 vs 2.2 -> 2.2 (inside the clip range, d/dcurr = 2.2)
    # loss = (-1.2 - 0.5 + 1 + 2.2) / 4 = 0.375
    loss, m, grad = run(
        BETA0,
        curr=[[NAN, L(1.5), L(0.5), 0.0, L(1.1)]],
        prev=[[-INF, 0.0, 0.0, 0.0, 0.0]],
        adv=[[NAN, 1.0, 1.0, -1.0, -2.0]],
        token_mask=[[0, 1, 1, 1, 1]],
    )
    assert loss == approx(0.375)
    assert grad.tolist() == [[0.0, 0.0, approx(-0.125), approx(0.25), approx(0.55)]]
    assert m["actor_loss"] == mapprox(0.375) and m["loss"] == mapprox(0.375)
    assert m["kl_penalty"] == 0.0
    assert m["ratio_mean"] == mapprox((1.5 + 0.5 + 1 + 1.1) / 4)
    assert m["clipped_ratio_mean"] == mapprox((1.2 + 0.8 + 1 + 1.1) / 4)
    assert m["clip_fraction"] == mapprox(0.25)  # only t1 took the clipped branch
    assert (m["ratio_min"], m["ratio_max"]) == (mapprox(0.5), mapprox(1.5))
    assert (m["clipped_ratio_min"], m["clipped_ratio_max"]) == (mapprox(0.8), mapprox(1.2))
    # gen == prev: no train/inference mismatch
    assert m["token_mult_prob_error"] == mapprox(1.0) and m["sampling_importance_ratio"] == mapprox(1.0)
    assert m["gen_kl_error"] == 0.0 and m["policy_kl_error"] == 0.0 and m["js_divergence_error"] == mapprox(0.0)
    # approx_entropy = -mean(exp(curr - gen) * curr) = -mean(r ln r)
    assert m["approx_entropy"] == mapprox(-(1.5 * L(1.5) + 0.5 * L(0.5) + 1.1 * L(1.1)) / 4)


def test_dual_clip_with_negative_advantages_by_hand():
    # c = 3, eps = 0.2
    # t0: A=-1 r=5 -> max(5, 1.2) = 5 -> A<0: min(5, -A c = 3) = 3   (dual-clipped, no grad)
    # t1: A=-1 r=2 -> max(2, 1.2) = 2 -> min(2, 3) = 2                 (d/dcurr = -A r = 2)
    # t2: A=+1 r=5 -> max(-5, -1.2) = -1.2; A>0: no dual clip         (clipped, no grad)
    # loss = (3 + 2 - 1.2) / 3
    loss, m, grad = run(
        dict(ratio_clip_c=3.0, **BETA0),
        curr=[[L(5.0), L(2.0), L(5.0)]],
        prev=[[0.0, 0.0, 0.0]],
        adv=[[-1.0, -1.0, 1.0]],
    )
    assert loss == approx(3.8 / 3)
    assert grad.tolist() == [[0.0, approx(2 / 3), 0.0]]
    # Without the dual clip t0 would count 5.
    loss_no_dual, _, _ = run(BETA0, curr=[[L(5.0), L(2.0), L(5.0)]], prev=[[0.0] * 3], adv=[[-1.0, -1.0, 1.0]])
    assert loss_no_dual == approx(5.8 / 3)


# Three tokens with logr = ref - curr = 0.5, 3 and -3; input clamp 2, output clamp 1.5, beta 0.5.
# These pin the detached KL weight (kl_true_gradient=False); test_pg_loss_variants.py the other.
KL_CASE = dict(curr=[[0.0, 0.0, 0.0]], prev=[[0.0, 0.0, 0.0]], ref=[[0.5, 3.0, -3.0]])
KL_CLAMPS = dict(
    reference_policy_kl_penalty=0.5, kl_input_clamp_value=2.0, kl_output_clamp_value=1.5, kl_true_gradient=False
)


@pytest.mark.parametrize(
    "kl_type, per_token, dkl_dcurr",
    [
        # k1 = -logr: -0.5, -2, 2 -> out-clamp: -0.5, -1.5, 1.5; dk1/dcurr = +1 where unclamped
        ("k1", [-0.5, -1.5, 1.5], [1.0, 0.0, 0.0]),
        # k2 = logr^2/2: 0.125, 2, 2 -> 0.125, 1.5, 1.5; dk2/dcurr = -logr = -0.5 at t0
        ("k2", [0.125, 1.5, 1.5], [-0.5, 0.0, 0.0]),
        # k3 = e^logr - 1 - logr: e^.5-1.5, e^2-3 (=4.39 -> 1.5), e^-2+1 (1.135, input-clamped)
        # dk3/dcurr = -(e^logr - 1) at t0; t1 is output-clamped, t2 input-clamped
        ("k3", [math.exp(0.5) - 1.5, 1.5, math.exp(-2) + 1], [-(math.exp(0.5) - 1), 0.0, 0.0]),
    ],
)
def test_kl_types_at_the_clamps_by_hand(kl_type, per_token, dkl_dcurr):
    loss, m, grad = run(dict(reference_policy_kl_type=kl_type, **KL_CLAMPS), **KL_CASE)
    kl = sum(per_token) / 3
    assert m["kl_penalty"] == mapprox(kl)
    assert loss == approx(0.5 * kl)  # advantages are 0: the actor loss is 0
    assert m["actor_loss"] == 0.0
    assert grad.tolist() == [[approx(0.5 * d / 3) for d in dkl_dcurr]]


def test_on_policy_kl_weight_is_applied_before_the_output_clamp():
    # curr - gen = ln 4 -> weight 4; k1 = -(ref - curr) = -0.5; 4 * -0.5 = -2 -> clamp -> -1.5.
    # (Clamping first and weighting after would give -2.)
    cfg = dict(reference_policy_kl_type="k1", use_on_policy_kl_approximation=True, **KL_CLAMPS)
    loss, m, grad = run(cfg, curr=[[L(4.0)]], prev=[[L(4.0)]], gen=[[0.0]], ref=[[L(4.0) + 0.5]])
    assert m["kl_penalty"] == mapprox(-1.5)
    assert grad.tolist() == [[0.0]]  # output clamp active -> no gradient
    # Inside the clamp: weight 4, k1 = -0.25 -> -1; d/dcurr = 4 * 1 (weight detached), times beta.
    loss, m, grad = run(cfg, curr=[[L(4.0)]], prev=[[L(4.0)]], gen=[[0.0]], ref=[[L(4.0) + 0.25]])
    assert m["kl_penalty"] == mapprox(-1.0)
    assert grad.tolist() == [[approx(0.5 * 4.0)]]


IS = dict(use_importance_sampling_correction=True, **BETA0)
# w = exp(prev - gen) = 3, 0.25, 1; r = 1 and A = 1 on every token, so each token's l = -1.
IS_CASE = dict(curr=[[0.0, 0.0, 0.0]], prev=[[0.0, 0.0, 0.0]], gen=[[-L(3.0), L(4.0), 0.0]], adv=[[1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    "truncation, weights, oob",
    [
        (None, [3.0, 0.25, 1.0], 0.0),
        # tis to [0.5, 2]: 3 -> 2, 0.25 -> 0.5
        (
            dict(
                truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=2.0,
                truncated_importance_sampling_ratio_min=0.5,
            ),
            [2.0, 0.5, 1.0],
            2 / 3,
        ),
        # tis with an upper bound only (NeMo RL's tis): 3 -> 2
        (
            dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0),
            [2.0, 0.25, 1.0],
            1 / 3,
        ),
        # icepop to [0.5, 2]: both out-of-bounds tokens are dropped
        (
            dict(
                truncated_importance_sampling_type="icepop",
                truncated_importance_sampling_ratio=2.0,
                truncated_importance_sampling_ratio_min=0.5,
            ),
            [0.0, 0.0, 1.0],
            2 / 3,
        ),
    ],
)
def test_token_importance_sampling_by_hand(truncation, weights, oob):
    loss, m, grad = run(dict(IS, **(truncation or {})), **IS_CASE)
    assert loss == approx(-sum(weights) / 3)
    assert grad.tolist() == [[approx(-w / 3) for w in weights]]  # d(-A w r)/dcurr = -w
    assert m["sampling_importance_ratio"] == mapprox(sum(weights) / 3)
    assert m["is_oob_fraction"] == mapprox(oob)


def test_importance_weights_are_ignored_without_correction_but_still_reported():
    loss, m, grad = run(BETA0, **IS_CASE)
    assert loss == approx(-1.0)
    assert m["sampling_importance_ratio"] == mapprox((3 + 0.25 + 1) / 3)


def test_seq_mask_tis_by_hand():
    # seq0: prev - gen = ln 3, -ln 3 -> geometric mean 1 -> kept, token weights 3 and 1/3
    # seq1: prev - gen = ln 4, 0     -> geometric mean 2 > 1.5 -> the whole sequence is dropped
    # l = -1 everywhere: loss = -(3 + 1/3 + 0 + 0) / 4; one of two sequences is out of bounds
    cfg = dict(
        IS,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.5,
        truncated_importance_sampling_ratio_min=0.5,
    )
    loss, m, grad = run(
        cfg,
        curr=[[0.0, 0.0], [0.0, 0.0]],
        prev=[[0.0, 0.0], [0.0, 0.0]],
        gen=[[-L(3.0), L(3.0)], [-L(4.0), 0.0]],
        adv=[[1.0, 1.0], [1.0, 1.0]],
    )
    assert loss == approx(-(3 + 1 / 3) / 4)
    assert grad.tolist() == [[approx(-3 / 4), approx(-1 / 12)], [0.0, 0.0]]
    assert m["is_oob_fraction"] == mapprox(0.5)
    assert m["sampling_importance_ratio"] == mapprox((3 + 1 / 3) / 4)


def test_gspo_by_hand():
    # seq0: curr - prev = ln 2, 0 -> r = exp(ln 2 / 2) = sqrt 2 -> clamp 1.2; A = +1:
    #       max(-sqrt 2, -1.2) = -1.2 on both tokens (clipped, no grad); seq mean -1.2
    # seq1: curr - prev = ln .9 x3 -> r = 0.9 (inside); A = -1: 0.9 on each token; mean 0.9
    # loss = (-1.2 + 0.9) / 2 sequences. In seq1 every token's l is -A r with r = exp(mean of
    # 3 log-ratios), so d l / d curr_t = -A r / 3 = 0.3 for each of the 3 tokens' l; the
    # sequence mean of 3 such l moves by 0.3 too, and / 2 (G_seq) gives 0.15.
    cfg = dict(sequence_level_importance_ratios=True, token_level_loss=False, **BETA0)
    loss, m, grad = run(
        cfg,
        curr=[[L(2.0), 0.0, NAN], [L(0.9)] * 3],
        prev=[[0.0, 0.0, NAN], [0.0] * 3],
        adv=[[1.0, 1.0, NAN], [-1.0] * 3],
        token_mask=[[1, 1, 0], [1, 1, 1]],
    )
    assert loss == approx(-0.15)
    assert grad.tolist() == [[0.0, 0.0, 0.0], [approx(0.15)] * 3]
    assert m["ratio_max"] == mapprox(math.sqrt(2)) and m["clipped_ratio_max"] == mapprox(1.2)
    assert m["ratio_mean"] == mapprox((2 * math.sqrt(2) + 3 * 0.9) / 5)  # token mean of r


def test_reinforce_by_hand():
    # r = r_c = curr: l = -A curr = -2 * -1, -1 * -2 = 2, 2 -> loss 2; d/dcurr = -A / 2
    loss, m, grad = run(
        dict(disable_ppo_ratio=True, ratio_clip_c=3.0, **BETA0),
        curr=[[-1.0, -2.0]],
        prev=[[-5.0, -5.0]],
        adv=[[2.0, 1.0]],
    )
    assert loss == approx(2.0)
    assert grad.tolist() == [[approx(-1.0), approx(-0.5)]]
    assert m["clip_fraction"] == 0.0


def test_token_level_and_sequence_level_reductions_by_hand():
    # r = 1 so l = -A. seq0: one token, A = 2 -> -2. seq1: three tokens, A = -1 -> 1 each.
    # token level: (-2 + 3) / 4 tokens = 0.25; sequence level: (-2 + 1) / 2 sequences = -0.5
    case = dict(
        curr=[[0.0, NAN, NAN], [0.0, 0.0, 0.0]],
        prev=[[0.0, NAN, NAN], [0.0] * 3],
        adv=[[2.0, 0.0, 0.0], [-1.0] * 3],
        token_mask=[[1, 0, 0], [1, 1, 1]],
    )
    loss_tok, _, grad_tok = run(BETA0, **case)
    loss_seq, _, grad_seq = run(dict(token_level_loss=False, **BETA0), **case)
    assert loss_tok == approx(0.25) and loss_seq == approx(-0.5)
    assert grad_tok.tolist() == [[approx(-0.5), 0.0, 0.0], [approx(0.25)] * 3]
    assert grad_seq.tolist() == [[approx(-1.0), 0.0, 0.0], [approx(1 / 6)] * 3]


def test_mismatch_metrics_by_hand():
    # prev = ln .5, gen = ln .25 on both tokens, curr = prev.
    #   token_mult_prob_error = exp(|ln .25 - ln .5|) = 2
    #   gen_kl_error (k3, logr = prev - gen = ln 2) = 2 - 1 - ln 2
    #   policy_kl_error (logr = gen - prev = -ln 2) = 1/2 - 1 + ln 2
    #   JS: M = (.5 + .25)/2 = .375; a = ln(.5/.375) = ln 4/3, b = ln(.25/.375) = ln 2/3
    #       js = (4/3 - ln 4/3 - 1)/2 + (2/3 - ln 2/3 - 1)/2
    #   approx_entropy = -exp(curr - gen) curr = -2 ln .5 = 2 ln 2
    _, m, _ = run(BETA0, curr=[[L(0.5)] * 2], prev=[[L(0.5)] * 2], gen=[[L(0.25)] * 2])
    assert m["token_mult_prob_error"] == mapprox(2.0)
    assert m["gen_kl_error"] == mapprox(1 - L(2))
    assert m["policy_kl_error"] == mapprox(L(2) - 0.5)
    js = (4 / 3 - L(4 / 3) - 1) / 2 + (2 / 3 - L(2 / 3) - 1) / 2
    assert m["js_divergence_error"] == mapprox(js)
    assert m["approx_entropy"] == mapprox(2 * L(2))
    # With k1 the mismatch KLs are the plain log-ratios.
    _, m, _ = run(dict(reference_policy_kl_type="k1", **BETA0), curr=[[L(0.5)]], prev=[[L(0.5)]], gen=[[L(0.25)]])
    assert m["gen_kl_error"] == mapprox(-L(2)) and m["policy_kl_error"] == mapprox(L(2))


def test_beta_zero_needs_no_reference_and_beta_nonzero_does():
    loss, m, _ = run(BETA0, curr=[[0.0]], prev=[[0.0]], adv=[[1.0]])
    assert loss == mapprox(-1.0) and m["kl_penalty"] == 0.0
    with pytest.raises(ValueError, match="ref"):
        run(dict(reference_policy_kl_penalty=0.1), curr=[[0.0]], prev=[[0.0]], adv=[[1.0]])


def test_global_counts_make_a_partial_sum():
    # Same tokens as the PPO case, but this micro-batch is 4 of 10 global tokens.
    loss, m, grad = run(
        BETA0, curr=[[L(1.5), L(0.5), 0.0, L(1.1)]], prev=[[0.0] * 4], adv=[[1.0, 1.0, -1.0, -2.0]], g_tok=10
    )
    assert loss == mapprox(1.5 / 10) and m["ratio_mean"] == mapprox(4.1 / 10)
    assert grad[0, 1].item() == approx(-0.5 / 10)


@pytest.mark.parametrize("token_level", [True, False])
def test_all_masked_gives_zero_loss_zero_grads_and_empty_extrema(token_level):
    cfg = dict(token_level_loss=token_level, reference_policy_kl_penalty=0.1)
    garbage = [[NAN, -INF, INF], [1e30, NAN, -INF]]
    curr = t(garbage).requires_grad_()
    loss, m = R.clipped_pg_loss(
        curr,
        t(garbage),
        t(garbage),
        t(garbage),
        t(garbage),
        torch.tensor([[0, 0, 0], [1, 1, 1]]),
        torch.tensor([1.0, 0.0]),
        PGLossConfig(**cfg),
        0,
        0,
    )
    loss.backward()
    assert loss.item() == 0.0 and (curr.grad == 0).all()
    assert m["ratio_min"].item() == INF and m["ratio_max"].item() == -INF
    assert all(v.item() == 0.0 for k, v in m.items() if "min" not in k and "max" not in k)


def test_all_masked_sequence_among_others_at_sequence_level():
    # seq1 has no valid token: its mean is 0, it still counts in G_seq (= 2, given by the caller)
    loss, _, grad = run(
        dict(token_level_loss=False, **BETA0),
        curr=[[0.0, 0.0], [NAN, NAN]],
        prev=[[0.0, 0.0], [NAN, NAN]],
        adv=[[1.0, 3.0], [NAN, NAN]],
        token_mask=[[1, 1], [0, 0]],
    )
    assert loss == approx(-(1 + 3) / 2 / 2)
    assert torch.isfinite(grad).all() and grad[1].tolist() == [0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# Invariances: micro-batches, padded vs packed
# ---------------------------------------------------------------------------------------------
CONFIGS = {
    "grpo": dict(),
    "dual_clip_k1_onpolicy": dict(
        ratio_clip_c=3.0,
        reference_policy_kl_type="k1",
        use_on_policy_kl_approximation=True,
        reference_policy_kl_penalty=0.05,
    ),
    "k2_seq_level": dict(reference_policy_kl_type="k2", token_level_loss=False, reference_policy_kl_penalty=0.1),
    "tis": dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.5,
        truncated_importance_sampling_ratio_min=0.7,
    ),
    "icepop": dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.5,
        truncated_importance_sampling_ratio_min=0.7,
    ),
    "seq_mask_tis": dict(
        use_importance_sampling_correction=True,
        token_level_loss=False,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.2,
        truncated_importance_sampling_ratio_min=0.8,
    ),
    "gspo": dict(
        sequence_level_importance_ratios=True, token_level_loss=False, use_importance_sampling_correction=True
    ),
    "reinforce_beta0": dict(disable_ppo_ratio=True, reference_policy_kl_penalty=0.0),
    # Variants (hand cases in test_pg_loss_variants.py)
    "seq_sum": dict(loss_aggregation="seq-mean-token-sum", reference_policy_kl_penalty=0.1),
    "seq_sum_norm": dict(
        loss_aggregation="seq-mean-token-sum-norm", loss_scale_factor=16, use_importance_sampling_correction=True
    ),
    "cispo": dict(use_cispo=True, ratio_clip_max=0.28, reference_policy_kl_penalty=0.05),
    "force_on_policy": dict(force_on_policy_ratio=True, use_importance_sampling_correction=True),
    "vapo_nll": dict(positive_example_nll_weight=0.1),
    "gspo_tis": dict(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.5,
        truncated_importance_sampling_ratio_min=0.7,
    ),
    "kl_detached": dict(kl_true_gradient=False, use_on_policy_kl_approximation=True, reference_policy_kl_penalty=0.05),
}


def random_batch(B=8, S=7, seed=0, dtype=torch.float32):
    """Padded [B, S] batch: prompt positions masked, ragged response lengths, one dropped sample."""
    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(B, S, generator=g, dtype=F64) * 3
    prev = gen + torch.randn(B, S, generator=g, dtype=F64) * 0.3
    curr = prev + torch.randn(B, S, generator=g, dtype=F64) * 0.3
    ref = prev + torch.randn(B, S, generator=g, dtype=F64) * 0.5
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, S).clone()
    lengths = torch.randint(2, S + 1, (B,), generator=g)
    token_mask = (torch.arange(S)[None, :] < lengths[:, None]) & (torch.arange(S)[None, :] >= 1)
    sample_mask = torch.ones(B)
    sample_mask[B // 2] = 0
    for x in (curr, prev, gen, ref, adv):  # padding holds garbage
        x[~token_mask] = NAN
    cast = lambda x: x.to(dtype)  # noqa: E731
    return dict(
        curr=cast(curr),
        prev=cast(prev),
        gen=cast(gen),
        ref=cast(ref),
        adv=cast(adv),
        token_mask=token_mask.to(dtype),
        sample_mask=sample_mask.to(dtype),
        lengths=lengths,
    )


def global_counts(batch):
    valid = batch["token_mask"].bool() & batch["sample_mask"].bool()[:, None]
    return int(valid.sum()), int(batch["sample_mask"].sum())


def call(impl, batch, cfg, rows, g_tok, g_seq):
    curr = batch["curr"][rows].clone().requires_grad_()
    loss, metrics = impl(
        curr,
        batch["prev"][rows],
        batch["gen"][rows],
        batch["ref"][rows],
        batch["adv"][rows],
        batch["token_mask"][rows],
        batch["sample_mask"][rows],
        cfg,
        g_tok,
        g_seq,
    )
    loss.backward()
    return loss, metrics, curr.grad


SUMMED = (
    "loss",
    "actor_loss",
    "kl_penalty",
    "ratio_mean",
    "clipped_ratio_mean",
    "clip_fraction",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "sampling_importance_ratio",
    "approx_entropy",
    "is_oob_fraction",
)


def check_micro_batch_invariance(impl, name, n_micro, B=8):
    cfg = PGLossConfig(**CONFIGS[name])
    batch = random_batch(B=B)
    g_tok, g_seq = global_counts(batch)
    full_loss, full_m, full_grad = call(impl, batch, cfg, slice(None), g_tok, g_seq)
    parts = [call(impl, batch, cfg, rows, g_tok, g_seq) for rows in torch.arange(B).chunk(n_micro)]
    loss = sum(p[0] for p in parts)
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.cat([p[2] for p in parts]), full_grad, rtol=1e-6, atol=1e-8)
    for key in SUMMED:
        torch.testing.assert_close(sum(p[1][key] for p in parts), full_m[key], rtol=1e-6, atol=1e-7)
    assert min(p[1]["ratio_min"] for p in parts) == full_m["ratio_min"]
    assert max(p[1]["clipped_ratio_max"] for p in parts) == full_m["clipped_ratio_max"]
    assert torch.isfinite(full_grad).all() and full_loss.dtype == torch.float32


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("n_micro", [1, 2, 4])
def test_micro_batch_sums_equal_the_full_batch(name, n_micro):
    check_micro_batch_invariance(R.clipped_pg_loss, name, n_micro)


def to_packed(batch):
    """Concatenate each row's first `length` positions; -> packed tensors and cu_seqlens."""
    lengths = batch["lengths"]
    rows = [torch.arange(int(n)) + i * batch["curr"].shape[1] for i, n in enumerate(lengths)]
    idx = torch.cat(rows + [torch.tensor([0, 0])])  # plus two tail-padding tokens
    packed = {k: batch[k].reshape(-1)[idx].clone() for k in ("curr", "prev", "gen", "ref", "adv", "token_mask")}
    packed["token_mask"][-2:] = 1  # tail padding is masked by cu_seqlens, whatever its mask says
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return packed, idx, cu


def check_packed_equals_padded(impl, name):
    cfg = PGLossConfig(**CONFIGS[name])
    batch = random_batch(dtype=F64)
    g_tok, g_seq = global_counts(batch)
    loss, metrics, grad = call(impl, batch, cfg, slice(None), g_tok, g_seq)
    packed, idx, cu = to_packed(batch)
    curr = packed["curr"].clone().requires_grad_()
    p_loss, p_metrics = impl(
        curr,
        packed["prev"],
        packed["gen"],
        packed["ref"],
        packed["adv"],
        packed["token_mask"],
        batch["sample_mask"],
        cfg,
        g_tok,
        g_seq,
        cu,
    )
    p_loss.backward()
    torch.testing.assert_close(p_loss, loss, rtol=1e-12, atol=1e-12)
    for key in metrics:
        torch.testing.assert_close(p_metrics[key], metrics[key], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(curr.grad[:-2], grad.reshape(-1)[idx[:-2]], rtol=1e-12, atol=1e-12)
    assert (curr.grad[-2:] == 0).all()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_equals_padded(name):
    check_packed_equals_padded(R.clipped_pg_loss, name)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def good_args():
    z = torch.zeros(2, 3)
    return dict(
        curr=z.clone(),
        prev=z.clone(),
        gen=z.clone(),
        ref=z.clone(),
        advantages=z.clone(),
        token_mask=torch.ones(2, 3),
        sample_mask=torch.ones(2),
        config=PGLossConfig(),
        global_valid_tokens=6,
        global_valid_seqs=2,
    )


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(prev=torch.zeros(2, 4)), "prev"),
        (dict(gen=torch.zeros(2, 3, dtype=F64)), "gen"),
        (dict(ref=torch.zeros(3, 2)), "ref"),
        (dict(advantages=torch.zeros(6)), "advantages"),
        (dict(token_mask=torch.ones(2, 2)), "token_mask"),
        (dict(sample_mask=torch.ones(3)), "sample_mask"),
        (dict(curr=torch.zeros(2, 3, dtype=torch.int64)), "curr"),
        (dict(curr=torch.zeros(2, 3, 1)), "curr"),
        (dict(config={"ratio_clip_min": 0.2}), "config"),
        (dict(global_valid_tokens=-1), "global_valid_tokens"),
        (dict(global_valid_seqs=torch.ones(2)), "global_valid_seqs"),
        (dict(cu_seqlens=torch.tensor([0, 3])), "cu_seqlens"),
    ],
)
def test_bad_input_names_the_argument(change, name):
    args = good_args()
    args.update(change)
    with pytest.raises(ValueError, match=name):
        R.clipped_pg_loss(**args)


def test_packed_input_needs_cu_seqlens():
    args = {k: (v.reshape(-1) if isinstance(v, torch.Tensor) and v.dim() == 2 else v) for k, v in good_args().items()}
    with pytest.raises(ValueError, match="cu_seqlens"):
        R.clipped_pg_loss(**args)
    args["cu_seqlens"] = torch.tensor([0, 3, 7])
    with pytest.raises(ValueError, match="cu_seqlens"):
        R.clipped_pg_loss(**args)


# ---------------------------------------------------------------------------------------------
# Triton kernels under the interpreter, against the reference (fp32 / fp64, tiny shapes)
# ---------------------------------------------------------------------------------------------
# VAPO's NLL runs on the reference (dispatch routes it; test_pg_loss_variants.py).
TRITON_CONFIGS = sorted(name for name in CONFIGS if name != "vapo_nll")


def triton_loss():
    pytest.importorskip("triton")
    from grpo_kernels.ops import pg_loss as K

    return lambda *args, **kwargs: K.clipped_pg_loss(*args, block=16, **kwargs)


@pytest.mark.parametrize("name", TRITON_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_triton_matches_reference(name, dtype):
    impl = triton_loss()
    cfg = PGLossConfig(**CONFIGS[name])
    batch = random_batch(B=6, S=7, seed=3, dtype=dtype)
    g_tok, g_seq = global_counts(batch)
    loss, metrics, grad = call(impl, batch, cfg, slice(None), g_tok, g_seq)
    ref_loss, ref_metrics, ref_grad = call(R.clipped_pg_loss, batch, cfg, slice(None), g_tok, g_seq)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(loss, ref_loss, **tol)
    torch.testing.assert_close(grad, ref_grad, **tol)
    assert grad.dtype == dtype and torch.isfinite(grad).all()
    assert metrics.keys() == ref_metrics.keys()
    for key in metrics:
        torch.testing.assert_close(metrics[key], ref_metrics[key], rtol=2e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize(
    "case",
    [
        "ppo",
        "dual_clip",
        "kl_k1",
        "kl_k2",
        "kl_k3",
        "on_policy_kl",
        "tis",
        "icepop",
        "seq_mask_tis",
        "reinforce",
        "sequence_level",
    ],
)
def test_triton_reproduces_the_hand_cases(case):
    """The hand-computed cases above (exact ties and clamp boundaries included), through Triton."""
    cases = {
        "ppo": (
            BETA0,
            dict(
                curr=[[NAN, L(1.5), L(0.5), 0.0, L(1.1)]],
                prev=[[-INF, 0.0, 0.0, 0.0, 0.0]],
                adv=[[NAN, 1.0, 1.0, -1.0, -2.0]],
                token_mask=[[0, 1, 1, 1, 1]],
            ),
        ),
        "dual_clip": (
            dict(ratio_clip_c=3.0, **BETA0),
            dict(curr=[[L(5.0), L(2.0), L(5.0)]], prev=[[0.0] * 3], adv=[[-1.0, -1.0, 1.0]]),
        ),
        "kl_k1": (dict(reference_policy_kl_type="k1", **KL_CLAMPS), KL_CASE),
        "kl_k2": (dict(reference_policy_kl_type="k2", **KL_CLAMPS), KL_CASE),
        "kl_k3": (dict(reference_policy_kl_type="k3", **KL_CLAMPS), KL_CASE),
        "on_policy_kl": (
            dict(reference_policy_kl_type="k1", use_on_policy_kl_approximation=True, **KL_CLAMPS),
            dict(
                curr=[[L(4.0), L(4.0)]], prev=[[L(4.0), L(4.0)]], gen=[[0.0, 0.0]], ref=[[L(4.0) + 0.5, L(4.0) + 0.25]]
            ),
        ),
        "tis": (
            dict(
                IS,
                truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=2.0,
                truncated_importance_sampling_ratio_min=0.5,
            ),
            IS_CASE,
        ),
        "icepop": (
            dict(
                IS,
                truncated_importance_sampling_type="icepop",
                truncated_importance_sampling_ratio=2.0,
                truncated_importance_sampling_ratio_min=0.5,
            ),
            IS_CASE,
        ),
        "seq_mask_tis": (
            dict(
                IS,
                truncated_importance_sampling_type="seq-mask-tis",
                truncated_importance_sampling_ratio=1.5,
                truncated_importance_sampling_ratio_min=0.5,
            ),
            dict(
                curr=[[0.0, 0.0], [0.0, 0.0]],
                prev=[[0.0, 0.0], [0.0, 0.0]],
                gen=[[-L(3.0), L(3.0)], [-L(4.0), 0.0]],
                adv=[[1.0, 1.0], [1.0, 1.0]],
            ),
        ),
        "reinforce": (
            dict(disable_ppo_ratio=True, ratio_clip_c=3.0, **BETA0),
            dict(curr=[[-1.0, -2.0]], prev=[[-5.0, -5.0]], adv=[[2.0, 1.0]]),
        ),
        "sequence_level": (
            dict(token_level_loss=False, **BETA0),
            dict(
                curr=[[0.0, NAN, NAN], [0.0, 0.0, 0.0]],
                prev=[[0.0, NAN, NAN], [0.0] * 3],
                adv=[[2.0, 0.0, 0.0], [-1.0] * 3],
                token_mask=[[1, 0, 0], [1, 1, 1]],
            ),
        ),
    }
    cfg, inputs = cases[case]
    loss, metrics, grad = run(cfg, **inputs, impl=triton_loss())
    ref_loss, ref_metrics, ref_grad = run(cfg, **inputs)
    assert loss == approx(ref_loss)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    for key in ref_metrics:
        assert metrics[key] == mapprox(ref_metrics[key]), key


@pytest.mark.parametrize("name", ["grpo", "k2_seq_level", "seq_mask_tis", "gspo_tis"])
def test_triton_micro_batches_and_packing(name):
    impl = triton_loss()
    check_micro_batch_invariance(impl, name, n_micro=2, B=4)
    check_packed_equals_padded(impl, name)


def test_triton_gradcheck_fp64():
    pytest.importorskip("triton")
    from grpo_kernels.ops import pg_loss as K

    # (On-policy KL is left out: its weight exp(curr - gen) is detached by definition. The KL
    # true gradient is too: its weight exp(curr - sg(curr)) has value 1, so finite differences
    # of the value see only the detached gradient.)
    cfg = PGLossConfig(
        ratio_clip_c=3.0,
        reference_policy_kl_type="k3",
        reference_policy_kl_penalty=0.1,
        kl_true_gradient=False,
        **{k: v for k, v in CONFIGS["tis"].items()},
    )
    batch = random_batch(B=2, S=5, seed=4, dtype=F64)
    args = [batch[k] for k in ("prev", "gen", "ref", "adv", "token_mask", "sample_mask")]
    curr = batch["curr"].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda c: K.clipped_pg_loss(c, *args, cfg, 7, 2, block=8)[0], (curr,))


def test_triton_all_masked_and_nan_poisoned_outputs(monkeypatch):
    impl = triton_loss()
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(fn):
        def make(*args, **kwargs):
            out = fn(*args, **kwargs)
            return out.fill_(NAN) if out.is_floating_point() else out

        return make

    monkeypatch.setattr(torch, "empty", poisoned(real_empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(real_empty_like))
    cfg = PGLossConfig(reference_policy_kl_penalty=0.1)
    garbage = [[NAN, -INF, INF, 1.0], [1e30, NAN, -INF, 2.0]]
    curr = t(garbage, torch.float32).requires_grad_()
    g = t(garbage, torch.float32)
    loss, m = impl(curr, g, g, g, g, torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]), torch.tensor([1.0, 0.0]), cfg, 0, 0)
    loss.backward()
    assert loss.item() == 0.0 and (curr.grad == 0).all()
    assert m["ratio_min"].item() == INF and m["ratio_max"].item() == -INF
    # 40 tokens over blocks of 16 (3 partial rows, reduced 2 rows at a time): every partial row,
    # statistic and gradient entry is written.
    from grpo_kernels.ops import pg_loss as K

    monkeypatch.setattr(K, "REDUCE_BLOCK", 2)
    batch = random_batch(B=5, S=8, seed=5)
    g_tok, g_seq = global_counts(batch)
    loss, m, grad = call(impl, batch, PGLossConfig(), slice(None), g_tok, g_seq)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for k, v in m.items() if "min" not in k and "max" not in k)


@pytest.mark.parametrize("name", ["grpo", "dual_clip_k1_onpolicy", "tis", "icepop", "k2_seq_level"])
def test_triton_is_one_launch_each_way(name, count_launches):
    """Forward = one launch (the last program folds the partial rows), backward = one launch, on
    any number of programs; sequence-level configs add host-side torch ops, no Triton launch."""
    impl = triton_loss()
    from grpo_kernels.ops import pg_loss as K

    launches = count_launches(K)
    batch = random_batch(B=6, S=30, seed=8)  # 180 tokens over blocks of 16: 12 programs
    g_tok, g_seq = global_counts(batch)
    curr = batch["curr"].clone().requires_grad_()
    args = [batch[k] for k in ("prev", "gen", "ref", "adv", "token_mask", "sample_mask")]
    loss, _ = impl(curr, *args, PGLossConfig(**CONFIGS[name]), g_tok, g_seq)
    assert launches == {"_pg_loss_fwd_kernel": 1}
    loss.backward()
    assert launches == {"_pg_loss_fwd_kernel": 1, "_pg_loss_bwd_kernel": 1}
    ref_loss, _ = R.clipped_pg_loss(batch["curr"], *args, PGLossConfig(**CONFIGS[name]), g_tok, g_seq)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=1e-7)


AOT_COMPILE = """
import inspect, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from grpo_kernels.loss_config import PGLossConfig
from grpo_kernels.ops import pg_loss as K

fn = K._pg_loss_fwd_kernel
const = dict(K._flags(PGLossConfig(reference_policy_kl_penalty=0.04)), N_SUMS=12, ACC=tl.float32, BLOCK=1024, BLOCK_P=256)
names = list(inspect.signature(fn.fn).parameters)
ptr_types = {"token_mask_ptr": "*u8", "seq_mask_ptr": "*u8", "counter_ptr": "*i32"}
sig = {n: "constexpr" if n in const else ptr_types.get(n, "*fp32") if n.endswith("_ptr") else "i32" for n in names}
src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print("atom.global.gpu.acq_rel.add" in ptx, "ld.global.cg" in ptx, "bar.sync" in ptx)
"""


def test_triton_forward_compiles_for_sm90_with_its_ordering():
    """The interpreter runs programs one after another, so it cannot exercise the last-program
    fold's memory ordering; this compiles the real kernel for an H100/H200 (no GPU needed) and
    checks the PTX has the barrier, the acq_rel gpu-scope counter and L2 (.cg) loads of the rows."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", AOT_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode and "ptxas" in out.stderr.lower() and "not found" in out.stderr.lower():
        pytest.skip("triton's bundled ptxas is missing")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["True", "True", "True"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", TRITON_CONFIGS)
def test_cuda_dispatch_matches_reference(name):
    import grpo_kernels

    cfg = PGLossConfig(**CONFIGS[name])
    batch = {k: v.cuda() for k, v in random_batch(B=64, S=257, seed=6).items()}
    g_tok, g_seq = global_counts(batch)
    loss, metrics, grad = call(grpo_kernels.clipped_pg_loss, batch, cfg, slice(None), g_tok, g_seq)
    ref_loss, ref_metrics, ref_grad = call(R.clipped_pg_loss, batch, cfg, slice(None), g_tok, g_seq)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)
    for key in ref_metrics:
        torch.testing.assert_close(metrics[key], ref_metrics[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_forward_is_bitwise_deterministic():
    """On a GPU any program may finish last and fold the partial rows; the fold runs in row
    order, so repeated calls give bit-identical loss and metrics."""
    import grpo_kernels

    cfg = PGLossConfig(reference_policy_kl_penalty=0.04)
    batch = {k: v.cuda() for k, v in random_batch(B=512, S=1024, seed=10).items()}
    g_tok, g_seq = global_counts(batch)
    args = [batch[k] for k in ("curr", "prev", "gen", "ref", "adv", "token_mask", "sample_mask")]
    first_loss, first = grpo_kernels.clipped_pg_loss(*args, cfg, g_tok, g_seq)
    for _ in range(20):
        loss, metrics = grpo_kernels.clipped_pg_loss(*args, cfg, g_tok, g_seq)
        assert torch.equal(loss, first_loss)
        assert all(torch.equal(metrics[k], first[k]) for k in first)
