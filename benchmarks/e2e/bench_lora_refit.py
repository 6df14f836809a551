"""LoRA vs full fine-tuning on a ~70M-parameter Qwen2-style model (random weights, built from config):
trainable parameters, peak memory of two training steps, refit bytes and refit time.

Each variant runs in its own process (peak RSS is per process, `ru_maxrss`):
- `full`: every parameter trains; the refit pushes every weight (`state_dict_for_refit`).
- `merged`: LoRA (`apply_lora`, dim 8, alpha 32, all linear layers); the refit pushes the base-named weights
  with the adapters merged in (`state_dict_for_refit` -> `refit.tensors.merged_lora_weight`).
- `adapter`: the same LoRA model under grpo's `lora_cfg.refit: adapter`: the push is only the adapter tensors
  (`refit.tensors.iter_adapter_tensors`, what `PolicyWorker.weights` returns in that mode) into a
  `VllmGenerator(lora_adapter=...)` (LoRA-enabled engine; writes a PEFT folder, registers a new LoRA id).
Refit time = the trainer side (building the tensors) + the engine's load (`--engine`, real vLLM CPU build):
`VllmGenerator.update_weights` in every mode; the median of `--pushes`.
The engine is checked after the last push: its prompt logprobs must match the trainer's (fp32).
Usage (writes a section of benchmarks/results/lora_cpu.md):
    uv run --no-sync python benchmarks/e2e/bench_lora_refit.py [--engine] [--pushes 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_demo import ROOT, git_commit, machine  # noqa: E402

MODEL = dict(
    hidden_size=640,
    intermediate_size=1792,
    num_hidden_layers=10,
    num_attention_heads=10,
    num_key_value_heads=10,
    head_dim=64,
    vocab_size=32000,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    torch_dtype="float32",
)
BATCH, SEQ = 4, 128
MARK = "## Trainable parameters, peak memory, refit bytes and refit time (~70M-parameter model)"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(mode: str):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo_train.config.schema import LoRAConfig
    from grpo_train.policy.lora import apply_lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**MODEL), torch_dtype=torch.float32)
    peft_model = None
    if mode != "full":
        peft_model = apply_lora(model, LoRAConfig(dim=8, alpha=32), seed=0)
    return model, peft_model


def train_steps(model, steps: int = 2) -> None:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=gen)
        logits = model(input_ids=ids).logits[:, :-1].float()
        loss = -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def adapter_tensors(model) -> dict:
    from grpo_train.refit.tensors import iter_adapter_tensors

    return {k: v.to("cpu").contiguous() for k, v in iter_adapter_tensors(model)}


def save_engine_model(model, peft_model, folder: Path) -> None:
    from grpo_train.assets import builtin_model_path

    base = peft_model.get_base_model() if peft_model is not None else model
    with peft_model.disable_adapter() if peft_model is not None else _null():
        from safetensors.torch import save_file

        from grpo_train.refit.tensors import state_dict_for_refit

        save_file(state_dict_for_refit(base), str(folder / "model.safetensors"))
    base.config.save_pretrained(folder)
    tiny = builtin_model_path("arith-tiny")
    for name in TOKENIZER_FILES:
        shutil.copy(tiny / name, folder / name)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def engine_logprobs_check(llm_generate, model) -> float:
    import torch

    prompt = list(range(3, 35))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    got = torch.tensor(llm_generate(prompt))
    return float((got - ref).abs().max())


def child(mode: str, engine: bool, pushes: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from grpo_train.refit.tensors import state_dict_for_refit

    before = rss_mib()
    model, peft_model = build(mode)
    out: dict = {
        "mode": mode,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    out["rss_model_mib"] = rss_mib()
    train_steps(model)
    out["rss_peak_train_mib"] = rss_mib()
    out["rss_start_mib"] = before

    def push_tensors() -> dict:
        return adapter_tensors(model) if mode == "adapter" else state_dict_for_refit(model)

    prep = []
    for _ in range(pushes):
        t = time.perf_counter()
        tensors = push_tensors()
        prep.append(time.perf_counter() - t)
    out["refit_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    out["refit_tensors"] = len(tensors)
    out["prepare_s"] = statistics.median(prep)
    if not engine:
        return out

    folder = Path(tempfile.mkdtemp(prefix="grpo-lora-refit-"))
    save_engine_model(model, peft_model, folder)
    import vllm
    from vllm.inputs import TokensPrompt

    sp = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)

    def lp(outputs) -> list[float]:
        return [next(iter(x.values())).logprob for x in outputs[0].prompt_logprobs[1:]]

    loads = []
    if mode == "adapter":
        from grpo_train.generation.vllm_backend import VllmGenerator

        gen = VllmGenerator(str(folder), max_model_len=256, lora_adapter={"dim": 8, "alpha": 32})
        for version in range(1, pushes + 1):
            t = time.perf_counter()
            gen.update_weights(adapter_tensors(model), version)
            loads.append(time.perf_counter() - t)
        out["engine_max_abs_dlogprob"] = engine_logprobs_check(lambda p: gen.score([p], [1])[0], model)
        gen.shutdown()
    else:
        from grpo_train.generation.vllm_backend import VllmGenerator

        gen = VllmGenerator(str(folder), max_model_len=256)
        for version in range(1, pushes + 1):
            t = time.perf_counter()
            gen.update_weights(state_dict_for_refit(model), version)
            loads.append(time.perf_counter() - t)
        out["engine_max_abs_dlogprob"] = engine_logprobs_check(
            lambda p: lp(gen.llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)), model
        )
    out["refit_s"] = statistics.median(loads)
    out["rss_peak_with_engine_mib"] = rss_mib()
    shutil.rmtree(folder, ignore_errors=True)
    return out


def load() -> str:
    return "{:.1f}, {:.1f}, {:.1f}".format(*os.getloadavg())


def report(rows: list[dict], engine: bool, loads: tuple[str, str]) -> str:
    lines = [
        MARK,
        "",
        f"- machine: {machine()}; load average (1, 5, 15 min) {loads[0]} before, {loads[1]} after: "
        "times are inflated by the shared machine's load",
        f"- code: commit `{git_commit()}`; script `benchmarks/e2e/bench_lora_refit.py{' --engine' if engine else ''}`",
        f"- model: Qwen2-style from config, random weights, fp32: {rows[0]['parameters'] / 1e6:.1f} M parameters "
        f"(hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, vocab {MODEL['vocab_size']}, "
        "tied embeddings); LoRA dim 8, alpha 32, all linear layers",
        f"- peak memory: the process's peak RSS after building the model and after two AdamW steps on "
        f"{BATCH}x{SEQ} tokens (each variant in its own process)",
        "- refit: the median of the pushes; prepare = the trainer side (building the tensors), refit = prepare "
        "+ the real vLLM engine's load, then the engine's prompt logprobs are checked against the trainer's",
        "",
        "| variant | trainable parameters | peak RSS, model built | peak RSS, after 2 steps | training delta "
        "| gradients + AdamW state (4 B x 3 per trainable) | refit bytes | prepare | refit (with engine load) | engine vs trainer max abs dlogprob |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"full": "full fine-tuning", "merged": "LoRA, merged refit", "adapter": "LoRA, `refit: adapter`"}
    for r in rows:
        refit = f"{r['refit_s']:.3f} s" if "refit_s" in r else "-"
        check = f"{r['engine_max_abs_dlogprob']:.1e}" if "engine_max_abs_dlogprob" in r else "-"
        lines.append(
            f"| {names[r['mode']]} | {r['trainable']:,} | {r['rss_model_mib']:.0f} MiB | {r['rss_peak_train_mib']:.0f} MiB "
            f"| {r['rss_peak_train_mib'] - r['rss_model_mib']:.0f} MiB | {r['trainable'] * 12 / 2**20:.0f} MiB "
            f"| {r['refit_bytes'] / 2**20:.2f} MiB "
            f"({r['refit_tensors']} tensors) | {r['prepare_s']:.3f} s | {refit} | {check} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", action="store_true", help="also time the load into a real vLLM engine")
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--child", choices=["full", "merged", "adapter"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lora_cpu.md")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.engine, args.pushes)))
        return 0
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    before = load()
    rows = []
    for mode in ("full", "merged", "adapter"):
        cmd = [sys.executable, __file__, "--child", mode, "--pushes", str(args.pushes)] + (
            ["--engine"] if args.engine else []
        )
        proc = subprocess.run(cmd, capture_output=True, text=True)
        result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not result:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(result[-1][len("RESULT ") :]))
        print(rows[-1], flush=True)
    section = report(rows, args.engine, (before, load()))
    text = args.out.read_text() if args.out.exists() else ""
    text = text.split(MARK)[0].rstrip() + "\n\n" + section
    args.out.write_text(text)
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
