"""Where a 34M-scale training step's seconds go inside the policy worker (issue #23), in-process.

Builds the bench's ~34M Qwen2 (bench_vs_trl.write_34m_model), a `PolicyWorker` with the demo's
policy config at the bench's 34M settings (64 rows = 8 prompts x 8 samples, 16 prompt + 64
generated tokens, train micro-batches of 32, logprob batches of 32, fp32, KL 0.01), and a
synthetic batch of that shape. Times, per call (median of --repeats after one warm-up):
- the step's reference logprobs (`logprobs(batch, reference=True)`),
- `train(batch)` (prev taken from the training forward when `reuses_prev`, as in the demo),
- a bare twin of train: plain HF forward -> log_softmax gather -> the same loss op -> backward ->
  AdamW step, the same rows and micro-batches (what TRL's trainer spends per micro-batch),
with --generation instead, the rollout of 8 prompts x 8 samples x 64 tokens through grpo's
`VllmGenerator` (vLLM's CPU engine in this process, as in the generation actor) and through
transformers' `generate` (TRL's path), and, with --table, a torch-profiler table of one train call (top ops by self CPU time).
Each figure is wall seconds and this process's CPU seconds (user+sys): on a loaded shared
machine the CPU seconds are the work, the wall seconds mostly the wait for a core.

Usage: uv run --no-sync python benchmarks/e2e/profile_34m_step.py [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import write_34m_model  # noqa: E402

ROWS, PROMPT, NEW, MICRO = 64, 16, 64, 32


def make_batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    S = PROMPT + NEW
    prompt_lens = torch.randint(8, PROMPT + 1, (ROWS,), generator=g)
    lengths = prompt_lens + NEW
    input_ids = torch.randint(2, vocab, (ROWS, S), generator=g)
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    token_mask = ((torch.arange(S)[None, :] >= prompt_lens[:, None]) & attention_mask.bool()).float()
    adv = torch.randn(ROWS, generator=g)
    gen = -torch.rand(ROWS, S, generator=g) * token_mask
    return {
        "input_ids": input_ids * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": gen,
        "advantages": adv[:, None] * token_mask,
        "sample_mask": torch.ones(ROWS),
    }


def timed(fn, repeats: int, warmup: bool = True) -> tuple[float, float]:
    """Median (wall s, CPU s) of `repeats` calls, after one warm-up call."""
    if warmup:
        fn()
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def fmt(name: str, wall_cpu: tuple[float, float]) -> str:
    return f"{name}: wall {wall_cpu[0]:.2f} s, CPU {wall_cpu[1]:.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--table", action="store_true", help="also a torch-profiler table of one train call")
    parser.add_argument("--generation", action="store_true", help="time the rollout (vLLM vs HF generate) instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.generation:
        return generation(args)

    import grpo_kernels
    from grpo_train.config.schema import LossConfig, PolicyConfig
    from grpo_train.policy.worker import PolicyWorker, pg_loss_config

    model_dir = str(write_34m_model(Path(tempfile.mkdtemp(prefix="prof-34m-")) / "model"))
    policy = PolicyConfig(
        precision="float32",
        train_global_batch_size=ROWS,
        train_micro_batch_size=MICRO,
        logprob_batch_size=MICRO,
        max_grad_norm=1.0,
        use_fused_kernels=False,
        max_total_sequence_length=96,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 3e-5, "weight_decay": 0.0}},
    )
    loss = LossConfig(
        reference_policy_kl_penalty=0.01,
        reference_policy_kl_type="k3",
        token_level_loss=True,
        use_importance_sampling_correction=False,
    )
    worker = PolicyWorker(model_dir, policy, loss, seed=0, num_threads=args.threads)
    batch = make_batch(worker.model.config.vocab_size)
    batch["ref_logprobs"] = worker.logprobs(batch, reference=True)
    print(f"threads {torch.get_num_threads()}, reuses prev: {worker.reuses_prev(batch, ROWS)}", flush=True)
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)

    print(
        fmt(
            "ref logprobs (64 rows, no grad)",
            timed(lambda: worker.logprobs(batch, reference=True), args.repeats, warmup=False),
        ),
        flush=True,
    )
    print(fmt("worker.train", timed(lambda: worker.train(batch), args.repeats)), flush=True)

    # The bare twin: plain forward/backward/AdamW on a copy of the model, same micro-batches and loss op.
    import copy

    model = copy.deepcopy(worker.model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5, weight_decay=0.0)
    cfg = pg_loss_config(loss)
    tokens = float(batch["token_mask"].sum())

    def bare_step() -> None:
        opt.zero_grad(set_to_none=True)
        for start in range(0, ROWS, MICRO):
            rows = slice(start, start + MICRO)
            mb = {k: v[rows] for k, v in batch.items()}
            width = int(mb["attention_mask"].sum(1).max())
            mb = {k: (v[:, :width] if v.dim() == 2 else v) for k, v in mb.items()}
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
            curr = torch.nn.functional.pad(lp, (1, 0))
            out, _ = grpo_kernels.clipped_pg_loss(
                curr,
                curr.detach(),
                mb["gen_logprobs"],
                mb["ref_logprobs"],
                mb["advantages"],
                mb["token_mask"],
                mb["sample_mask"],
                cfg,
                tokens,
                float(ROWS),
            )
            out.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    print(fmt("bare twin (HF fwd/bwd + AdamW)", timed(bare_step, args.repeats)), flush=True)
    if not args.table:
        return 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        worker.train(batch)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


def generation(args) -> int:
    """The 34M rollout: 8 prompts x 8 samples x 64 new tokens, vLLM (grpo's generator) vs HF generate (TRL's)."""
    import os

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    model_dir = str(write_34m_model(Path(tempfile.mkdtemp(prefix="prof-34m-")) / "model"))
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(2, 32, (int(n),), generator=g).tolist() for n in torch.randint(8, PROMPT + 1, (8,), generator=g)
    ]
    print(
        f"threads {args.threads}; load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}",
        flush=True,
    )

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts]).repeat_interleave(8, 0)  # left-padded, 64 rows
    mask = (ids != 0).long()

    def hf() -> None:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                pad_token_id=0,
            )
        assert out.shape[1] == width + NEW

    print(fmt("HF generate (64 rows x 64 tokens)", timed(hf, args.repeats)), flush=True)

    from grpo_train.generation.base import SamplingSpec
    from grpo_train.generation.vllm_backend import VllmGenerator

    c0, t0 = time.process_time(), time.perf_counter()
    gen = VllmGenerator(model_dir, max_model_len=96, seed=0)
    print(
        f"vLLM import + engine: wall {time.perf_counter() - t0:.2f} s, CPU {time.process_time() - c0:.2f} s", flush=True
    )
    spec = SamplingSpec(temperature=1.0, max_new_tokens=NEW, n=8)

    def vllm() -> None:
        out = gen.generate(prompts, spec)
        assert len(out) == 64

    print(fmt("vLLM generate (8 prompts x 8 samples x 64 tokens)", timed(vllm, args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
