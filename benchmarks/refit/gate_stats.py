"""Refit-gate statistics on the bundled demo model: a healthy push and three broken ones.

For each trainer precision (policy.precision) and engine precision (vllm_cfg.precision) pair,
a PolicyWorker (fp32 masters, compute in its precision) takes GRPO-shaped optimizer steps at
the demo's lr (measured after 1 and after 10), the real vLLM CPU engine samples the probe (demo prompts, temperature 1), and
trainer and engine score it after:
  healthy   every tensor pushed (the compute-dtype weights)
  stale     nothing pushed: the engine keeps the weights before the step
  skipped   every tensor but one (a down_proj, or the tied embedding, keeps its old value)
  bad_cast  every tensor pushed through a wrong dtype (fp32 run: bf16; bf16 run: its bytes read
            as fp16, or an fp8 e4m3 round trip)
Prints one JSON line per case. Usage:
  uv run --no-sync python benchmarks/refit/gate_stats.py --pairs float32:float32 bfloat16:bfloat16
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from grpo_train.assets import builtin_model_path
from grpo_train.config.schema import LossConfig, PolicyConfig
from grpo_train.generation import SamplingSpec, VllmGenerator
from grpo_train.policy.worker import PolicyWorker
from grpo_train.refit.check import refit_stats

SKIPPED = ("model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight")


def bad_casts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32: rounded to bf16. bf16: bytes read as fp16 (a mislabelled bucket), and fp8 e4m3 round trip."""
    if t.dtype == torch.float32:
        return {"bad_cast_bf16": t.to(torch.bfloat16).float()}
    return {
        "bad_cast_view_fp16": t.view(torch.float16).to(t.dtype),
        "bad_cast_fp8": t.to(torch.float8_e4m3fn).to(t.dtype),
    }


def prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tokenizer.encode(f"{rng.randrange(100)}+{rng.randrange(100)}=", add_special_tokens=False) for _ in range(n)]


def train_batch(rollouts, pad: int = 0) -> dict[str, torch.Tensor]:
    seqs = [r.prompt_ids + r.response_ids for r in rollouts]
    S = max(len(s) for s in seqs)
    B = len(seqs)
    ids = torch.full((B, S), pad)
    mask = torch.zeros(B, S, dtype=torch.long)
    token_mask = torch.zeros(B, S)
    gen = torch.zeros(B, S)
    for i, (r, s) in enumerate(zip(rollouts, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        p = len(r.prompt_ids)
        token_mask[i, p : len(s)] = 1
        gen[i, p : len(s)] = torch.tensor(r.response_logprobs)
    adv = torch.randn(B, generator=torch.Generator().manual_seed(0))
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "token_mask": token_mask,
        "gen_logprobs": gen,
        "advantages": adv[:, None] * token_mask,
        "sample_mask": torch.ones(B),
    }


def measure(
    trainer_precision: str,
    engine_precision: str,
    lr: float,
    n_prompts: int,
    seed: int,
    steps: tuple[int, ...],
    dump=None,
) -> list[dict]:
    from transformers import AutoTokenizer

    path = str(builtin_model_path("arith-tiny"))
    tok = AutoTokenizer.from_pretrained(path)
    cfg = PolicyConfig(
        precision=trainer_precision,
        train_global_batch_size=64,
        train_micro_batch_size=64,
        logprob_batch_size=64,
        use_fused_kernels=False,
        max_grad_norm=1.0,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": lr, "weight_decay": 0.0}},
        generation={"temperature": 1.0},
    )
    worker = PolicyWorker(path, cfg, LossConfig(reference_policy_kl_penalty=0.0), seed=seed)
    engine = VllmGenerator(path, dtype=engine_precision, max_model_len=32, seed=seed, kv_cache_space_gb=0.25)
    before = {k: v.clone() for k, v in worker.weights().items()}  # in-process weights() are the live tensors
    engine.update_weights(before, 1)
    rollouts = engine.generate(prompts(tok, n_prompts, seed), SamplingSpec(temperature=1.0, max_new_tokens=8, n=8))
    rollouts = [r for r in rollouts if r.response_ids][:64]
    batch = train_batch(rollouts)
    probe = engine.generate(prompts(tok, n_prompts, seed + 1), SamplingSpec(temperature=1.0, max_new_tokens=8, n=4))
    seqs = [r.prompt_ids + r.response_ids for r in probe if r.response_ids]
    plens = [len(r.prompt_ids) for r in probe if r.response_ids]
    out, version = [], 1
    for step in range(1, max(steps) + 1):
        batch["prev_logprobs"] = worker.logprobs(batch)
        worker.train(batch)
        if step not in steps:
            continue
        after = {k: v.clone() for k, v in worker.weights().items()}
        trainer = worker.score(seqs, plens)
        cases = {"healthy": after, "stale": before}  # stale / skipped: the engine kept the weights of before step 1
        cases |= {f"skipped:{name}": {**after, name: before[name]} for name in SKIPPED}
        casts = {k: bad_casts(v) for k, v in after.items()}
        cases |= {case: {k: casts[k][case] for k in after} for case in next(iter(casts.values()))}
        for case, weights in cases.items():
            version += 1
            engine.update_weights(weights, version)
            generated = engine.score(seqs, plens)
            stats = refit_stats(trainer, generated)
            out.append(
                {
                    "seed": seed,
                    "diffs": [[a - b for a, b in zip(x, y)] for x, y in zip(trainer, generated)],
                    "trainer": trainer_precision,
                    "engine": engine_precision,
                    "steps": step,
                    "case": case,
                    "lr": lr,
                    "tokens": stats.tokens,
                    "max_abs_diff": stats.max_abs_diff,
                    "mean_abs_diff": stats.mean_abs_diff,
                    "token_mult_prob_error": stats.token_mult_prob_error,
                    "gen_kl_error": stats.gen_kl_error,
                    "seq_logratio_rms": stats.seq_logratio_rms,
                }
            )
            print(json.dumps({k: v for k, v in out[-1].items() if k != "diffs"}), flush=True)
            if dump is not None:
                dump.write(json.dumps(out[-1]) + "\n")
                dump.flush()
    engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", nargs="+", default=["float32:float32", "bfloat16:bfloat16", "bfloat16:float32"])
    parser.add_argument("--lr", type=float, default=3e-5)  # the demo's
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="several seeds (overrides --seed)")
    parser.add_argument("--dump", default=None, help="also write every case's per-token differences (JSON lines)")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 10], help="optimizer steps before measuring")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dump = open(args.dump, "a") if args.dump else None
    for seed in args.seeds or [args.seed]:
        for pair in args.pairs:
            trainer, engine = pair.split(":")
            measure(trainer, engine, args.lr, args.prompts, seed, tuple(args.steps), dump)


if __name__ == "__main__":
    main()
