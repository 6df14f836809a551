"""Plain HF transformers generation backend: the fallback when vLLM is not installed or wanted.

Job: the `Generator` protocol on top of `model.generate` and a plain forward pass, reporting the
same logprob as the vLLM backend: log_softmax(logits / T)[sampled token] over the full
vocabulary (no top-p/top-k renormalisation), computed from the raw logits `generate` returns
(`output_logits=True`). Sampling itself uses HF's temperature/top-p/top-k warpers.
Boundary: no Ray, no vLLM; weights arrive as HF-named tensors (`state_dict_for_refit`).
"""

from __future__ import annotations

import logging
import time

import torch

from grpo_train.generation.base import (
    GenerationResult,
    SamplingSpec,
    check_weight_names,
    fit_prompts,
    logprob_temperature,
    validate_score_inputs,
)

logger = logging.getLogger(__name__)


class HFGenerator:
    """A transformers causal LM used for sampling and scoring (fp32 by default)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 256,
        seed: int = 0,
        temperature_for_logprobs: float = 1.0,
        device: str = "cpu",
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if temperature_for_logprobs <= 0:
            raise ValueError(f"temperature_for_logprobs must be > 0, got {temperature_for_logprobs}")
        start = time.perf_counter()
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.temperature_for_logprobs = float(temperature_for_logprobs)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        # refit.tensors: loaded with the model, in the generator's process
        from grpo_train.refit.tensors import iter_refit_tensors

        # Checkpoint-format views of this model's own parameters: a push is copied into them
        # (a fused expert tensor receives its per-expert parts, a tied head its embedding).
        self._weight_views = dict(iter_refit_tensors(self.model))
        self._weight_names = set(self._weight_views)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError(f"tokenizer of {model_path} has neither a pad nor an eos token")
        self.num_truncated_prompts = 0
        self._version = 0
        self._rng = torch.Generator(device="cpu").manual_seed(seed)
        self.start_seconds = time.perf_counter() - start

    # -- protocol ----------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingSpec) -> list[GenerationResult]:
        from transformers import GenerationConfig

        if not prompts:
            return []
        fitted, cut = fit_prompts(prompts, self.max_model_len, sampling.max_new_tokens)
        self.num_truncated_prompts += cut
        stop_ids = set(sampling.stop_token_ids)
        if self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not sampling.is_greedy,
            temperature=None if sampling.is_greedy else sampling.temperature,
            top_p=None if sampling.is_greedy else sampling.top_p,
            top_k=None if sampling.is_greedy else (sampling.top_k_or_none or 0),
            # Neutral values for the processors a checkpoint's generation_config could switch on
            # (HF fills unset fields from it); vLLM runs with generation_config="vllm" likewise.
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            min_new_tokens=0,
            num_return_sequences=sampling.n,
            eos_token_id=sorted(stop_ids) or None,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        input_ids, attention_mask = self._left_pad(fitted)
        # HF samples from torch's global RNG: run it from our own seeded stream.
        with torch.random.fork_rng(devices=[]):
            torch.random.set_rng_state(self._rng.get_state())
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                stopping_criteria=self._stop_string_criteria(sampling, input_ids.shape[1]),
            )
            self._rng.set_state(torch.random.get_rng_state())
        new_tokens = out.sequences[:, input_ids.shape[1] :].cpu()  # [B*n, L]
        temperature = logprob_temperature(sampling, self.temperature_for_logprobs)
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B*n, L, V]
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        logprobs = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # [B*n, L]

        results = []
        for row in range(new_tokens.shape[0]):
            prompt_index = row // sampling.n
            tokens, lps = new_tokens[row].tolist(), logprobs[row].tolist()
            length, reason = self._response_length(tokens, stop_ids, sampling)
            text = self.tokenizer.decode(tokens[:length], skip_special_tokens=True)
            text = _cut_at_stop_string(text, sampling.stop_strings)
            results.append(
                GenerationResult(
                    prompt_index=prompt_index,
                    prompt_ids=list(fitted[prompt_index]),
                    response_ids=tokens[:length],
                    response_logprobs=lps[:length],
                    text=text,
                    finish_reason=reason,
                )
            )
        return results

    @torch.no_grad()
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> float:
        start = time.perf_counter()
        check_weight_names(named_tensors, self._weight_names, self.model.config)
        for name, tensor in named_tensors.items():
            self._weight_views[name].copy_(tensor)
        self._version = int(version)
        return time.perf_counter() - start

    @torch.no_grad()
    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        if not sequences:
            return []
        validate_score_inputs(sequences, prompt_lens, self.max_model_len)
        width = max(len(s) for s in sequences)
        # Right padding: causal attention keeps real positions independent of the pad tail.
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, seq in enumerate(sequences):
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
        logits = (
            self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits.float().cpu()
        )  # [N, S, V]
        logprobs = torch.log_softmax(logits / self.temperature_for_logprobs, dim=-1)
        scores = []
        for i, (seq, plen) in enumerate(zip(sequences, prompt_lens)):
            targets = torch.tensor(seq[plen:])
            scores.append(logprobs[i, plen - 1 : len(seq) - 1].gather(-1, targets[:, None])[:, 0].tolist())
        return scores

    def weight_version(self) -> int:
        return self._version

    def reseed(self, seed: int) -> None:
        """Restart the sampling random stream (see `VllmGenerator.reseed`)."""
        self._rng.manual_seed(int(seed))

    def shutdown(self) -> None:
        self.model = None

    # -- helpers -----------------------------------------------------------------------------

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _stop_string_criteria(self, sampling: SamplingSpec, prompt_width: int):
        """Stop a row once its RESPONSE text contains a stop string. HF's own `stop_strings`
        also match across the prompt/response boundary, which vLLM never does."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        if not sampling.stop_strings:
            return None
        tokenizer, stops = self.tokenizer, sampling.stop_strings

        class _ResponseStopStrings(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                texts = tokenizer.batch_decode(input_ids[:, prompt_width:], skip_special_tokens=True)
                done = [any(stop in text for stop in stops) for text in texts]
                return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

        return StoppingCriteriaList([_ResponseStopStrings()])

    def _response_length(self, tokens: list[int], stop_ids: set[int], sampling: SamplingSpec) -> tuple[int, str]:
        """Where a sample ended: after its first stop token or the token completing a stop
        string ("stop"), else after max_new_tokens ("length"). Tokens past that are padding."""
        for k, tok in enumerate(tokens, start=1):
            if tok in stop_ids:
                return k, "stop"
            if sampling.stop_strings:
                text = self.tokenizer.decode(tokens[:k], skip_special_tokens=True)
                if any(s in text for s in sampling.stop_strings):
                    return k, "stop"
        return min(len(tokens), sampling.max_new_tokens), "length"


def _cut_at_stop_string(text: str, stop_strings: tuple[str, ...]) -> str:
    cuts = [text.find(s) for s in stop_strings if s in text]
    return text[: min(cuts)] if cuts else text
