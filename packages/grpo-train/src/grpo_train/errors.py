"""The error types of grpo-train, in one module that imports nothing (no torch, no Ray).

Each is raised where the problem is found and caught at the top (`grpo_train.run`, the CLI),
which prints it as one line and exits 2 (config and startup problems) or stops the run. The
modules that raise them re-export them, so `from grpo_train.setup import StartupError` keeps
working. Configuration problems have their own type, `grpo_train.config.errors.ConfigError`
(it carries the file and the key path); `refit.check.RefitMismatchError` stays beside the
statistics it reports.
"""

from __future__ import annotations


class StartupError(RuntimeError):
    """A problem found before training starts; printed as one line, exit code 2."""


class PlanError(ValueError):
    """The plan cannot be made or does not fit; one line naming the keys to change."""


class NotMoEError(ValueError):
    """The model has no router logits to balance."""


class UnsupportedFamilyError(KeyError):
    """A model whose weights grpo cannot name the way the engine loads them."""

    def __str__(self) -> str:  # KeyError quotes its message; print it plainly
        return str(self.args[0])


class StateFileError(ValueError):
    """A state file that cannot be read back as the value that was saved."""


class NoIntactCheckpoint(RuntimeError):
    """Checkpoints exist but every one fails its manifest check."""


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the optimizer step was not taken."""
