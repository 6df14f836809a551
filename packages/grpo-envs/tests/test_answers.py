"""Answer extraction from untrusted text."""

import time

import pytest

from grpo_envs.answers import answer_line, canonical_integer, code_block, first_integer, last_boxed, math_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("46", "46"),
        (" 46 </s>", "46"),
        ("46<|endoftext|>", "46"),
        ("-12 ", "-12"),
        ("+007", "7"),
        ("-0", "0"),
        ("000", "0"),
        ("abc", None),
        ("", None),
        ("x 5 y 6", "5"),
        ("1" * 10_000, "1" * 10_000),
    ],
)
def test_first_integer(text, expected):
    assert first_integer(text) == expected


def test_canonical_integer_rejects_non_integers():
    assert canonical_integer("4.5") is None
    assert canonical_integer("1e3") is None
    assert canonical_integer(" 12 ") == "12"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{5}", "5"),
        ("a \\boxed{1} b \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2", "1"),
        ("\\fbox{3}", "3"),
        ("\\boxed {4}", "4"),
        ("no box", None),
        ("}}} \\boxed{7} }}", "7"),
        ("\\boxed{\\boxed{8}}", "8"),
        ("\\boxed{}", ""),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_last_boxed_is_linear_on_hostile_input():
    text = "\\boxed{" * 200_000  # a million characters of unclosed boxes
    t0 = time.perf_counter()
    assert last_boxed(text) is None
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: 42", "42"),
        ("work\nAnswer: $\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("ANSWER: \\(x+1\\)", "x+1"),
        ("Answer: 1\nAnswer: 2\nbye", "2"),
        ("Answer:", None),
        ("nothing", None),
    ],
)
def test_answer_line(text, expected):
    assert answer_line(text) == expected


def test_math_answer_prefers_boxed():
    assert math_answer("Answer: 1\n\\boxed{2}") == "2"
    assert math_answer("\\boxed{ } Answer: 3") == "3"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("```python\nprint(1)\n```", "print(1)\n"),
        ("```python\na=1\n```\ntext\n```python\nb=2\n```", "b=2\n"),
        ("```py\nc=3\n```", "c=3\n"),
        ("```\nd=4\n```", "d=4\n"),
        ("```python\ne=5\n```\n```bash\nls\n```", "e=5\n"),
        ("x = 1\nprint(x)", "x = 1\nprint(x)"),
        ("```python\nunclosed", "```python\nunclosed"),
    ],
)
def test_code_block(text, expected):
    assert code_block(text) == expected
