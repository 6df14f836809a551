"""grpo vs TRL's GRPOTrainer, side by side in one invocation, on the offline demo's task.

Same bundled model (builtin:arith-tiny, float32, CPU), same prompts (2-digit addition, the
demo's train/validation generators), same scoring (grpo_envs' first-integer match), batch
16 prompts x 8 generations in one optimizer step of two 64-row micro-batches, lr 3e-5 constant,
AdamW (0.9, 0.999, 1e-8, no weight decay), grad-norm clip 1.0, KL 0.01 (k3), ratio clip 0.2,
token-mean loss over the batch (TRL's "dapo" = grpo's token_level_loss), 8 new tokens at
temperature 1.0, 40 steps, greedy held-out accuracy on the 256 validation prompts at steps
0, 10, 20, 30, 40.

Where the two differ (stated in the results file): grpo generates with vLLM (CPU build), TRL
with transformers' `generate`; grpo's baseline is leave-one-out (its demo config), TRL's the
group mean; grpo runs a refit check each step (TRL has no separate engine to check).

`--scale 34m` runs the same comparison on a ~34M-parameter Qwen2-style model (hidden 512, 8 layers,
intermediate 2048, the bundled tokenizer; random init, written once to a temporary folder and loaded
by both sides): 8 prompts x 8 generations, 64 new tokens, two 32-row micro-batches, no validation
(random weights score nothing). The init makes the end-of-sequence token unreachable (one embedding
coordinate is a shared constant, the eos row its negative), so both sides generate exactly 64 tokens
per sample and do the same work whatever their sampler's stopping rule.

Usage (needs the benchmark-only group: `uv sync --frozen --group bench`):
    uv run --no-sync python benchmarks/e2e/bench_vs_trl.py [--scale tiny|34m] [--steps 40] [--out FILE.md]
        [--grpo-override policy.reference_beside_training=true ...]
The report is appended to the results file (one section per run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import grpo_train  # noqa: E402
from bench_demo import ROOT, git_commit, machine  # noqa: E402

PROMPTS_PER_STEP, GENERATIONS, MICRO_BATCH = 16, 8, 64
LR, BETA, CLIP, MAX_NEW_TOKENS, SEED = 3e-5, 0.01, 0.2, 8, 42
TRAIN_ROWS, TRAIN_SEED, VAL_ROWS, VAL_SEED, DIGITS = 100_000, 1, 256, 2, 2
VAL_PERIOD = 10


class Scale:
    """What differs between the two scales; the rest (lr, KL, clip, loss, task) is shared."""

    def __init__(self, name: str) -> None:
        self.name = name
        big = name == "34m"
        self.prompts, self.micro_batch = (8, 32) if big else (PROMPTS_PER_STEP, MICRO_BATCH)
        self.max_new_tokens = 64 if big else MAX_NEW_TOKENS
        self.validate = not big
        self.model_path = ""  # set by main (the bundled model, or the 34M model it writes)
        self.extra: list[str] = []  # --grpo-override: extra `grpo train` overrides (an A/B of a grpo setting)

    @property
    def rows(self) -> int:
        return self.prompts * GENERATIONS


def write_34m_model(folder: Path) -> Path:
    """A randomly initialised ~34M Qwen2 with the bundled tokenizer; eos cannot be sampled (see the docstring)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_train.assets import builtin_model_path

    tiny = builtin_model_path("arith-tiny")
    config = AutoConfig.from_pretrained(tiny)
    config.update(
        {
            "hidden_size": 512,
            "intermediate_size": 2048,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "max_position_embeddings": 128,
            "layer_types": ["full_attention"] * 8,
        }
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # tied with lm_head
        emb[:, 0] = 4.0  # a shared coordinate: the final norm's output keeps a large positive value there
        emb[config.eos_token_id, 0] = -4.0  # so eos's logit sits far below every other token's (p < 1e-20 measured)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, folder / f.name)
    return folder


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# ------------------------------------------------------------------------------ TRL side
def trl_main(steps: int, out_json: Path, scale: Scale) -> None:
    """Runs in its own process (the timings count its imports like grpo's)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_data.arithmetic import ArithmeticDataset
    from grpo_envs.answers import canonical_integer, first_integer
    from grpo_train.assets import builtin_model_path
    from grpo_train.step import process_age_s

    model_path = scale.model_path or str(builtin_model_path("arith-tiny"))
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)

    def rows(size: int, seed: int) -> list[dict]:
        data = ArithmeticDataset(size, seed, DIGITS)
        return [{"prompt": r["problem"], "answer": r["answer"]} for r in (data[i] for i in range(size))]

    train, val = Dataset.from_list(rows(TRAIN_ROWS, TRAIN_SEED)), rows(VAL_ROWS, VAL_SEED)

    def score(completion: str, answer: str) -> float:
        return 1.0 if first_integer(completion) == canonical_integer(answer) else 0.0

    def arithmetic_reward(prompts, completions, answer, **_) -> list[float]:
        return [score(c, a) for c, a in zip(completions, answer)]

    @torch.no_grad()
    def held_out_accuracy(m) -> float:
        enc = tokenizer([r["prompt"] for r in val], return_tensors="pt", padding=True, add_special_tokens=False)
        was_training = m.training
        m.eval()
        out = m.generate(
            **enc, do_sample=False, max_new_tokens=scale.max_new_tokens, pad_token_id=tokenizer.pad_token_id
        )
        m.train(was_training)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        return sum(score(t, r["answer"]) for t, r in zip(texts, val)) / len(val)

    record: dict = {"steps": [], "val": {}, "phases": []}

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if "startup_s" not in record:
                record["startup_s"] = process_age_s()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            record["steps"].append(time.perf_counter() - self.t0)
            if scale.validate and (state.global_step % VAL_PERIOD == 0 or state.global_step == steps):
                record["val"][state.global_step] = held_out_accuracy(model)

    class TimedGRPOTrainer(GRPOTrainer):
        """Splits a step: generation + rewards + reference logprobs, and the rest (training)."""

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            record["phases"].append(time.perf_counter() - t0)
            return out

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        max_steps=steps,
        learning_rate=LR,
        per_device_train_batch_size=scale.micro_batch,
        gradient_accumulation_steps=scale.rows // scale.micro_batch,
        num_generations=GENERATIONS,
        max_completion_length=scale.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        beta=BETA,
        epsilon=CLIP,
        loss_type="dapo",
        scale_rewards="group",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=SEED,
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        disable_dropout=True,
        log_completions=False,
    )
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[Timing()],
    )
    if scale.validate:
        record["val"][0] = held_out_accuracy(trainer.model)  # step-0 validation, as grpo's val_at_start
    trainer.train()
    record["threads"] = torch.get_num_threads()
    out_json.write_text(json.dumps(record))


# ----------------------------------------------------------------------------- grpo side
def grpo_overrides(scale: Scale) -> list[str]:
    if scale.name == "tiny":
        return list(scale.extra)
    return [
        *scale.extra,
        f"policy.model_name={scale.model_path}",
        f"grpo.num_prompts_per_step={scale.prompts}",
        f"policy.train_global_batch_size={scale.rows}",
        f"policy.train_micro_batch_size={scale.micro_batch}",
        f"policy.generation.max_new_tokens={scale.max_new_tokens}",
        "policy.max_total_sequence_length=96",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
    ]


def run_grpo(steps: int, scale: Scale) -> dict:
    res = grpo_train("grpo", [f"grpo.max_num_steps={steps}", *grpo_overrides(scale)], prefix="grpo-vs-trl-")
    wall, rows, train = res.wall, res.rows, res.train
    steady = train[1:] or train
    phases = {}
    for key in sorted(
        {k for r in steady for k in r if k.startswith("timing/") and k not in ("timing/step_s", "timing/startup_s")}
    ):
        phases[key[len("timing/") : -2]] = statistics.median(r.get(key, 0.0) for r in steady)
    return {
        "wall_s": wall,
        "startup_s": train[0].get("timing/startup_s", float("nan")),
        "step_s": statistics.median(r["timing/step_s"] for r in steady),
        "phases": phases,
        "min_step_s": min(r["timing/step_s"] for r in steady),
        "val": {r["step"]: r["accuracy"] for r in rows if r["split"] == "val"},
    }


def run_trl(steps: int, scale: Scale) -> dict:
    out_json = Path(tempfile.mkdtemp(prefix="trl-bench-")) / "trl.json"
    cmd = [
        sys.executable,
        __file__,
        "--trl-worker",
        str(out_json),
        "--steps",
        str(steps),
        "--scale",
        scale.name,
        "--model-path",
        scale.model_path,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"TRL run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rec = json.loads(out_json.read_text())
    steady = rec["steps"][1:] or rec["steps"]
    gen = statistics.median(rec["phases"][1:] or rec["phases"])
    step = statistics.median(steady)
    return {
        "wall_s": wall,
        "startup_s": rec["startup_s"],
        "step_s": step,
        "threads": rec["threads"],
        "min_step_s": min(steady),
        "phases": {"generate+reward+ref_logprob": gen, "train (rest of the step)": step - gen},
        "val": {int(k): v for k, v in rec["val"].items()},
    }


def curve(val: dict) -> str:
    return ", ".join(f"{k}: {v:.3f}" for k, v in sorted(val.items()))


def report(grpo: dict, trl: dict, steps: int, load_before: str, load_after: str, order: str, scale: Scale) -> str:
    ratio = lambda a, b: f"{a / b:.2f}x"  # noqa: E731
    title = (
        "tiny scale (bundled arith-tiny, ~1M params)"
        if scale.name == "tiny"
        else "34M scale (Qwen2-style, hidden 512, 8 layers, random init, bundled tokenizer)"
    )
    lines = [
        f"# grpo vs TRL GRPOTrainer, {title} on CPU",
        "",
        f"- machine: {machine()}",
        f"- commit: {git_commit()}; TRL 1.16.0 (benchmark-only `bench` group), run order: {order}, back to back",
        f"- load before: `{load_before}`",
        f"- load after: `{load_after}`",
        f"- settings: {scale.prompts} prompts x {GENERATIONS} generations, one optimizer step of "
        f"{scale.rows // scale.micro_batch} x {scale.micro_batch} rows, lr {LR} constant, KL {BETA} (k3), clip {CLIP}, "
        f"{scale.max_new_tokens} new tokens at T=1.0, {steps} steps, float32"
        + (
            ""
            if scale.validate
            else ", no validation (random weights; eos unreachable, so every sample has all its tokens)"
        )
        + (f"; grpo overrides: `{' '.join(scale.extra)}`" if scale.extra else ""),
        "- differences: grpo generates with vLLM (CPU), TRL with transformers `generate`; grpo's baseline is "
        "leave-one-out (demo config), TRL's the group mean; grpo checks the refit every step",
        "- time to first step = process start -> start of step 1"
        + (" (after the step-0 validation)" if scale.validate else "")
        + ", both sides",
        "",
        "| | TRL | grpo | grpo / TRL | target |",
        "|---|---|---|---|---|",
        f"| median s/step (steps 2-{steps}) | {trl['step_s']:.3f} | {grpo['step_s']:.3f} | {ratio(grpo['step_s'], trl['step_s'])} | <= 0.6x |",
        f"| fastest step, steps 2-{steps} (s; load shows as a gap to the median) | {trl['min_step_s']:.3f} | {grpo['min_step_s']:.3f} | {ratio(grpo['min_step_s'], trl['min_step_s'])} | |",
        f"| time to first step (s) | {trl['startup_s']:.1f} | {grpo['startup_s']:.1f} | {ratio(grpo['startup_s'], trl['startup_s'])} | grpo <= 15 s |",
        f"| whole process (s) | {trl['wall_s']:.1f} | {grpo['wall_s']:.1f} | {ratio(grpo['wall_s'], trl['wall_s'])} | <= 1.5x |",
        "",
        "Per-phase median seconds (steps 2..N):",
        "",
        "| side | phase | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| grpo | {k} | {v:.3f} |" for k, v in grpo["phases"].items()]
    lines += [f"| TRL | {k} | {v:.3f} |" for k, v in trl["phases"].items()]
    lines += [""]
    if scale.validate:
        lines += [f"Held-out greedy accuracy: grpo {curve(grpo['val'])}; TRL {curve(trl['val'])}"]
    lines += [f"(TRL ran with torch's {trl['threads']} threads)", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", choices=["tiny", "34m"], default="tiny")
    parser.add_argument("--steps", type=int, default=None, help="40 at the tiny scale, 4 at 34m")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="appended to; default benchmarks/results/e2e_vs_trl_cpu.md (tiny), e2e_vs_trl_34m_cpu.md (34m)",
    )
    parser.add_argument(
        "--grpo-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra `grpo train` override for grpo's side (repeatable; stated in the report)",
    )
    parser.add_argument("--trl-worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    scale = Scale(args.scale)
    scale.extra = list(args.grpo_override)
    steps = args.steps or (40 if args.scale == "tiny" else 4)
    if args.trl_worker is not None:
        scale.model_path = args.model_path
        trl_main(steps, args.trl_worker, scale)
        return 0
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if scale.name == "34m":
        scale.model_path = str(write_34m_model(Path(tempfile.mkdtemp(prefix="bench-34m-")) / "model"))
    out = args.out or ROOT / "benchmarks" / "results" / (
        "e2e_vs_trl_cpu.md" if scale.name == "tiny" else "e2e_vs_trl_34m_cpu.md"
    )
    load_before = uptime()
    trl = run_trl(steps, scale)
    grpo = run_grpo(steps, scale)
    text = report(grpo, trl, steps, load_before, uptime(), "TRL then grpo", scale)
    with out.open("a") as f:  # appended: the file keeps every run's section
        f.write(("\n" if out.exists() and out.stat().st_size else "") + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
