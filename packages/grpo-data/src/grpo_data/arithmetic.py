"""The synthetic arithmetic task of the offline demo, deterministic by seed.

A row is `{"problem": "37+5=", "answer": "42"}`: operands are uniform integers with at most
`digits` digits (`rng.randint(0, 10**digits - 1)`), the answer is the exact result as a decimal
string. The default is 2-digit addition, the level the bundled tiny model learns within minutes;
more digits and the operations "-" and "*" make harder levels.

This format is shared with the script that trains the bundled model: do not change it.
Row i depends only on (seed, i), so a set can be regenerated lazily in any order, and train and
validation sets drawn with different seeds are disjoint up to chance collisions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from grpo_data.errors import DataError

OPERATIONS = ("+", "-", "*")
MIN_DIGITS, MAX_DIGITS = 1, 4
DEFAULT_DIGITS = 2
DEFAULT_OPERATIONS = ("+",)


def make_problem(
    rng: random.Random, digits: int = DEFAULT_DIGITS, operations: Sequence[str] = DEFAULT_OPERATIONS
) -> dict:
    """Draw one problem from `rng`. Pure apart from advancing `rng`.

    Draw order: a, b, then the operation (only when there is more than one to choose from), so
    single-operation sets draw exactly two integers per row. For "-" the operands are ordered so
    that the answer is never negative (a tiny model's vocabulary need not know "-" as a sign).
    """
    a = rng.randint(0, 10**digits - 1)
    b = rng.randint(0, 10**digits - 1)
    op = operations[0] if len(operations) == 1 else rng.choice(tuple(operations))
    if op == "+":
        result = a + b
    elif op == "-":
        a, b = max(a, b), min(a, b)
        result = a - b
    elif op == "*":
        result = a * b
    else:
        raise DataError(f"arithmetic: unknown operation {op!r}; expected one of {OPERATIONS}")
    return {"problem": f"{a}{op}{b}=", "answer": str(result)}


def _check_level(digits: int, operations: Sequence[str]) -> tuple[str, ...]:
    if isinstance(operations, str):
        operations = tuple(operations)
    operations = tuple(operations)
    if not isinstance(digits, int) or not MIN_DIGITS <= digits <= MAX_DIGITS:
        raise DataError(f"arithmetic: digits={digits!r}; expected an integer in {MIN_DIGITS}..{MAX_DIGITS}")
    if not operations or any(op not in OPERATIONS for op in operations):
        raise DataError(f"arithmetic: operations={operations!r}; expected a non-empty subset of {OPERATIONS}")
    return operations


class ArithmeticDataset:
    """Map-style dataset of `size` arithmetic rows; row i is drawn from an rng seeded by (seed, i)."""

    def __init__(
        self,
        size: int,
        seed: int,
        digits: int = DEFAULT_DIGITS,
        operations: tuple[str, ...] = DEFAULT_OPERATIONS,
    ) -> None:
        if not isinstance(size, int) or size < 1:
            raise DataError(f"arithmetic: size={size!r}; expected a positive integer")
        self.size = size
        self.seed = int(seed)
        self.digits = digits
        self.operations = _check_level(digits, operations)
        self.source = f"arithmetic(seed={self.seed}, digits={digits}, operations={''.join(self.operations)})"

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(f"arithmetic row {i} out of range for size {self.size}")
        # A string seed is hashed with SHA-512 by `random`, stable across processes and runs.
        rng = random.Random(f"arithmetic:{self.seed}:{i}")
        return make_problem(rng, self.digits, self.operations)

    def __repr__(self) -> str:
        return f"ArithmeticDataset(size={self.size}, {self.source})"
