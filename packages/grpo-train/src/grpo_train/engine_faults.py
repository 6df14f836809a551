"""Surviving the death of a generation engine: start it again, reload the current weights, retry.

Job: the loops run each phase that calls the engines (a step's generation, the weight push, the
refit check, validation) through `EngineSupervisor.retry`. When the phase fails because an
engine's Ray actor died (`RayActorError`: ActorDiedError, ActorUnavailableError), the supervisor
finds which engines no longer answer, starts each again from its factory (same placement and
options, `setup.engine_factories`), reconnects the run's weight transport, pushes the trainer's
current weights at the current weight version (the normal refit path), gates them with the refit
check when it is on, tells its listeners (the async collector) and runs the phase again — at most
`policy.generation.max_engine_restarts` times in a run, then `EngineFailed` stops the run with one
line (exit 1). The phase itself reseeds, so a retried step samples what it would have sampled.
Boundary: no knowledge of what a phase does; the loop says how to rewind it (`rewind`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError

from grpo_train.refit import push_weights
from grpo_train.train_step import check_refit

T = TypeVar("T")


class EngineFailed(RuntimeError):
    """Engines kept dying after the configured restarts; the message is the run's last line."""


def is_engine_fault(exc: BaseException) -> bool:
    """A dead actor, raised directly or inside the error of a task that called it."""
    return isinstance(exc, RayActorError) or isinstance(getattr(exc, "cause", None), RayActorError)


class EngineSupervisor:
    """See the module docstring. `parts` holds `generator` (the `GeneratorGroup`), `policy`,
    `engine_factories` (one per engine); `version` gives the current weight version."""

    def __init__(
        self, parts, max_restarts: int, version: Callable[[], int], refit_gate: Callable[[Any], None] | None = None
    ) -> None:
        self.parts = parts
        self.max_restarts = max_restarts
        self.version = version
        self.refit_gate = refit_gate  # called with the generator after a restart's push
        self.restarts = 0
        self.listeners: list[Callable[[Any], None]] = []  # told the new generator after a restart
        self.last_probe: list = []  # the rollouts the loop's refit check scored last (`checked_refit`)

    def retry(self, phase: str, attempt: Callable[[], T], rewind: Callable[[], None] | None = None) -> T:
        """`attempt()`; after an engine death, restart the dead engines, `rewind()` and attempt again."""
        while True:
            try:
                return attempt()
            except Exception as exc:
                if not is_engine_fault(exc) or not self.restart_dead(phase, exc):
                    raise
            if rewind is not None:
                rewind()

    def restart_dead(self, phase: str, cause: BaseException | str) -> bool:
        """Start the engines that no longer answer again (False: every engine answers, nothing
        was restarted); raises `EngineFailed` once the restarts are spent."""
        group = self.parts.generator
        dead = group.dead()
        if not dead:
            return False
        what = cause if isinstance(cause, str) else type(getattr(cause, "cause", None) or cause).__name__
        if self.restarts >= self.max_restarts or not self.parts.engine_factories:
            names = ", ".join(str(i) for i in dead)
            raise EngineFailed(
                f"generation engine {names} of {len(group.engines)} died during {phase} ({what}) after "
                f"{self.restarts} restart(s) (policy.generation.max_engine_restarts={self.max_restarts}); the last "
                "checkpoint stays intact"
            )
        self.restarts += 1
        engines = list(group.engines)
        for i in dead:
            try:
                ray.kill(engines[i])
            except Exception:  # noqa: BLE001 - already gone
                pass
            engines[i] = self.parts.engine_factories[i]()
        ray.get([engines[i].ready.remote() for i in dead])
        group.engines = engines
        self._reload_weights()
        for listener in self.listeners:
            listener(group)
        return True

    def _reload_weights(self) -> None:
        """Reconnect the run's transport to the new engines, push the current weights, gate them."""
        policy, group = self.parts.policy, self.parts.generator
        policy.attach(policy.transport, group.engines)
        push_weights(policy, self.version())
        if self.refit_gate is not None:
            self.refit_gate(group)

    def metrics(self) -> dict[str, float]:
        return {"generation/engine_restarts": float(self.restarts)}


def supervise(cfg, parts, state) -> EngineSupervisor:
    """The run's supervisor: `policy.generation.max_engine_restarts`, the state's weight version,
    and the refit check (when on) on the last probe the loop checked (`check_refit`)."""

    supervisor = EngineSupervisor(parts, cfg.policy.generation.max_engine_restarts, lambda: state.weight_version)

    def gate(generator) -> None:
        if cfg.grpo.refit_check.enabled and supervisor.last_probe:
            check_refit(cfg, parts.policy, generator, supervisor.last_probe)

    supervisor.refit_gate = gate
    memory = getattr(parts, "memory", None)
    if memory is not None:  # the colocation choreography sleeps and wakes the restarted engines too
        supervisor.listeners.append(memory.engines_replaced)
    return supervisor


def checked_refit(cfg, parts, supervisor: EngineSupervisor, probe: list) -> dict[str, float]:
    """The loop's refit check, through the supervisor (its probe then gates restarted engines too)."""

    supervisor.last_probe = list(probe)
    return supervisor.retry("the refit check", lambda: check_refit(cfg, parts.policy, parts.generator, probe))
