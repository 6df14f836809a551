"""A tiny Qwen3-MoE-style model for the bundled arithmetic task (benchmarks/results/moe_arith_cpu.md).

Job: the bundled arith-tiny tokenizer, a random Qwen3-MoE (2 layers, hidden 128, 4 experts of
64, top-2, heads of 64) briefly SFT-warmed on "a+b=" -> "sum<eos>" so that GRPO sees reward
signal, saved with save_pretrained. Not a test fixture: the input of a documented `grpo train` run.

    uv run --no-sync python benchmarks/build_moe_arith.py --out /tmp/moe-arith --steps 300
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

from grpo_train.assets import builtin_model_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    src, out = builtin_model_path("arith-tiny"), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out)
    tok = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen3MoeForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = random.Random(0)
    for step in range(args.steps):
        rows, prompt_lens = [], []
        for _ in range(64):
            a, b = rng.randrange(100), rng.randrange(100)
            prompt = tok.encode(f"{a}+{b}=", add_special_tokens=False)
            rows.append(prompt + tok.encode(str(a + b), add_special_tokens=False) + [tok.eos_token_id])
            prompt_lens.append(len(prompt))
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tok.pad_token_id)
        labels = torch.full_like(ids, -100)
        for i, (r, p) in enumerate(zip(rows, prompt_lens)):
            ids[i, : len(r)] = torch.tensor(r)
            labels[i, p : len(r)] = torch.tensor(r[p:])
        loss = model(
            input_ids=ids,
            attention_mask=(labels != -100) | (torch.arange(width) < torch.tensor([len(r) for r in rows])[:, None]),
            labels=labels,
        ).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
