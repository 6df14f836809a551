"""`checkpointing.checkpoint_must_save_by`: save and stop before a job's time runs out.

NeMo RL's semantics: the budget ("DD:HH:MM:SS" or "HH:MM:SS") counts from the start of the
training loop. After each step the loop asks `step_done()`; it answers True when the time spent
plus one more step (estimated as the longest step so far) would reach the budget. The loop then
saves a checkpoint (whether or not one was due) and returns; running the same command resumes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from grpo_train.config.schema import parse_duration


class SaveDeadline:
    def __init__(self, budget: str | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_s = parse_duration(budget) if budget else None
        self.clock = clock
        self.started = self.last = clock()
        self.longest_step_s = 0.0
        self.expired = False

    def step_done(self) -> bool:
        """Record the end of a step; True when the next step would run past the budget."""
        now = self.clock()
        self.longest_step_s = max(self.longest_step_s, now - self.last)
        self.last = now
        if self.budget_s is not None and (now - self.started) + self.longest_step_s >= self.budget_s:
            self.expired = True
        return self.expired

    def announce(self, step: int) -> None:
        spent = self.last - self.started
        print(
            f"grpo: checkpointing.checkpoint_must_save_by: {spent:.0f} s of {self.budget_s:.0f} s spent and the "
            f"longest step took {self.longest_step_s:.0f} s; saved a checkpoint at step {step} and stopping "
            f"(run the same command again to resume)",
            file=sys.stderr,
            flush=True,
        )
