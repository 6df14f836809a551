"""EnvPool: one environment replicated over Ray actors, behind the plain ``step`` interface.

The pool splits a batch into contiguous chunks, one per worker, scores them in parallel and
merges the outputs back in the original order. It is the last line of defence between model
output and the training run:

- an exception raised by the environment for a batch is retried sample by sample inside the
  worker; samples that still raise get reward 0 and an ``error`` in their metadata, and are
  counted in ``env/sample_errors`` (with the traceback in the log);
- a worker that dies (``RayActorError``: a segfault, ``os._exit``, the OOM killer, ``ray.kill``)
  or overruns ``step_timeout_s`` is replaced by a fresh actor and its chunk retried once; if
  the chunk kills the new actor too, its samples are scored one at a time so that only the
  sample that kills a worker gets reward 0 (``env/crashed_samples``). Every replacement is
  counted in ``env/actor_restarts``; past ``max_restarts_per_step`` the pool gives up with an
  error, because a worker that cannot survive at all is a broken setup, not a bad sample.

An environment outside grpo is given by import path (``env_class="my_pkg.envs:MyEnv"``): each
actor imports it itself, after putting ``import_paths`` first on its ``sys.path``, so the class is
never pickled by reference into a process that cannot import it.

Every overrun of ``step_timeout_s`` is also counted in ``env/step_timeouts``.

``in_process=True`` runs the same interface on one environment in the calling process, without
Ray (tests and simple users); exceptions are isolated the same way there.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from grpo_envs import registry
from grpo_envs.base import Environment, EnvOutput

log = logging.getLogger(__name__)

RESTARTS = "env/actor_restarts"
CRASHED_SAMPLES = "env/crashed_samples"
SAMPLE_ERRORS = "env/sample_errors"
STEP_TIMEOUTS = "env/step_timeouts"
_ERROR_PREVIEW_CHARS = 2000


def failed_output(n: int, error: str) -> EnvOutput:
    """Reward 0, done, for ``n`` samples that could not be scored."""
    return EnvOutput(
        rewards=[0.0] * n,
        observations=[None] * n,
        terminateds=[True] * n,
        metadata=[{"error": error} for _ in range(n)],
        metrics={},
    )


def step_guarded(env: Environment, message_logs: list[list[dict]], env_infos: list[dict]) -> tuple[EnvOutput, int]:
    """``env.step`` with exceptions isolated per sample; returns the output and the error count."""
    try:
        return _checked(env.step(message_logs, env_infos), len(message_logs)), 0
    except Exception:
        if len(message_logs) == 1:
            text = traceback.format_exc()
            log.warning("environment %s failed on a sample:\n%s", type(env).__name__, text)
            return failed_output(1, text[-_ERROR_PREVIEW_CHARS:]), 1
        log.warning(
            "environment %s raised on a batch of %d; retrying sample by sample:\n%s",
            type(env).__name__,
            len(message_logs),
            traceback.format_exc(),
        )
    parts, errors = [], 0
    for log_, info in zip(message_logs, env_infos, strict=True):
        out, err = step_guarded(env, [log_], [info])
        parts.append(out)
        errors += err
    # Failed samples carry no metrics, so per-sample means cover the samples that were scored.
    return EnvOutput.concat(parts, type(env).merge_metrics([(p.metrics, len(p)) for p in parts])), errors


def _checked(out: Any, n: int) -> EnvOutput:
    if not isinstance(out, EnvOutput) or len(out) != n:
        raise TypeError(f"step must return an EnvOutput with {n} samples, got {out!r:.200}")
    return out


class _EnvActor:
    """Ray actor body: one environment instance."""

    def __init__(self, env_cls: type[Environment] | str, config: dict, import_paths: list[str]) -> None:
        sys.path[:0] = [p for p in import_paths if p not in sys.path]
        cls = registry.load_env_class(env_cls) if isinstance(env_cls, str) else env_cls
        self.env = cls(**config)

    def ready(self) -> bool:
        return True

    def step(self, message_logs: list[list[dict]], env_infos: list[dict]) -> tuple[EnvOutput, int]:
        return step_guarded(self.env, message_logs, env_infos)

    def global_post_process_and_metrics(self, batch_metadata: list[dict]) -> dict[str, float]:
        return self.env.global_post_process_and_metrics(batch_metadata)

    def tools(self) -> list[dict]:
        return self.env.tools()

    def close(self) -> None:
        self.env.close()


@dataclass
class _Chunk:
    """A contiguous slice of the batch and how it is being scored."""

    start: int
    stop: int
    attempts: int = 0
    singles: list[int] = field(default_factory=list)
    """Sample indices still to score one at a time (after the chunk killed two workers)."""
    outputs: dict[int, EnvOutput] = field(default_factory=dict)
    """Results by first sample index: one entry for the whole chunk, or one per sample."""


class EnvPool:
    """Runs environment ``name`` (built with ``config``) on ``num_workers`` Ray actors.

    The caller has already called ``ray.init``. ``actor_options`` go to ``.options()`` of every
    actor (e.g. ``{"num_cpus": 1}``; by default actors hold no CPU while running, Ray's default).
    ``env_class`` (an import path ``"module:Class"``) replaces the registry lookup of ``name``;
    ``import_paths`` are searched first when it (and what it imports) is imported.
    """

    def __init__(
        self,
        name: str,
        config: dict | None = None,
        num_workers: int = 1,
        in_process: bool = False,
        *,
        actor_options: dict | None = None,
        step_timeout_s: float | None = None,
        max_restarts_per_step: int = 32,
        ready_timeout_s: float = 300.0,
        env_class: str | None = None,
        import_paths: list[str] | tuple[str, ...] = (),
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"EnvPool({name!r}): num_workers must be >= 1, got {num_workers}")
        self.name = name
        self.import_paths = [str(p) for p in import_paths]
        self._env_spec: type[Environment] | str
        if env_class is None:
            self.env_cls = self._env_spec = registry.get(name)
        else:
            with registry.import_paths(self.import_paths):
                self.env_cls = registry.load_env_class(env_class)
            self._env_spec = env_class
        self.config = dict(config or {})
        self.num_workers = 1 if in_process else num_workers
        self.in_process = in_process
        self.step_timeout_s = step_timeout_s
        self.max_restarts_per_step = max_restarts_per_step
        self.ready_timeout_s = ready_timeout_s
        self.total_restarts = 0
        self._tools: list[dict] | None = None
        self._next_worker = 0
        self._env: Environment | None = None
        self._actors: list[Any] = []
        if in_process:
            with registry.import_paths(self.import_paths):
                self._env = self.env_cls(**self.config)
            return
        import ray

        if not ray.is_initialized():
            raise RuntimeError(f"EnvPool({name!r}): call ray.init() before creating the pool")
        self._ray = ray
        self._actor_cls = ray.remote(_EnvActor).options(max_restarts=0, **(actor_options or {}))
        self._actors = [self._new_actor() for _ in range(num_workers)]
        self._wait_ready()

    # ------------------------------------------------------------------ public interface
    def step(self, message_logs: list[list[dict]], env_infos: list[dict]) -> EnvOutput:
        """Score a batch; the output is in the order of the input."""
        if len(message_logs) != len(env_infos):
            raise ValueError(f"EnvPool.step: {len(message_logs)} message logs but {len(env_infos)} env_infos")
        if self.in_process:
            out, errors = step_guarded(self._env, message_logs, env_infos)
            out.metrics.update({RESTARTS: 0.0, CRASHED_SAMPLES: 0.0, SAMPLE_ERRORS: float(errors), STEP_TIMEOUTS: 0.0})
            return out
        return self._step_on_actors(message_logs, env_infos)

    def tools(self) -> list[dict]:
        """The environment's tool schemas (:meth:`Environment.tools`), asked once and kept."""
        tools = self._tools
        if tools is None:
            tools = self._env.tools() if self._env is not None else self._ray.get(self._actors[0].tools.remote())
            self._tools = tools
        return list(tools)

    @property
    def count_metrics(self) -> frozenset[str]:
        """Names of this pool's step metrics that count events (summed, not averaged, over steps)."""
        return self.env_cls.COUNT_METRICS | {RESTARTS, CRASHED_SAMPLES, SAMPLE_ERRORS, STEP_TIMEOUTS}

    def global_post_process_and_metrics(self, batch_metadata: list[dict]) -> dict[str, float]:
        if self.in_process:
            return self._env.global_post_process_and_metrics(batch_metadata)
        for _attempt in range(2):
            try:
                return self._ray.get(self._actors[0].global_post_process_and_metrics.remote(batch_metadata))
            except self._ray.exceptions.RayActorError:
                self._restart(0)
        raise RuntimeError(f"EnvPool({self.name!r}): global_post_process_and_metrics killed two workers")

    def shutdown(self) -> None:
        """Close the environments and end the actors."""
        if self.in_process:
            if self._env is not None:
                self._env.close()
                self._env = None
            return
        try:
            self._ray.get([a.close.remote() for a in self._actors], timeout=30)
        except Exception as exc:  # closing is best effort; the actors are killed next anyway
            log.warning("EnvPool(%r): close failed: %s", self.name, exc)
        for actor in self._actors:
            self._ray.kill(actor, no_restart=True)
        self._actors = []

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ Ray workers
    def _new_actor(self):
        return self._actor_cls.remote(self._env_spec, self.config, self.import_paths)

    def _wait_ready(self) -> None:
        timeout_s = self.ready_timeout_s
        try:
            self._ray.get([a.ready.remote() for a in self._actors], timeout=timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise RuntimeError(
                f"EnvPool({self.name!r}): {self.num_workers} workers not ready after {timeout_s:.0f} s; "
                f"the Ray cluster may lack the resources they ask for ({self._ray.available_resources()} free)"
            ) from None
        except self._ray.exceptions.RayActorError as exc:
            self.shutdown()
            raise RuntimeError(
                f"EnvPool({self.name!r}): the environment failed to start with config {self.config!r}: {exc}"
            ) from exc

    def _restart(self, worker: int) -> None:
        """Replace a dead or hung worker and wait until the new one is up (so that its start-up
        time does not count against ``step_timeout_s``)."""
        self._ray.kill(self._actors[worker], no_restart=True)
        self._actors[worker] = self._new_actor()
        self.total_restarts += 1
        try:
            self._ray.get(self._actors[worker].ready.remote(), timeout=self.ready_timeout_s)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError) as exc:
            raise RuntimeError(f"EnvPool({self.name!r}): a replacement worker failed to start: {exc}") from exc

    def _step_on_actors(self, message_logs: list[list[dict]], env_infos: list[dict]) -> EnvOutput:
        bounds = _split(len(message_logs), self.num_workers)
        chunks = [_Chunk(start, stop) for start, stop in bounds]
        counts = {RESTARTS: 0, CRASHED_SAMPLES: 0, SAMPLE_ERRORS: 0, STEP_TIMEOUTS: 0}
        in_flight: dict[Any, tuple[int, int, int, float]] = {}  # ref -> (chunk, start, stop, t0)
        # Chunk k runs on actor (offset + k): batches smaller than the pool (one conversation's turn,
        # stepped on its own by the per-sample multi-turn rollout) take turns over the actors.
        offset = self._next_worker
        self._next_worker = (offset + len(chunks)) % self.num_workers

        def actor_of(worker: int) -> int:
            return (offset + worker) % self.num_workers

        def submit(worker: int) -> None:
            chunk = chunks[worker]
            start, stop = (chunk.singles[0], chunk.singles[0] + 1) if chunk.singles else (chunk.start, chunk.stop)
            ref = self._actors[actor_of(worker)].step.remote(message_logs[start:stop], env_infos[start:stop])
            in_flight[ref] = (worker, start, stop, time.monotonic())

        for worker in range(len(chunks)):
            submit(worker)
        while in_flight:
            ready, _ = self._ray.wait(list(in_flight), num_returns=1, timeout=self._wait_timeout(in_flight))
            if not ready:
                ref = self._overdue(in_flight)
                if ref is None:
                    continue
                worker, start, stop, _ = in_flight.pop(ref)
                log.warning("EnvPool(%r): worker %d overran step_timeout_s=%s", self.name, worker, self.step_timeout_s)
                counts[STEP_TIMEOUTS] += 1
                self._on_crash(chunks[worker], actor_of(worker), start, stop, "timeout", counts)
            else:
                ref = ready[0]
                worker, start, stop, _ = in_flight.pop(ref)
                chunk = chunks[worker]
                try:
                    out, errors = self._ray.get(ref)
                    chunk.outputs[start] = out
                    counts[SAMPLE_ERRORS] += errors
                    if chunk.singles:
                        chunk.singles.pop(0)
                except self._ray.exceptions.RayActorError as exc:
                    log.warning("EnvPool(%r): worker %d died: %s", self.name, worker, exc)
                    self._on_crash(chunk, actor_of(worker), start, stop, str(exc), counts)
            if not any(w == worker for w, *_ in in_flight.values()) and self._unfinished(chunks[worker]):
                submit(worker)
        parts = [chunk.outputs[k] for chunk in chunks for k in sorted(chunk.outputs)]
        metrics = self.env_cls.merge_metrics([(p.metrics, len(p)) for p in parts])
        metrics.update({k: float(v) for k, v in counts.items()})
        return EnvOutput.concat(parts, metrics)

    def _on_crash(self, chunk: _Chunk, worker: int, start: int, stop: int, reason: str, counts: dict) -> None:
        counts[RESTARTS] += 1
        if counts[RESTARTS] > self.max_restarts_per_step:
            raise RuntimeError(
                f"EnvPool({self.name!r}): workers died {counts[RESTARTS]} times in one step "
                f"(max_restarts_per_step={self.max_restarts_per_step}); last cause: {reason}"
            )
        self._restart(worker)
        if chunk.singles:  # a single sample killed a fresh worker: it is the culprit
            chunk.singles.pop(0)
            chunk.outputs[start] = failed_output(
                1, f"environment worker crashed on this sample: {reason}"[:_ERROR_PREVIEW_CHARS]
            )
            counts[CRASHED_SAMPLES] += 1
            return
        chunk.attempts += 1
        if chunk.attempts >= 2:  # twice: find the culprit by scoring one sample at a time
            chunk.singles = list(range(start, stop))

    @staticmethod
    def _unfinished(chunk: _Chunk) -> bool:
        return bool(chunk.singles) or not chunk.outputs

    def _wait_timeout(self, in_flight: dict) -> float | None:
        if self.step_timeout_s is None:
            return None
        oldest = min(t0 for *_, t0 in in_flight.values())
        return max(0.0, oldest + self.step_timeout_s - time.monotonic())

    def _overdue(self, in_flight: dict) -> Any:
        now = time.monotonic()
        for ref, (*_, t0) in in_flight.items():
            if now - t0 >= self.step_timeout_s:
                return ref
        return None


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, balanced (start, stop) bounds of ``n`` items over at most ``parts`` chunks."""
    parts = max(1, min(parts, n))
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for k in range(parts):
        stop = start + base + (k < extra)
        bounds.append((start, stop))
        start = stop
    return [b for b in bounds if b[1] > b[0]]
