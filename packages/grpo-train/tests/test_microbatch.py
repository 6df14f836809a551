"""Micro-batch planners and layouts: every row exactly once, budgets kept, widths rounded,
packed streams with per-sequence positions, errors that name the config key."""

from __future__ import annotations

import random

import pytest
import torch

from grpo_train.config.schema import PolicyConfig
from grpo_train.policy import microbatch
from grpo_train.policy.microbatch import (
    PACKING_ALGORITHMS,
    DynamicBatching,
    MicroBatch,
    PaddedRows,
    SequencePacking,
    make_planner,
    pack_rows,
    row_lengths,
    rows_of,
    unpack_rows,
)


def cfg(**kw) -> PolicyConfig:
    return PolicyConfig(train_global_batch_size=8, train_micro_batch_size=4, logprob_batch_size=3, **kw)


def random_lengths(seed: int, n: int = 40, low: int = 1, high: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def check_partition(plan: list[MicroBatch], lengths: list[int]) -> None:
    rows = sorted(r for mb in plan for r in mb.rows)
    assert rows == list(range(len(lengths)))
    for mb in plan:
        assert mb.lengths == tuple(lengths[r] for r in mb.rows)


# ----------------------------------------------------------------------- choosing
@pytest.mark.parametrize(
    "kw,planner",
    [
        ({}, PaddedRows),
        ({"dynamic_batching": {"enabled": True}}, DynamicBatching),
        ({"sequence_packing": {"enabled": True}}, SequencePacking),
    ],
)
def test_make_planner_follows_the_config(kw, planner):
    assert type(make_planner(cfg(**kw), "train")) is planner
    assert type(make_planner(cfg(**kw), "logprob")) is planner


def test_budgets_and_row_counts_come_from_the_purpose():
    c = cfg(
        dynamic_batching={"enabled": True, "train_mb_tokens": 100, "logprob_mb_tokens": 300, "sequence_length_round": 8}
    )
    train, logprob = make_planner(c, "train"), make_planner(c, "logprob")
    assert (train.budget, train.round_to, train.key) == (100, 8, "policy.dynamic_batching.train_mb_tokens")
    assert (logprob.budget, logprob.key) == (300, "policy.dynamic_batching.logprob_mb_tokens")
    assert make_planner(cfg(), "train").rows_per_microbatch == 4
    assert make_planner(cfg(), "logprob").rows_per_microbatch == 3
    packing = make_planner(cfg(sequence_packing={"enabled": True, "algorithm": "best_fit_decreasing"}), "train")
    assert packing.algorithm == "best_fit_decreasing" and packing.key == "policy.sequence_packing.train_mb_tokens"


# ------------------------------------------------------------------------ padded
def test_padded_rows_in_order_trimmed_to_their_longest():
    plan = PaddedRows(3).plan([5, 2, 9, 4, 1, 3, 7], batch_width=9)
    assert [mb.rows for mb in plan] == [(0, 1, 2), (3, 4, 5), (6,)]
    assert [mb.width for mb in plan] == [9, 4, 7]
    assert not any(mb.packed for mb in plan)
    assert PaddedRows(2).plan([1, 1], batch_width=5)[0].width == 2  # one next-token logprob needs 2 columns


# ----------------------------------------------------------------------- dynamic
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget,round_to", [(128, 1), (256, 16), (300, 64), (100, 64)])
def test_dynamic_batching_keeps_the_budget(seed, budget, round_to):
    lengths = random_lengths(seed)
    plan = DynamicBatching(budget, round_to, "k").plan(lengths, batch_width=100)
    check_partition(plan, lengths)
    for mb in plan:
        longest = max(mb.lengths)
        assert mb.tokens <= budget
        assert longest <= mb.width <= min(budget, 100)
        assert mb.width % round_to == 0 or mb.width in (budget, 100)  # rounding capped by budget / batch
    # Sorted by length: micro-batches do not interleave (a longer one never holds a shorter row
    # than a later micro-batch's longest).
    for a, b in zip(plan, plan[1:]):
        assert min(a.lengths) >= max(b.lengths)


def test_dynamic_batching_has_less_padding_than_padded_rows():
    lengths = random_lengths(0, n=64, low=4, high=200)
    dynamic = DynamicBatching(4 * 200, 8, "k").plan(lengths, batch_width=200)
    padded = PaddedRows(4).plan(lengths, batch_width=200)
    assert sum(mb.tokens for mb in dynamic) < sum(mb.tokens for mb in padded)


# ----------------------------------------------------------------------- packing
@pytest.mark.parametrize("algorithm", sorted(PACKING_ALGORITHMS))
@pytest.mark.parametrize("round_to", [1, 16, 64])
def test_packing_keeps_the_budget_and_uses_grpo_kernels(algorithm, round_to):
    from grpo_kernels.packing import pack_lengths

    lengths = random_lengths(1)
    plan = SequencePacking(256, round_to, "k", algorithm).plan(lengths, batch_width=100)
    check_partition(plan, lengths)
    assert [list(mb.rows) for mb in plan] == pack_lengths(lengths, 256, PACKING_ALGORITHMS[algorithm])
    for mb in plan:
        assert mb.packed
        assert sum(mb.lengths) <= mb.width <= 256
        assert mb.width % round_to == 0 or mb.width == 256


def test_unknown_packing_algorithm_names_the_key():
    with pytest.raises(ValueError, match="policy.sequence_packing.algorithm='nope'"):
        SequencePacking(64, 1, "k", "nope")


@pytest.mark.parametrize(
    "planner", [DynamicBatching(50, 8, "policy.x.train_mb_tokens"), SequencePacking(50, 8, "policy.x.train_mb_tokens")]
)
def test_a_sequence_over_the_budget_is_an_error_naming_the_key(planner):
    with pytest.raises(
        ValueError,
        match=r"policy.x.train_mb_tokens=50: row 2 of the batch is 61 tokens long "
        r"\(2 row\(s\) exceed the budget\).*at least 61",
    ):
        planner.plan([10, 51, 61, 3], batch_width=61)
    planner.plan([10, 50, 3], batch_width=50)  # exactly the budget fits


@pytest.mark.parametrize("planner", [PaddedRows(2), DynamicBatching(64, 8, "k"), SequencePacking(64, 8, "k")])
def test_dummy_is_the_shortest_row_alone_in_the_planners_layout(planner):
    mb = planner.dummy([7, 3, 9, 3], batch_width=9)
    assert (mb.rows, mb.lengths, mb.packed) == ((1,), (3,), planner.packed)
    assert mb.width == 3


# ----------------------------------------------------------------------- layouts
def test_row_lengths_refuses_left_padding():
    assert row_lengths(torch.tensor([[1, 1, 0], [1, 1, 1]])) == [2, 3]
    with pytest.raises(ValueError, match="row 1 is not right-padded"):
        row_lengths(torch.tensor([[1, 1, 0], [0, 1, 1]]))


def test_rows_of_slices_every_tensor():
    batch = {"input_ids": torch.arange(12).view(3, 4), "sample_mask": torch.tensor([1.0, 0.0, 1.0])}
    out = rows_of(batch, (2, 0), width=3)
    assert torch.equal(out["input_ids"], torch.tensor([[8, 9, 10], [0, 1, 2]]))
    assert torch.equal(out["sample_mask"], torch.tensor([1.0, 1.0]))


def test_pack_rows_resets_positions_and_covers_the_tail():
    input_ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    mb = MicroBatch(rows=(0, 2), lengths=(3, 4), width=10, packed=True)
    packed = pack_rows(input_ids, mb, pad_id=0)
    assert packed.input_ids.tolist() == [1, 2, 3, 6, 7, 8, 9, 0, 0, 0]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]
    assert packed.cu_seqlens.tolist() == [0, 3, 7, 10]
    assert (packed.max_seqlen, packed.num_rows) == (4, 2)
    values = torch.arange(10.0, requires_grad=True)
    rows = unpack_rows(values, packed)
    assert rows.tolist() == [[0, 1, 2, 0], [3, 4, 5, 6]]
    rows.sum().backward()
    assert values.grad.tolist() == [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]  # the tail gets no gradient
    exact = pack_rows(input_ids, MicroBatch((1,), (2,), 2, packed=True))
    assert exact.cu_seqlens.tolist() == [0, 2] and exact.input_ids.tolist() == [4, 5]


def test_module_names_its_planners():
    assert set(microbatch.PLANNERS) == {"padded", "dynamic_batching", "sequence_packing"}
