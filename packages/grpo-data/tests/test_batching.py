import pytest
import torch

from grpo_data.batching import pad_prompts
from grpo_data.errors import DataError
from grpo_data.processors import math_processor, plain_processor
from grpo_data.records import TaskSpec


@pytest.fixture
def batch(tokenizer):
    return [
        plain_processor({"problem": "1+1=", "answer": "2"}, TaskSpec("t"), tokenizer, 64, 0),
        plain_processor({"problem": "12+34=", "answer": "46"}, TaskSpec("t"), tokenizer, 64, 1),
        math_processor({"problem": "123456", "answer": "1"}, TaskSpec("t"), tokenizer, 5, 2),  # truncated
    ]


def test_left_padding_exact_ids_and_masks(batch):
    out = pad_prompts(batch, pad_token_id=0)
    assert out.input_ids.tolist() == [
        [0, 0, 10, 19, 10, 22],
        [10, 11, 19, 12, 13, 22],
        [0, 5, 10, 11, 12, 13],
    ]
    assert out.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]
    assert out.lengths.tolist() == [4, 6, 5]
    assert out.loss_multiplier.tolist() == [1.0, 1.0, 0.0]
    assert out.input_ids.dtype == torch.long and out.loss_multiplier.dtype == torch.float32


def test_right_padding(batch):
    out = pad_prompts(batch[:2], pad_token_id=99, padding_side="right")
    assert out.input_ids.tolist() == [[10, 19, 10, 22, 99, 99], [10, 11, 19, 12, 13, 22]]
    assert out.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]


def test_bad_arguments(batch):
    with pytest.raises(DataError, match="padding_side"):
        pad_prompts(batch, 0, padding_side="middle")
    with pytest.raises(DataError, match="empty batch"):
        pad_prompts([], 0)
