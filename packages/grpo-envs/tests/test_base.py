"""EnvOutput, metric merging and message helpers."""

import pytest

from grpo_envs.base import Environment, EnvOutput, count_turns, preview, response_text


def test_env_output_checks_lengths():
    with pytest.raises(ValueError, match="terminateds has 1 entries but rewards has 2"):
        EnvOutput(rewards=[0.0, 1.0], observations=[None, None], terminateds=[True], metadata=[{}, {}])


def test_concat_keeps_order():
    a = EnvOutput([1.0], [None], [True], [{"i": 0}])
    b = EnvOutput([0.0, 0.5], [{"role": "environment", "content": "x"}, None], [False, True], [{"i": 1}, {"i": 2}])
    out = EnvOutput.concat([a, b], {"m": 1.0})
    assert out.rewards == [1.0, 0.0, 0.5]
    assert [m["i"] for m in out.metadata] == [0, 1, 2]
    assert out.terminateds == [True, False, True]
    assert out.metrics == {"m": 1.0}


class _Counting(Environment):
    COUNT_METRICS = frozenset({"timeouts"})

    def step(self, message_logs, env_infos):
        raise NotImplementedError


def test_merge_metrics_weights_means_and_sums_counts():
    # chunk 1: 3 samples, accuracy 1/3, 1 timeout; chunk 2: 1 sample, accuracy 1, 2 timeouts
    merged = _Counting.merge_metrics(
        [({"accuracy": 1 / 3, "timeouts": 1.0}, 3), ({"accuracy": 1.0, "timeouts": 2.0}, 1)]
    )
    assert merged == {"accuracy": pytest.approx(0.5), "timeouts": 3.0}
    # a chunk without metrics (failed samples) does not dilute the mean
    assert _Counting.merge_metrics([({"accuracy": 1.0}, 2), ({}, 5)]) == {"accuracy": 1.0}
    assert _Counting.merge_metrics([]) == {}


def test_response_text_takes_last_assistant_message():
    log = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a1"},
        {"role": "environment", "content": "higher"},
        {"role": "assistant", "content": "a2"},
    ]
    assert response_text(log) == "a2"
    assert count_turns(log) == 2
    assert response_text([{"role": "user", "content": "q"}]) is None
    assert response_text([{"role": "assistant", "content": [{"type": "text", "text": "x"}, {"text": "y"}]}]) == "xy"
    assert response_text([{"role": "assistant", "content": None}]) == ""
    assert response_text(["garbage", {"role": "assistant"}]) == ""


def test_preview():
    assert preview("abc") == "abc"
    assert preview(None) is None
    assert preview("x" * 300, 10) == "x" * 10 + "...[290 more chars]"
