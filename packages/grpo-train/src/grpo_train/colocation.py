"""Colocated memory choreography: who holds a GPU that the trainer and the engine share, and when.

Job: with generation colocated on the policy's GPUs (`policy.generation.colocated.enabled` and
`cluster.gpus_per_node > 0`) only one side may be resident at a time. This module holds the one
order of moves; the sync GRPO, async GRPO and PPO loops call its three phase functions at the
same points, and start-up calls `start_engines_first`:

  start-up     the engines start and profile their memory on a clean GPU (the trainer's ranks
               have loaded the model on the host), sleep; then the trainer moves to its GPUs.
  training     before logprobs / values / optimizer steps: engines sleep (vLLM level 1: weights
               to the host, KV cache dropped), then the trainer reloads everything it offloaded.
  refit        before a weight push and refit check: the trainer offloads gradients, optimizer
               state and the reference (`REFIT_OFFLOAD`) and empties its allocator's cache; the
               engines wake; the trainer's weights stay for the push and the probe's scoring.
  generation   before rollouts and validation: the trainer offloads everything (`FULL_OFFLOAD`),
               empties its cache, and the engines wake.
  checkpoint   as training (FSDP2 gathers the full state with collectives on the device).

So a GPU holds at most max(trainer, trainer weights + engine share, engine share) instead of the
sum (`grpo_train.plan` estimates each phase). Moves that are already done are skipped, so a
phase function is cheap to call twice.

Device-agnostic: this file issues calls (`offload`/`reload` on the policy group, `ready`/`sleep`/
`wake_up` on the generator group) and never touches CUDA; the worker moves its tensors and calls
`torch.cuda.empty_cache` (`PolicyWorker.offload`). Where nothing is colocated on a GPU (every CPU
run, separate engines, the async engine) the choreography is inactive and issues nothing, so the CPU
path is unchanged. Trace hook: every call it issues is appended to `trace` (and debug-logged) as
(event, detail) before it is made; tests compare that with what the actors received.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

# What the trainer offloads (PolicyWorker.offload's part names).
FULL_OFFLOAD = ("weights", "gradients", "optimizer", "reference")
REFIT_OFFLOAD = ("gradients", "optimizer", "reference")
PHASES = ("training", "refit", "generation")


def colocated_on_gpus(cfg) -> bool:
    """Whether the run's engines share the trainer's GPUs (the choreography is active)."""
    return cfg.policy.generation.colocated.enabled and cfg.cluster.gpus_per_node > 0 and not cfg.grpo.async_grpo.enabled


class MemoryChoreography:
    """The phases of a colocated run; inactive (no calls at all) when `active` is false.

    `policy` is the PolicyGroup (`offload(parts)`, `reload()`, `start()`); `generator` is the
    GeneratorGroup whose engines share its GPUs (`ready()`, `sleep()`, `wake_up()`; an engine
    restart replaces engines inside it). The state after `start_engines_first` is the training phase.
    """

    def __init__(self, policy, generator, active: bool) -> None:
        self.policy, self.generator, self.active = policy, generator, active
        self.phase = "training"
        self.offloaded: tuple[str, ...] = ()
        self.engines_awake = False
        self.trace: list[tuple[str, str]] = []

    @classmethod
    def for_run(cls, cfg, policy, generator) -> MemoryChoreography:
        """The run's choreography (built once in setup, kept on the components as `memory`)."""
        return cls(policy, generator, colocated_on_gpus(cfg))

    @classmethod
    def of(cls, parts) -> MemoryChoreography:
        """The components' choreography, or an inactive one (components built without it)."""
        memory = getattr(parts, "memory", None)
        return memory if memory is not None else cls(None, None, active=False)

    def engines_replaced(self, generator) -> None:
        """An engine of `generator` (the group that later phases sleep and wake) was restarted
        (engine_faults). The restart happens inside a phase that has the engines awake, and a new
        engine starts awake."""
        self.generator = generator
        if self.active:
            self.trace.append(("engines_replaced", ""))
            self.engines_awake = True

    # ------------------------------------------------------------------------------ phases
    def start_engines_first(self) -> None:
        """Start-up: the engines are ready (their memory profiled on a GPU the trainer has not
        touched), then sleep; then the trainer's ranks move to their GPUs."""
        if not self.active:
            return
        self._call("engine_ready", self.generator.ready)
        self._call("sleep", self.generator.sleep)
        self.trace.append(("trainer_start", ""))
        self.policy.start()  # the ranks join and move to their GPUs (RankGroup.start)
        self.phase, self.engines_awake, self.offloaded = "training", False, ()

    def for_training(self) -> None:
        """Before logprobs, values, optimizer steps and checkpoints: the trainer, whole, alone."""
        if not self.active:
            return
        if self.engines_awake:
            self._call("sleep", self.generator.sleep)
            self.engines_awake = False
        if self.offloaded:
            self._call("reload", self.policy.reload, ",".join(self.offloaded))
            self.offloaded = ()
        self.phase = "training"

    def for_refit(self) -> None:
        """Before a weight push and the refit check: trainer weights and awake engines."""
        if not self.active:
            return
        if self.offloaded and "weights" in self.offloaded:  # coming from generation: weights back first
            self._call("reload", self.policy.reload, ",".join(self.offloaded))
            self.offloaded = ()
        self._offload(REFIT_OFFLOAD)
        self._wake()
        self.phase = "refit"

    def for_generation(self) -> None:
        """Before rollouts and validation: the engines, alone."""
        if not self.active:
            return
        self._offload(FULL_OFFLOAD)
        self._wake()
        self.phase = "generation"

    # ------------------------------------------------------------------------------ moves
    def _offload(self, parts: tuple[str, ...]) -> None:
        todo = tuple(p for p in parts if p not in self.offloaded)
        if todo:
            self._call("offload", lambda: self.policy.offload(todo), ",".join(todo))
            self.offloaded = self.offloaded + todo

    def _wake(self) -> None:
        if not self.engines_awake:
            self._call("wake", self.generator.wake_up)
            self.engines_awake = True

    def _call(self, event: str, call: Callable[[], object], detail: str = "") -> None:
        self.trace.append((event, detail))
        log.debug("colocation: %s %s", event, detail)
        call()
