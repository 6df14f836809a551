import collections
import textwrap

import pytest

from grpo_data.arithmetic import ArithmeticDataset
from grpo_data.config import DataConfig
from grpo_data.dataloader import InfiniteDataLoader
from grpo_data.datasets import ProcessedDataset
from grpo_data.errors import DataError
from grpo_data.multi_dataloader import MultiDataLoader, get_sampler, learnability, make_train_iterator
from grpo_data.records import TaskSpec

LETTERS = ["a", "b", "c", "d"]
NUMBERS = [1, 2, 3, 4, 5, 6, 7, 8]


def test_documented_interleaving():
    loader = MultiDataLoader(
        {"letters": LETTERS, "numbers": NUMBERS}, num_prompts_per_dataloader=2, seed=0, shuffle=False
    )
    assert [next(loader) for _ in range(3)] == [["a", "b", 1, 2], ["c", "d", 3, 4], ["a", "b", 5, 6]]


@pytest.mark.parametrize("sampler", ["round_robin", "reward_weighted"])
def test_state_round_trips_for_exact_resume(sampler):
    def make():
        return MultiDataLoader(
            {"x": list(range(10)), "y": list(range(100, 113)), "z": list(range(200, 207))},
            num_prompts_per_dataloader=3, seed=4, sampler=sampler, expected_num_prompts=9,
        )  # fmt: skip

    loader = make()
    for step in range(5):
        next(loader)
        loader.set_records({"x": {"reward": 0.9}, "y": {"reward": [0.5, 0.4, 0.3, 0.2, 0.1][step]}})
    state = loader.state_dict()
    tail = [next(loader) for _ in range(6)]
    resumed = make()
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(6)] == tail
    assert resumed.records == {"x": {"reward": 0.9}, "y": {"reward": 0.1}}


def test_reward_weighted_prefers_datasets_with_signal():
    loader = MultiDataLoader(
        {"solved": ["s"] * 4, "half": ["h"] * 4, "hopeless": ["n"] * 4}, 2, seed=0, sampler="reward_weighted"
    )
    loader.set_records({"solved": {"reward": 1.0}, "half": {"reward": 0.5}, "hopeless": {"reward": 0.0}})
    counts = collections.Counter(item for _ in range(200) for item in next(loader))
    assert counts["h"] > 10 * max(counts["s"], counts["n"])
    assert sum(counts.values()) == 200 * 6
    assert learnability(None) == learnability(0.5) and learnability(2.0) == learnability(1.0)


def test_custom_sampler_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_sampling.py").write_text(
        textwrap.dedent(
            """
            def first_only(ctx):
                return next(ctx.loaders["a"]) + next(ctx.loaders["a"])

            def too_few(ctx):
                return next(ctx.loaders["a"])
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    loader = MultiDataLoader({"a": LETTERS, "b": NUMBERS}, 2, 0, shuffle=False, sampler="my_sampling:first_only")
    assert next(loader) == ["a", "b", "c", "d"]
    short = MultiDataLoader({"a": LETTERS}, 2, 0, sampler="my_sampling:too_few", expected_num_prompts=4)
    with pytest.raises(
        DataError, match=r"sampler 'my_sampling:too_few' returned 2 prompts at step 0, expected num_prompts_per_step=4"
    ):
        next(short)
    with pytest.raises(DataError, match="built-in samplers"):
        get_sampler("nope")


def test_records_for_unknown_datasets_are_refused():
    loader = MultiDataLoader({"a": LETTERS}, 2, 0)
    with pytest.raises(DataError, match="unknown dataset 'b'"):
        loader.set_records({"b": {"reward": 1.0}})


def test_make_train_iterator_from_the_data_section(tokenizer):
    def processed(name, seed, size):
        return ProcessedDataset(ArithmeticDataset(size, seed), "plain", TaskSpec(name), tokenizer, 32)

    a, b = processed("a", 1, 10), processed("b", 2, 6)
    single = make_train_iterator(DataConfig(shuffle=False), [a], num_prompts_per_step=4, seed=0)
    assert isinstance(single, InfiniteDataLoader) and [d.idx for d in next(single)] == [0, 1, 2, 3]
    concat = make_train_iterator(DataConfig(), [a, b], num_prompts_per_step=4, seed=0)
    assert concat.batches_per_epoch == 4
    multi = make_train_iterator(
        DataConfig(use_multiple_dataloader=True, num_prompts_per_dataloader=2, shuffle=False), [a, b], 4, seed=0
    )
    assert [(d.dataset_name, d.idx) for d in next(multi)] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    with pytest.raises(DataError, match="num_prompts_per_dataloader"):
        make_train_iterator(DataConfig(use_multiple_dataloader=True), [a, b], 4, seed=0)
    with pytest.raises(DataError, match="expected num_prompts_per_step=6"):
        next(make_train_iterator(DataConfig(use_multiple_dataloader=True, num_prompts_per_dataloader=2), [a, b], 6, 0))
