"""Step time of sequence packing and dynamic batching against padded micro-batches.

Two measurements, written to one markdown report with the machine they ran on:

1. worker: one GRPO step's policy work in-process (prev + ref logprobs, then one optimizer step
   of `PolicyWorker.train`) on a fixed batch, for each layout, repeated; median and best.
   - `demo`: the bundled arith-tiny model on a batch shaped like the offline demo's
     (128 rows of 4-6 prompt + 3-8 response tokens, micro-batches as in grpo_arith_tiny.yaml);
   - `mixed`: a tiny_qwen2-like model (hidden 128, 2 layers, 2 heads of 64) on 64 rows with
     GSM-like lengths (prompt 60-220 + lognormal response around 180, up to 1024 tokens), with
     grpo_math_1B.yaml's micro-batching (4 rows; token budgets 4 x 1024), where padding matters.
2. e2e: the real offline demo (`grpo train`, Ray + vLLM) for a few steps per layout, runs taken
   in turns, median of the per-phase timings in metrics.jsonl (steps 2..N). Skipped with
   --skip-e2e.

    uv run --no-sync python benchmarks/e2e/bench_packing_step.py [--out PATH] [--repeats 5] [--e2e-steps 15]
        [--e2e-rounds 2] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "packing_step_cpu.md"
ROUND = 64  # sequence_length_round of grpo_math_1B.yaml


@dataclass(frozen=True)
class Case:
    name: str
    description: str
    train_micro: int
    logprob_micro: int
    train_tokens: int
    logprob_tokens: int


DEMO = Case("demo", "arith-tiny (1.1M params, 4 layers), 128 rows of 7-14 tokens", 64, 128, 64 * 32, 128 * 32)
MIXED = Case(
    "mixed", "tiny_qwen2-like (2 layers, hidden 128), 64 rows of GSM-like lengths (≤ 1024)", 4, 4, 4 * 1024, 4 * 1024
)
LAYOUTS = {
    "padded": {},
    "dynamic": {"dynamic_batching": {"enabled": True, "sequence_length_round": ROUND}},
    "packing": {"sequence_packing": {"enabled": True, "sequence_length_round": ROUND}},
}


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except OSError:
        return "unknown"


# ------------------------------------------------------------------------------ worker
def mixed_model(path: Path) -> str:
    """The tests' tiny Qwen2 (hidden 128, 2 layers, 2 heads of 64, vocab 64), 1024 positions."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def lengths_for(case: Case, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, total lengths) of the case's batch."""
    if case is DEMO:  # measured on the demo's data: prompts of 4-6 tokens, answers of 3-4 (+ a few cut at 8)
        prompt = rng.choice([4, 5, 6], 128, p=[0.01, 0.15, 0.84])
        return prompt, prompt + rng.choice([3, 4, 8], 128, p=[0.45, 0.5, 0.05])
    prompt = rng.integers(60, 220, 64)
    total = np.clip(prompt + rng.lognormal(np.log(180), 0.5, 64), 32, 1024).astype(np.int64)
    return np.minimum(prompt, total - 1), total


def make_batch(case: Case, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    prompt, total = lengths_for(case, rng)
    B, S = len(total), int(total.max())
    cols = torch.arange(S)[None, :]
    attention_mask = (cols < torch.from_numpy(total)[:, None]).long()
    token_mask = (attention_mask.bool() & (cols >= torch.from_numpy(prompt)[:, None])).float()
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(B, generator=g)
    return {
        "input_ids": torch.randint(1, vocab, (B, S), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": -torch.rand(B, S, generator=g) * token_mask,
        "advantages": adv[:, None] * token_mask,
        "sample_mask": torch.ones(B),
    }


def policy_cfg(case: Case, layout: str):
    from grpo_train.config.schema import PolicyConfig

    budgets = {"train_mb_tokens": case.train_tokens, "logprob_mb_tokens": case.logprob_tokens}
    extra = {k: {**v, **budgets} for k, v in LAYOUTS[layout].items()}
    batch = 128 if case is DEMO else 64
    return PolicyConfig(
        precision="float32",
        train_global_batch_size=batch,
        train_micro_batch_size=case.train_micro,
        logprob_batch_size=case.logprob_micro,
        use_fused_kernels=case is not DEMO,
        max_grad_norm=1.0,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-6}},
        **extra,
    )


def tokens_run(case: Case, layout: str, batch: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """(real tokens, tokens the train micro-batches run incl. padding, train micro-batches)."""
    from grpo_train.policy import microbatch

    lengths = microbatch.row_lengths(batch["attention_mask"])
    plan = microbatch.make_planner(policy_cfg(case, layout), "train").plan(lengths, batch["input_ids"].shape[1])
    return sum(lengths), sum(mb.tokens for mb in plan), len(plan)


def time_worker(case: Case, model_path: str, repeats: int) -> list[dict]:
    """Layouts run in turns (padded, dynamic, packing, padded, ...) so that load from other jobs
    on a shared machine falls on all of them alike."""
    from grpo_train.config.schema import LossConfig
    from grpo_train.policy.worker import PolicyWorker

    workers = {
        layout: PolicyWorker(model_path, policy_cfg(case, layout), LossConfig(reference_policy_kl_penalty=0.01), seed=0)
        for layout in LAYOUTS
    }
    batches = {layout: make_batch(case, w.model.config.vocab_size) for layout, w in workers.items()}
    times: dict[str, list[tuple[float, float]]] = {layout: [] for layout in LAYOUTS}
    for _ in range(repeats + 1):  # the first round warms up
        for layout, worker in workers.items():
            batch = batches[layout]
            t0 = time.perf_counter()
            batch["prev_logprobs"] = worker.logprobs(batch)
            batch["ref_logprobs"] = worker.logprobs(batch, reference=True)
            t1 = time.perf_counter()
            worker.train(batch)
            times[layout].append((t1 - t0, time.perf_counter() - t1))
    rows = []
    for layout, measured in times.items():
        logprob_s, train_s = zip(*measured[1:])
        step = [a + b for a, b in zip(logprob_s, train_s)]
        real, run, n_mb = tokens_run(case, layout, batches[layout])
        rows.append(
            {
                "case": case.name,
                "layout": layout,
                "real": real,
                "run": run,
                "micro_batches": n_mb,
                "logprob": statistics.median(logprob_s),
                "train": statistics.median(train_s),
                "step": statistics.median(step),
                "best": min(step),
            }
        )
    return rows


# --------------------------------------------------------------------------------- e2e
E2E_COMMON = [
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "checkpointing.enabled=false",
    "logger.wandb_enabled=false",
    "logger.tensorboard_enabled=false",
    "logger.plot_enabled=false",
]


def run_demo(layout: str, steps: int) -> dict:
    """One `grpo train` run of the demo -> per-step timings of steps 2..N and the run's wall time."""
    overrides = [f"grpo.max_num_steps={steps}", *E2E_COMMON]
    for section in LAYOUTS[layout]:
        overrides += [
            f"policy.{section}.enabled=true",
            f"policy.{section}.sequence_length_round={ROUND}",
            f"policy.{section}.train_mb_tokens={DEMO.train_tokens}",
            f"policy.{section}.logprob_mb_tokens={DEMO.logprob_tokens}",
        ]
    run_dir = Path(tempfile.mkdtemp(prefix="grpo-bench-packing-")) / "run"
    cmd = [sys.executable, "-m", "grpo_cli.main", "train", "--run-dir", str(run_dir), *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"grpo train ({layout}) failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"wall": wall, "steps": [r for r in rows if r["split"] == "train"][1:]}


def time_demo(steps: int, rounds: int) -> list[dict]:
    """`rounds` runs per layout, in turns; medians over the steady steps of all of them."""
    runs: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    for _ in range(rounds):
        for layout in LAYOUTS:
            runs[layout].append(run_demo(layout, steps))
    out = []
    for layout, done in runs.items():
        steady = [r for run in done for r in run["steps"]]

        def med(key: str) -> float:
            return statistics.median(r[key] for r in steady if key in r)

        per_run = [statistics.median(r["timing/step_s"] for r in run["steps"]) for run in done]
        out.append(
            {
                "layout": layout,
                "wall": statistics.median(run["wall"] for run in done),
                "per_run": per_run,
                "logprob": med("timing/logprob_s"),
                "train": med("timing/train_s"),
                "step": med("timing/step_s"),
                "reward": statistics.mean(run["steps"][-1]["reward_mean"] for run in done),
                "refit_diff": max(r.get("refit/max_abs_logprob_diff", 0.0) for r in steady),
            }
        )
    return out


# ------------------------------------------------------------------------------ report
def report(worker_rows: list[dict], e2e_rows: list[dict], args) -> str:
    lines = [
        "# Sequence packing and dynamic batching vs padded micro-batches (CPU)",
        "",
        f"Produced by `benchmarks/e2e/bench_packing_step.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"- machine: {machine()}",
        f"- load average at start (1/5/15 min): {' / '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"torch threads in the worker measurements: {args.threads}",
        f"- commit: {git_commit()} (plus the working tree under test)",
        f"- sequence_length_round {ROUND} for both token-budget layouts; packing algorithm modified_first_fit_decreasing",
        "",
        f"## Policy work of one GRPO step, in-process (prev + ref logprobs + one optimizer step), {args.repeats} repeats",
        "",
        "`tokens run` counts what the train micro-batches feed the model, padding included.",
        "",
        "| case | layout | real tokens | tokens run | train micro-batches | logprobs (s) | train (s) | step median (s) | step best (s) | vs padded |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in worker_rows:
        base = next(x for x in worker_rows if x["case"] == r["case"] and x["layout"] == "padded")
        lines.append(
            f"| {r['case']} | {r['layout']} | {r['real']:,} | {r['run']:,} | {r['micro_batches']} | {r['logprob']:.3f} | "
            f"{r['train']:.3f} | {r['step']:.3f} | {r['best']:.3f} | {base['step'] / r['step']:.2f}x |"
        )
    lines += ["", "Cases: " + "; ".join(f"`{c.name}`: {c.description}" for c in (DEMO, MIXED)) + ".", ""]
    if e2e_rows:
        lines += [
            f"## The offline demo end to end (`grpo train`, {args.e2e_rounds} runs of {args.e2e_steps} steps per layout "
            "taken in turns, median over steps 2..N of all runs)",
            "",
            "| layout | logprob phase (s) | train phase (s) | whole step (s) | vs padded | step median of each run (s) | run wall time (s) | mean last-step train reward | refit check max abs diff |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        base = next(r for r in e2e_rows if r["layout"] == "padded")
        for r in e2e_rows:
            lines.append(
                f"| {r['layout']} | {r['logprob']:.3f} | {r['train']:.3f} | {r['step']:.3f} | "
                f"{base['step'] / r['step']:.2f}x | {', '.join(f'{x:.3f}' for x in r['per_run'])} | {r['wall']:.0f} | "
                f"{r['reward']:.3f} | {r['refit_diff']:.1e} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the in-process measurements")
    parser.add_argument("--e2e-steps", type=int, default=15)
    parser.add_argument("--e2e-rounds", type=int, default=2, help="demo runs per layout (taken in turns)")
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from grpo_train.assets import builtin_model_path

    worker_rows = time_worker(DEMO, str(builtin_model_path("arith-tiny")), args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        worker_rows += time_worker(MIXED, mixed_model(Path(tmp)), args.repeats)
    e2e_rows = [] if args.skip_e2e else time_demo(args.e2e_steps, args.e2e_rounds)
    text = report(worker_rows, e2e_rows, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
