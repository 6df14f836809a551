"""vLLM's async engine (`AsyncLLM`) as a generation actor for async GRPO.

Job: the same protocol as `VllmGenerator` (generate, update_weights, score, reseed,
weight_version, shutdown), served by an async Ray actor so that a weight push, a pause and a
score can arrive while a batch is still decoding. Boundary: no scheduling policy (what to
generate and when is the collector's job), no training; weights are loaded by the same worker
extension as the offline engine (`vllm_worker_ext`).

`AsyncLLM` always runs its engine core in a child process, so weight tensors cannot travel as
RPC arguments: over the `object_store` transport they go as safetensors bytes
(`serialize_weights`); over `collective` the engine's worker joins the trainer's process group
and receives buckets itself (`grpo_open_collective` / `grpo_receive_collective`, the offline
engine's receivers), so only the call crosses the RPC.

Determinism. Sampling draws from the engine's random streams, so what a request samples depends
on which other requests share its batches. `generate` pauses the scheduler, adds all of a
batch's requests and only then resumes it: the first scheduled step sees the whole batch, as
`LLM.generate` does, and a reseeded engine with the same weights and prompts samples exactly
what the offline engine samples.

Weight pushes (`update_weights`, `receive_collective`): the scheduler is paused — after the
running requests finish (`in_flight=False`), or with them frozen mid-sequence (`in_flight=True`,
they then continue under the new weights) — the weights are loaded, the prefix cache is reset
(and with `reset_running_kv`, the KV of frozen requests too, so they recompute it under the new
weights), and the scheduler resumes. vLLM resets the prefix cache only when no request holds KV blocks,
so in-flight pushes that keep the running requests' KV need `prefix_caching=False` (measured:
the reset is refused otherwise); no stale prefix can then be reused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

from grpo_train.generation.base import (
    GenerationResult,
    SamplingSpec,
    check_weight_names,
    fit_prompts,
    logprob_temperature,
    validate_score_inputs,
)
from grpo_train.generation.vllm_backend import (
    GIB,
    WORKER_EXTENSION,
    _checkpoint_weight_names,
    _to_result,
    cpu_thread_binding,
)
from grpo_train.placement import actor_class

logger = logging.getLogger(__name__)


class AsyncVllmGenerator:
    """One `AsyncLLM` engine; every public method is a coroutine (run as an async Ray actor)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 256,
        seed: int = 0,
        gpu_memory_utilization: float = 0.6,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        kv_cache_space_gb: float = 1.0,
        temperature_for_logprobs: float = 1.0,
        prefix_caching: bool = True,
    ) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if temperature_for_logprobs <= 0:
            raise ValueError(f"temperature_for_logprobs must be > 0, got {temperature_for_logprobs}")
        start = time.perf_counter()
        self.max_model_len = max_model_len
        self.tensor_parallel_size = tensor_parallel_size
        self.temperature_for_logprobs = float(temperature_for_logprobs)
        self.num_truncated_prompts = 0
        self._version = 0
        self._logprob_temperature: float | None = None
        self._prefix_caching = prefix_caching
        # One pause/resume section at a time: a batch's submission must not resume a scheduler
        # that a weight push has paused, and the reverse.
        self._control = asyncio.Lock()
        engine_kwargs: dict[str, Any] = dict(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            logprobs_mode="raw_logprobs",
            generation_config="vllm",
            worker_extension_cls=WORKER_EXTENSION,
            enable_prefix_caching=prefix_caching,
        )
        saved_env = None
        if current_platform.is_cpu():
            engine_kwargs["kv_cache_memory_bytes"] = int(kv_cache_space_gb * GIB)
            saved_env = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # see VllmGenerator
            cpu_thread_binding(tensor_parallel_size)
        else:
            engine_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        try:
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs))
        finally:
            if saved_env is not None:
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved_env
        self._weight_names = _checkpoint_weight_names(model_path)
        self.model_path = model_path  # names the model type when a push is refused
        self.start_seconds = time.perf_counter() - start

    # -- protocol ----------------------------------------------------------------------------

    async def ready(self) -> float:
        await self._set_logprob_temperature(self.temperature_for_logprobs)
        return self.start_seconds

    async def generate(self, prompts: list[list[int]], sampling: SamplingSpec) -> list[GenerationResult]:
        if not prompts:
            return []
        fitted, cut = fit_prompts(prompts, self.max_model_len, sampling.max_new_tokens)
        self.num_truncated_prompts += cut
        params = _sampling_params(sampling, max_tokens=sampling.max_new_tokens)
        outputs = await self._run_batch(fitted, params, logprob_temperature(sampling, self.temperature_for_logprobs))
        results = []
        for prompt_index, (prompt, out) in enumerate(zip(fitted, outputs)):
            for completion in sorted(out.outputs, key=lambda c: c.index):
                results.append(_to_result(prompt_index, prompt, completion))
        return results

    async def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not sequences:
            return []
        validate_score_inputs(sequences, prompt_lens, self.max_model_len)
        params = SamplingParams(
            temperature=0.0, max_tokens=1, prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY
        )
        outputs = await self._run_batch([list(s) for s in sequences], params, self.temperature_for_logprobs)
        return [
            [out.prompt_logprobs[j][seq[j]].logprob for j in range(plen, len(seq))]
            for seq, plen, out in zip(sequences, prompt_lens, outputs)
        ]

    async def update_weights(
        self, named_tensors, version: int, in_flight: bool = False, reset_running_kv: bool = False
    ) -> float:
        """`object_store` transport: load HF-named tensors (sent as safetensors bytes)."""
        # the object_store transport's code, loaded when that transport pushes
        from grpo_train.refit.object_store import serialize_weights

        start = time.perf_counter()
        check_weight_names(named_tensors, self._weight_names, self.model_path)
        await self._load(
            "grpo_receive_object_store", (serialize_weights(named_tensors),), version, in_flight, reset_running_kv
        )
        return time.perf_counter() - start

    # -- the collective transport (grpo_train.refit.collective) -----------------------------

    async def weight_group_size(self) -> int:
        """Ranks this engine adds to a collective weight group: one per vLLM worker."""
        return self.tensor_parallel_size

    async def open_collective(
        self, host: str, port: int, rank_offset: int, world_size: int, backend: str, metas: list, bucket_bytes: int
    ) -> None:
        """Join the trainer's weight group (the trainer joins it at the same time). The tensor
        metadata crosses into the engine process as plain rows (vLLM's RPC is msgpack)."""
        check_weight_names([m.name for m in metas], self._weight_names, self.model_path)
        rows = [m.to_row() for m in metas]
        await self.engine.collective_rpc(
            "grpo_open_collective", args=(host, port, rank_offset, world_size, backend, rows, bucket_bytes)
        )

    async def receive_collective(self, version: int, in_flight: bool = False, reset_running_kv: bool = False) -> float:
        """The receiving half of a `collective` push: the same pause/resume as `update_weights`
        around the worker's bucket receiver, while the trainer broadcasts."""
        start = time.perf_counter()
        await self._load("grpo_receive_collective", (), version, in_flight, reset_running_kv)
        return time.perf_counter() - start

    async def _load(self, method: str, args: tuple, version: int, in_flight: bool, reset_running_kv: bool) -> None:
        """Pause the scheduler (see the module docstring), run the worker's loader `method`,
        reset the prefix cache, resume."""
        async with self._control:
            await self.engine.pause_generation(mode="keep" if in_flight else "wait", clear_cache=False)
            try:
                await self.engine.collective_rpc(method, args=args)
                # New requests must never hit prefix KV computed under the old weights. The reset
                # fails while requests hold KV blocks: in-flight pushes that keep the running KV
                # need an engine without prefix caching.
                if self._prefix_caching and not await self.engine.reset_prefix_cache(
                    reset_running_requests=reset_running_kv
                ):
                    raise RuntimeError(
                        "vLLM cannot reset its prefix cache while requests keep their KV: run in-flight "
                        "weight updates with prefix_caching=False or reset_running_kv=True"
                    )
                self._version = int(version)
            finally:
                await self.engine.resume_generation()

    async def weight_version(self) -> int:
        return self._version

    async def reseed(self, seed: int) -> None:
        """Restart the engine's sampling random streams (see `VllmGenerator.reseed`)."""
        await self.engine.collective_rpc("grpo_reseed", args=(int(seed),))

    async def num_running(self) -> int:
        return int(self.engine.get_num_unfinished_requests())

    async def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None

    # -- helpers -----------------------------------------------------------------------------

    async def _run_batch(self, prompts: list[list[int]], params, temperature: float) -> list:
        """Submit every prompt while the scheduler is paused, then resume and collect the final
        outputs in prompt order (see the module docstring for why)."""
        from vllm.inputs import TokensPrompt

        batch_id = uuid.uuid4().hex[:8]
        async with self._control:
            await self._set_logprob_temperature(temperature)
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            try:
                queues = [
                    await self.engine.add_request(f"{batch_id}-{i}", TokensPrompt(prompt_token_ids=p), params)
                    for i, p in enumerate(prompts)
                ]
            finally:
                await self.engine.resume_generation()
        return list(await asyncio.gather(*(_final_output(q) for q in queues)))

    async def _set_logprob_temperature(self, temperature: float) -> None:
        if temperature != self._logprob_temperature:
            await self.engine.collective_rpc("grpo_set_logprob_temperature", args=(float(temperature),))
            self._logprob_temperature = temperature


def _sampling_params(sampling: SamplingSpec, max_tokens: int):
    """The offline engine's parameters (logits are divided by T in the engine: sample at 1)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=sampling.n,
        temperature=0.0 if sampling.is_greedy else 1.0,
        top_p=1.0 if sampling.is_greedy else sampling.top_p,
        top_k=0 if sampling.is_greedy else (sampling.top_k_or_none or 0),
        max_tokens=max_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        stop=list(sampling.stop_strings),
        logprobs=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


async def _final_output(queue):
    """The finished `RequestOutput` of one request's output queue."""
    while True:
        out = queue.get_nowait() or await queue.get()
        if out.finished:
            return out


def make_async_generation_actor(model_path: str, num_cpus: float = 1, *, num_gpus: float = 0, **kwargs: Any):
    """Start an `AsyncVllmGenerator` as an async Ray actor; `kwargs` go to its constructor.
    Call `handle.ready.remote()` to wait until the engine is up."""
    # The temperature change and a weight push may run while a batch decodes.
    remote_cls = actor_class(AsyncVllmGenerator, max_concurrency=16)
    return remote_cls.options(num_cpus=num_cpus, num_gpus=num_gpus).remote(model_path, **kwargs)
