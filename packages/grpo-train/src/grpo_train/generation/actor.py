"""A generation backend inside a Ray actor.

Job: build one `Generator` ("vllm" or "hf") in its own Ray worker process and expose the
protocol's methods for `.remote()` calls, so generation scales out like every other role.
Boundary: no placement logic (the caller passes Ray options), no knowledge of what is generated.

The vLLM engine core must run inside the actor's process so that weight tensors reach the
model worker as plain objects: `VLLM_ENABLE_V1_MULTIPROCESSING=0` is set both in the actor's
runtime_env (before the worker process starts) and again in `__init__` before vLLM is imported.
"""

from __future__ import annotations

import os
from importlib import import_module
from typing import Any

from grpo_train.placement import actor_class

BACKENDS = {
    "vllm": "grpo_train.generation.vllm_backend:VllmGenerator",
    "hf": "grpo_train.generation.hf_backend:HFGenerator",
}
ACTOR_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def resolve_backend(backend: str) -> type:
    """The generator class registered under `backend`."""
    _check_backend(backend)
    module_name, class_name = BACKENDS[backend].split(":")
    return getattr(import_module(module_name), class_name)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown generation backend {backend!r}; expected one of {sorted(BACKENDS)}")


class GenerationActor:
    """Holds one generator; every method forwards to it (see `Generator`)."""

    def __init__(self, backend: str, model_path: str, **kwargs: Any) -> None:
        os.environ.update(ACTOR_ENV)
        self.generator = resolve_backend(backend)(model_path, **kwargs)

    def ready(self) -> float:
        """Seconds the generator took to start; call it to wait for the actor."""
        return float(getattr(self.generator, "start_seconds", 0.0))

    def generate(self, prompts, sampling):
        return self.generator.generate(prompts, sampling)

    def update_weights(self, named_tensors, version: int) -> float:
        return self.generator.update_weights(named_tensors, version)

    def score(self, sequences, prompt_lens):
        return self.generator.score(sequences, prompt_lens)

    def weight_version(self) -> int:
        return self.generator.weight_version()

    def reseed(self, seed: int) -> None:
        """The engine's sampling streams restart at `seed` (the loops reseed every step)."""
        self.generator.reseed(seed)

    def num_truncated_prompts(self) -> int:
        return int(getattr(self.generator, "num_truncated_prompts", 0))

    # -- weight transports and colocation (vLLM only; see grpo_train.refit) --------
    def weight_group_size(self) -> int:
        return self._backend_method("weight_group_size", "collective")()

    def open_collective(self, host, port, rank_offset, world_size, backend, metas, bucket_bytes) -> None:
        self._backend_method("open_collective", "collective")(
            host, port, rank_offset, world_size, backend, metas, bucket_bytes
        )

    def receive_collective(self, version: int) -> float:
        return self._backend_method("receive_collective", "collective")(version)

    def receive_ipc(self, handles_by_device, version: int) -> float:
        return self._backend_method("receive_ipc", "ipc")(handles_by_device, version)

    def sleep(self) -> None:
        self._backend_method("sleep", "colocated sleep")()

    def wake_up(self) -> None:
        self._backend_method("wake_up", "colocated sleep")()

    def _backend_method(self, name: str, feature: str):
        method = getattr(self.generator, name, None)
        if method is None:
            raise NotImplementedError(
                f"the {type(self.generator).__name__} generator has no {feature} support; use "
                "policy.generation.backend=vllm or policy.generation.weight_transport=object_store"
            )
        return method

    def shutdown(self) -> None:
        self.generator.shutdown()


def make_generation_actor(
    backend: str,
    model_path: str,
    num_cpus: float = 1,
    *,
    num_gpus: float = 0,
    actor_options: dict[str, Any] | None = None,
    **kwargs: Any,
):
    """Start a `GenerationActor` and return its handle; `kwargs` go to the generator's
    constructor, `actor_options` (e.g. a placement-group scheduling strategy) to Ray.
    Call `handle.ready.remote()` to wait until the engine is up."""
    _check_backend(backend)  # fail here, not inside the actor, on a bad name
    options = dict(actor_options or {})
    runtime_env = dict(options.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **ACTOR_ENV}
    remote_cls = actor_class(GenerationActor)
    return remote_cls.options(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=runtime_env, **options).remote(
        backend, model_path, **kwargs
    )


def place_generators(
    backend: str,
    model_path: str,
    *,
    gpus_per_node: int,
    colocated: bool,
    separate_gpus: int = 0,
    policy_placement_group=None,
    **kwargs: Any,
) -> list:
    """Start the generation engines and return their handles (call `ready` to wait); see
    `generator_factories` for where they go."""
    return [
        start()
        for start in generator_factories(
            backend,
            model_path,
            gpus_per_node=gpus_per_node,
            colocated=colocated,
            separate_gpus=separate_gpus,
            policy_placement_group=policy_placement_group,
            **kwargs,
        )
    ]


def generator_factories(
    backend: str,
    model_path: str,
    *,
    gpus_per_node: int,
    colocated: bool,
    separate_gpus: int = 0,
    policy_placement_group=None,
    **kwargs: Any,
) -> list:
    """One function per engine that starts it and returns its handle; calling it again starts a
    replacement with the same placement and options (grpo_train.engine_faults). The engines go:

      - CPU machines: one engine of one CPU, wherever Ray puts it;
      - GPUs, colocated: one engine per rank bundle of the policy's placement group, sharing its
        GPU (half each; the engine sleeps while the trainer runs), tensor parallel size 1;
      - GPUs, separate: `separate_gpus // tensor_parallel_size` engines of `tensor_parallel_size`
        GPUs each, on a placement group of their own (created here, once).
    """
    from functools import partial

    _check_backend(backend)
    if gpus_per_node == 0:
        return [partial(make_generation_actor, backend, model_path, num_cpus=1, **kwargs)]
    tensor_parallel_size = kwargs.get("tensor_parallel_size", 1)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if colocated:
        if tensor_parallel_size != 1:
            raise ValueError(
                "policy.generation.vllm_cfg.tensor_parallel_size: colocated engines on GPUs use 1 GPU each "
                "in this version; set policy.generation.colocated.enabled=false for tensor parallelism"
            )
        bundles = range(policy_placement_group.bundle_count)
        group = policy_placement_group
        num_gpus, kwargs = 0.5, {**kwargs, "enable_sleep_mode": True}
    else:
        engines = separate_gpus // tensor_parallel_size
        if engines < 1:
            raise ValueError(
                f"policy.generation.colocated.resources: {separate_gpus} GPUs cannot hold an engine of "
                f"tensor_parallel_size={tensor_parallel_size}"
            )
        group = placement_group([{"GPU": tensor_parallel_size, "CPU": 1}] * engines, strategy="PACK")
        bundles, num_gpus = range(engines), tensor_parallel_size
    return [
        partial(
            make_generation_actor,
            backend,
            model_path,
            num_cpus=0 if colocated else 1,
            num_gpus=num_gpus,
            actor_options={
                "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
            },
            **kwargs,
        )
        for i in bundles
    ]
