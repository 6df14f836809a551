"""Does the locked vLLM CPU build run LoRA? A probe on the bundled tiny model (arith-tiny, fp32).

peft puts rank-8 adapters (alpha 32) on every linear layer of the tiny Qwen2, gives lora_B random
values (so the adapter changes the logits) and saves them in PEFT format. A vLLM engine built with
`enable_lora=True` scores one prompt without and with a `LoRARequest` for that folder; the prompt
logprobs are compared with HF's for the base model (adapters disabled) and for the adapted model.
Prints the max |dlogprob| of each; exits 1 if either is above 1e-4. Usage:
    uv run --no-sync python benchmarks/e2e/probe_vllm_lora.py
"""

from __future__ import annotations

import os
import tempfile


def main() -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    import vllm
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from grpo_train.assets import builtin_model_path

    model_dir = str(builtin_model_path("arith-tiny"))
    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"),
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    adapter_dir = tempfile.mkdtemp(prefix="grpo-vllm-lora-")
    peft_model.save_pretrained(adapter_dir)

    llm = vllm.LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=64,
        enforce_eager=True,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=1,
        kv_cache_memory_bytes=1 << 30,
        logprobs_mode="raw_logprobs",
    )
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    params = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)

    def engine(lora_request=None) -> torch.Tensor:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, lora_request=lora_request, use_tqdm=False)
        return torch.tensor([next(iter(x.values())).logprob for x in out[0].prompt_logprobs[1:]])

    ids = torch.tensor([prompt])

    def hf() -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(peft_model(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]

    adapted = hf()
    with peft_model.disable_adapter():
        base = hf()
    base_diff = float((engine() - base).abs().max())
    lora_diff = float((engine(LoRARequest("probe", 1, adapter_dir)) - adapted).abs().max())
    print(f"adapter effect (HF, max |dlogprob| adapted vs base): {float((adapted - base).abs().max()):.3f}")
    print(f"vLLM without adapter vs HF base:  max |dlogprob| {base_diff:.2e}")
    print(f"vLLM with LoRARequest vs HF LoRA: max |dlogprob| {lora_diff:.2e}")
    return 0 if max(base_diff, lora_diff) < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
