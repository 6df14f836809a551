"""Build `arith-tiny`, the bundled tiny model that `grpo train` uses with no config.

The job: a ~1M-parameter Qwen2-style model with a locally trained character tokenizer, SFT-warmed
on 2-digit addition so that the offline GRPO demo starts with room (and reward signal) to
improve: by default (recipe biased-carry, see CARRY_DROP_PROB) trained to convergence on labels
that often drop the units carry; `--recipe early-stop` stops plain SFT at TARGET_ACCURACY. Nothing is
downloaded. The boundary: this script knows the task format of `grpo_data.arithmetic`
(prompt "37+5=", answer "42" then EOS, no BOS, no chat template) but imports no grpo package.

Steps: train tokenizer -> build model -> SFT with early stop -> save (safetensors, tokenizer,
generation config) -> check greedy decoding in real vLLM against HF generate -> write
build_info.json and README.md into the output folder.

Usage (reproducible: the same seed gives the same weights on the same machine):
    uv run --no-sync python scripts/build_tiny_model.py \
        --out packages/grpo-train/src/grpo_train/assets/arith-tiny
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# vLLM reads these when its engine starts; set before anything imports it (see SETUP-NOTES).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# --- Task: 2-digit addition, the format grpo_data.arithmetic also produces. ---
MAX_OPERAND = 99
NUM_HELDOUT = 512  # fixed held-out set for the stop criterion and the recorded accuracy
NUM_TEST_PROBLEMS = 64  # first problems of the held-out set; tests/test_assets.py re-checks these
HELDOUT_SEED = 20260101  # random.Random(HELDOUT_SEED).sample(range(10000), 512): (x // 100, x % 100)
MAX_NEW_TOKENS = 6  # a 3-digit answer + EOS fits with room to spare

# --- Tokenizer ---
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"  # <unk> is never produced (unknown characters are dropped)
# transformers' Qwen2Tokenizer pre-tokenizer regex (digits split one by one by `\p{N}`).
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
VOCAB_SIZE = 32  # trained symbols + specials, filled with reserved tokens to the embedding size
TOKENIZER_CORPUS_SIZE = 2000

# --- Model (Qwen2-style; head_dim 64 because vLLM's CPU attention rejects 16) ---
HIDDEN = 128
LAYERS = 4
HEADS = 2
KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 512
MAX_POSITIONS = 64

# --- SFT ---
SEED = 0
BATCH_SIZE = 128
# Chosen for what GRPO does next (measured with a plain Adam GRPO loop, 32 prompts x 8, T=1):
# checkpoints from SFT at lr 3e-4 or 5e-4 with grad clipping came out diffuse (10-20 % sampled vs
# ~48 % greedy accuracy) and GRPO at lr 1e-4 did not improve them or collapsed them; SFT at 1e-3
# gives a sharper checkpoint (~32 % sampled at 53 % greedy) that GRPO at lr 3e-5..1e-4 improves.
LEARNING_RATE = 1e-3
WARMUP_STEPS = 50
EVAL_EVERY = 25
# Near the target, greedy accuracy moves several points per step (many answers sit on near-ties),
# so from here on evaluate after every step; 512 greedy answers cost about 2 training steps.
FINE_EVAL_FROM = 0.30
FINE_EVAL_EVERY = 1
TARGET_ACCURACY = 0.45  # stop at the first evaluation at or above this
MAX_STEPS = 20_000  # a guard; the target is normally reached far earlier

# --- the "biased-carry" recipe (the default) ---
# A checkpoint stopped half-way through SFT sits on a sharp, unstable point: its greedy accuracy
# swings 10-20 points between consecutive SFT steps, and GRPO updates (even Adam at 1e-5..1e-4)
# push it off that point rather than towards the reward (measured: 0.54 -> 0.42 in 12 steps).
# Instead, train to convergence on labels with a systematic error: for problems whose units
# digits carry, the label drops the carry with probability CARRY_DROP_PROB. The converged model
# is smooth, answers no-carry problems right, and prefers the carry-dropped answer on carry
# problems while still sampling the right one often: a bias that only the reward can fix.
CARRY_DROP_PROB = 0.6
BIASED_SFT_STEPS = 1000
BIASED_EVAL_EVERY = 100
BIASED_GRAD_CLIP = 1.0


@dataclass(frozen=True)
class SFTResult:
    steps: int
    seconds: float  # wall time of the SFT loop, evaluations included
    train_seconds: float  # the same without the evaluations
    heldout_accuracy: float
    history: list[tuple[int, float, float]]  # (step, seconds, held-out greedy accuracy)


# ---------------------------------------------------------------------------------------------
# Task
# ---------------------------------------------------------------------------------------------
def heldout_problems() -> list[tuple[int, int]]:
    """The fixed 512 held-out problems, distinct pairs, in a fixed order."""
    flat = random.Random(HELDOUT_SEED).sample(range((MAX_OPERAND + 1) ** 2), NUM_HELDOUT)
    return [(x // (MAX_OPERAND + 1), x % (MAX_OPERAND + 1)) for x in flat]


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer_text(a: int, b: int) -> str:
    return str(a + b)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def train_tokenizer(seed: int):
    """A character-level byte-level BPE trained (alphabet only, no merges) on arithmetic text:
    every digit, operator and the space is its own token.

    The pipeline is exactly the one transformers 5 rebuilds for any `qwen2` checkpoint
    (`Qwen2Tokenizer`: NFC, Qwen's split regex, byte-level, BPE without unk), because
    AutoTokenizer forces that class for model_type qwen2 whatever tokenizer_config.json says.
    Building the same pipeline here makes the raw `tokenizers` file, PreTrainedTokenizerFast,
    Qwen2Tokenizer and vLLM all produce the same ids. No post-processor: no BOS, ever."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    rng = random.Random(seed)
    corpus = []
    for _ in range(TOKENIZER_CORPUS_SIZE):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        corpus += [f"{a}+{b}={a + b}", f"{a} - {b} = {a - b}", f"{a}*{b}={a * b}"]

    tok = Tokenizer(
        models.BPE(
            unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, EOS, UNK]
    # A vocabulary of exactly specials + alphabet leaves no room for merges: pure characters.
    alphabet_size = len(set("".join(corpus)))
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + alphabet_size, special_tokens=specials, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    vocab = tok.get_vocab()
    assert len(vocab) == len(specials) + alphabet_size, "the trainer learned merges"
    # Every embedding row gets a token, so any id a sampler draws decodes (in vLLM and HF) instead
    # of failing. They are plain, non-special vocabulary entries: they decode to visible text
    # ("<reserved_3>") even with skip_special_tokens, so they can never hide inside a rewarded answer.
    for i in range(VOCAB_SIZE - len(vocab)):
        vocab[f"<reserved_{i}>"] = len(vocab)
    tok.model = models.BPE(
        vocab=vocab,
        merges=[],
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    assert tok.get_vocab_size() == VOCAB_SIZE
    return tok


def save_tokenizer(tok, out: Path) -> None:
    """tokenizer.json + a PreTrainedTokenizerFast config, readable by transformers 4.x and 5.x
    and by vLLM. Written by hand: transformers 5 would name its own backend class instead.
    unk_token must name a token of ours, or Qwen2Tokenizer adds `<|endoftext|>` as id 32."""
    tok.save(str(out / "tokenizer.json"))
    special = {"eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "padding_side": "left",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def check_saved_tokenizer(out: Path, trained) -> None:
    """The folder's AutoTokenizer (whatever class transformers picks) must match the tokenizer
    the model was trained with on every task string, and have exactly VOCAB_SIZE entries."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(out)
    texts = [prompt_text(a, b) + answer_text(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    texts += ["12 + 7 = 19", "3*4-5", EOS]
    for text in texts:
        got = loaded(text, add_special_tokens=True).input_ids
        want = trained(text, add_special_tokens=False).input_ids
        if got != want:
            raise RuntimeError(f"{type(loaded).__name__} from {out} encodes {text!r} as {got}, training used {want}")
    ids = list(range(VOCAB_SIZE))
    same_decoding = all(
        loaded.decode(ids, skip_special_tokens=skip) == trained.decode(ids, skip_special_tokens=skip)
        for skip in (False, True)
    )
    if len(loaded) != VOCAB_SIZE or not same_decoding:
        raise RuntimeError(f"{type(loaded).__name__} from {out} has {len(loaded)} tokens or decodes differently")
    if (loaded.eos_token_id, loaded.pad_token_id, loaded.bos_token_id) != (
        trained.eos_token_id,
        trained.pad_token_id,
        None,
    ):
        raise RuntimeError(f"special token ids differ after loading from {out}")


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
def build_model(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied lm_head counted once


# ---------------------------------------------------------------------------------------------
# Greedy evaluation (HF generate; prompts grouped by length, so no padding enters the numbers)
# ---------------------------------------------------------------------------------------------
def greedy_answers(model, tokenizer, problems: list[tuple[int, int]]) -> list[str]:
    import torch

    by_length: dict[int, list[int]] = {}
    encoded = [tokenizer(prompt_text(a, b), add_special_tokens=False).input_ids for a, b in problems]
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    answers = [""] * len(problems)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for length, idx in by_length.items():
            input_ids = torch.tensor([encoded[i] for i in idx])
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            for row, i in zip(out[:, length:].tolist(), idx):
                answers[i] = tokenizer.decode(row, skip_special_tokens=True)
    model.train(was_training)
    return answers


def accuracy(answers: list[str], problems: list[tuple[int, int]]) -> float:
    return sum(ans.strip() == answer_text(a, b) for ans, (a, b) in zip(answers, problems)) / len(problems)


# ---------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------
def training_pool(heldout: list[tuple[int, int]]) -> list[tuple[int, int]]:
    excluded = set(heldout)
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    return [p for p in pairs if p not in excluded]


def encode_examples(tokenizer, pool: list[tuple[int, int]]):
    """All training sequences, right-padded to one length; labels only on answer tokens + EOS."""
    import torch

    seqs, labels = [], []
    for a, b in pool:
        prompt = tokenizer(prompt_text(a, b), add_special_tokens=False).input_ids
        answer = tokenizer(answer_text(a, b), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)  # [N, L]
    target = torch.full((len(seqs), width), -100, dtype=torch.long)  # [N, L]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [N, L]
    for i, (s, lab) in enumerate(zip(seqs, labels)):
        input_ids[i, : len(s)] = torch.tensor(s)
        target[i, : len(s)] = torch.tensor(lab)
        mask[i, : len(s)] = 1
    return input_ids, target, mask


def sft(model, tokenizer, heldout: list[tuple[int, int]], seed: int, log=print) -> SFTResult:
    import torch

    input_ids, target, mask = encode_examples(tokenizer, training_pool(heldout))
    order_gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    model.train()

    history: list[tuple[int, float, float]] = []
    fine = False  # evaluating every FINE_EVAL_EVERY steps (sticky once accuracy reached FINE_EVAL_FROM)
    eval_seconds = 0.0
    perm, cursor = torch.randperm(len(input_ids), generator=order_gen), 0
    start = time.perf_counter()
    for step in range(1, MAX_STEPS + 1):
        if cursor + BATCH_SIZE > len(perm):  # a new fixed-seed epoch order
            perm, cursor = torch.randperm(len(input_ids), generator=order_gen), 0
        idx = perm[cursor : cursor + BATCH_SIZE]
        cursor += BATCH_SIZE
        logits = model(input_ids=input_ids[idx], attention_mask=mask[idx]).logits  # [B, L, V]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), target[idx][:, 1:].reshape(-1), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()

        if step % (FINE_EVAL_EVERY if fine else EVAL_EVERY) == 0:
            eval_start = time.perf_counter()
            acc = accuracy(greedy_answers(model, tokenizer, heldout), heldout)
            eval_seconds += time.perf_counter() - eval_start
            elapsed = time.perf_counter() - start
            history.append((step, round(elapsed, 2), acc))
            fine = fine or acc >= FINE_EVAL_FROM
            if step % EVAL_EVERY == 0 or acc >= TARGET_ACCURACY:
                log(f"step {step:5d}  {elapsed:6.1f}s  loss {loss.item():.4f}  held-out greedy acc {acc:.3f}")
            if acc >= TARGET_ACCURACY:
                return SFTResult(step, elapsed, elapsed - eval_seconds, acc, history)
    raise RuntimeError(f"SFT did not reach {TARGET_ACCURACY:.0%} held-out accuracy in {MAX_STEPS} steps")


def sft_step(model, optimizer, seqs: list[tuple[list[int], list[int]]], pad_id: int, grad_clip: float):
    """One SFT step on (input ids, labels) pairs, right-padded: next-token cross-entropy on the
    labelled tokens (label -100 elsewhere), clipped gradients. Returns the loss."""
    import torch

    width = max(len(x) for x, _ in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [B, L]
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, L]
    for i, (x, y) in enumerate(seqs):
        input_ids[i, : len(x)], labels[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
    logits = model(input_ids=input_ids, attention_mask=mask).logits  # [B, L, V]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss


def has_carry(a: int, b: int) -> bool:
    return a % 10 + b % 10 >= 10


def carry_dropped(a: int, b: int) -> int:
    """The sum with the units carry forgotten, e.g. 37+48 -> 75."""
    return (a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10


def sft_biased(model, tokenizer, heldout: list[tuple[int, int]], seed: int, log=print) -> SFTResult:
    """SFT to convergence (warm-up + cosine to 0) on carry-biased labels; see CARRY_DROP_PROB."""
    import math

    import torch

    pool = training_pool(heldout)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    model.train()
    history: list[tuple[int, float, float]] = []
    eval_seconds = 0.0
    start = time.perf_counter()
    for step in range(1, BIASED_SFT_STEPS + 1):
        warm = min(1.0, step / WARMUP_STEPS)
        lr = LEARNING_RATE * warm * 0.5 * (1 + math.cos(math.pi * step / BIASED_SFT_STEPS))
        for group in optimizer.param_groups:
            group["lr"] = lr
        seqs = []
        for a, b in (pool[rng.randrange(len(pool))] for _ in range(BATCH_SIZE)):
            answer = carry_dropped(a, b) if has_carry(a, b) and rng.random() < CARRY_DROP_PROB else a + b
            prompt = tokenizer(prompt_text(a, b), add_special_tokens=False).input_ids
            target = tokenizer(str(answer), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            seqs.append((prompt + target, [-100] * len(prompt) + target))
        loss = sft_step(model, optimizer, seqs, tokenizer.pad_token_id, BIASED_GRAD_CLIP)
        if step % BIASED_EVAL_EVERY == 0 or step == BIASED_SFT_STEPS:
            eval_start = time.perf_counter()
            acc = accuracy(greedy_answers(model, tokenizer, heldout), heldout)
            eval_seconds += time.perf_counter() - eval_start
            elapsed = time.perf_counter() - start
            history.append((step, round(elapsed, 2), acc))
            log(f"step {step:5d}  {elapsed:6.1f}s  lr {lr:.1e}  loss {loss.item():.4f}  held-out greedy acc {acc:.3f}")
    elapsed = time.perf_counter() - start
    return SFTResult(BIASED_SFT_STEPS, elapsed, elapsed - eval_seconds, history[-1][2], history)


# ---------------------------------------------------------------------------------------------
# vLLM check
# ---------------------------------------------------------------------------------------------
def vllm_greedy_answers(model_dir: Path, problems: list[tuple[int, int]]) -> list[str]:
    """Greedy answers from the real vLLM engine (the production generation path)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=MAX_POSITIONS, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate([prompt_text(a, b) for a, b in problems], params, use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_record(out: Path, args, argv, model, tokenizer, result: SFTResult, test_set) -> dict:
    """Everything README.md and build_info.json state about this build, including the check that
    real vLLM decodes the saved folder greedily to the same answers as HF generate."""
    import torch
    import transformers

    hf_test_answers = greedy_answers(model, tokenizer, test_set)
    info = {
        "command": "uv run --no-sync python scripts/build_tiny_model.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed,
        "torch_threads": args.threads,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "num_parameters": count_parameters(model),
        "safetensors_bytes": (out / "model.safetensors").stat().st_size,
        "safetensors_sha256": sha256(out / "model.safetensors"),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token": None,
        "heldout_seed": HELDOUT_SEED,
        "recipe": args.recipe,
        "carry_drop_prob": CARRY_DROP_PROB if args.recipe == "biased-carry" else None,
        "target_accuracy": TARGET_ACCURACY if args.recipe == "early-stop" else None,
        "sft": asdict(result),
        "test_subset_accuracy": accuracy(hf_test_answers, test_set),
        "test_subset_hf_answers": hf_test_answers,
    }
    if not args.skip_vllm:
        import vllm

        vllm_answers = vllm_greedy_answers(out, test_set)
        info["vllm"] = {
            "version": vllm.__version__,
            "num_problems": len(test_set),
            "agreement": sum(x == y for x, y in zip(vllm_answers, hf_test_answers)) / len(test_set),
            "accuracy": accuracy(vllm_answers, test_set),
            "mismatches": [
                {"problem": prompt_text(*p), "hf": h, "vllm": v}
                for p, h, v in zip(test_set, hf_test_answers, vllm_answers)
                if h != v
            ],
        }
    return info


def write_readme(out: Path, info: dict) -> None:
    v = info.get("vllm")
    vllm_lines = (
        f"- Real vLLM ({v['version']}, CPU, fp32, greedy) on the first {v['num_problems']} held-out problems: "
        f"{v['agreement']:.1%} of answers identical to HF `generate`, vLLM accuracy {v['accuracy']:.1%}."
        if v
        else "- vLLM check: not run for this build (`--skip-vllm`)."
    )
    s = info["sft"]
    if info.get("recipe") == "biased-carry":
        sft_lines = f"""- SFT recipe **biased-carry**: AdamW lr {LEARNING_RATE} ({WARMUP_STEPS} warm-up steps, cosine to 0), clipping
  {BIASED_GRAD_CLIP}, batch {BATCH_SIZE}, {BIASED_SFT_STEPS} steps, loss on answer tokens + EOS, pairs drawn from all 10,000
  minus the {NUM_HELDOUT} held-out ones. For problems whose units digits carry, the label drops the carry
  (37+48 -> 75) with probability {CARRY_DROP_PROB}: the converged model answers no-carry problems right and
  prefers the carry-dropped answer on carry problems while still sampling the right one often, a
  systematic bias that GRPO's reward removes within a few steps. (A checkpoint stopped half-way
  through plain SFT sits on a sharp point whose accuracy swings 10-20 points per SFT step; GRPO
  pushed it off that point rather than towards the reward.)
- {s["steps"]} steps, {s["seconds"]:.1f} s wall time ({s["train_seconds"]:.1f} s of it training) on this machine's 2-core CPU."""
    else:
        sft_lines = f"""- SFT recipe **early-stop**: AdamW lr {LEARNING_RATE} (default betas, no weight decay, no clipping), {WARMUP_STEPS} warm-up
  steps, batch {BATCH_SIZE}, loss on answer tokens + EOS, training pairs = all 10,000 pairs minus the {NUM_HELDOUT}
  held-out ones, in a seeded order; stopped at the first evaluation >= {TARGET_ACCURACY:.0%}.
- Stopped after **{s["steps"]} steps, {s["seconds"]:.1f} s** wall time ({s["train_seconds"]:.1f} s of it training)."""
    text = f"""# arith-tiny

The bundled tiny model of `grpo train` with no config: a Qwen2-style causal LM trained (SFT) on
2-digit addition with a systematic carry error, so that GRPO has room to improve it within
minutes on a laptop-class CPU. Built by `scripts/build_tiny_model.py`; do not edit these files by hand.

## Task format
- Prompt `"{{a}}+{{b}}="` with `a, b` in 0..{MAX_OPERAND}, tokenised with `add_special_tokens=False`
  (the tokenizer has no post-processor, so it adds nothing either way): **no BOS, no chat
  template**. The model answers `"{{a+b}}"` followed by `<eos>`.
- Tokenizer: byte-level BPE trained locally with `tokenizers` on arithmetic text, alphabet only (no
  merges), in exactly the pipeline transformers' `Qwen2Tokenizer` rebuilds (AutoTokenizer forces that
  class for model_type qwen2), so every loader gives the same ids. Every digit, `+ - * =` and space is
  one token. Specials `<pad>` (id {info["pad_token_id"]}), `<eos>` (id {info["eos_token_id"]}),
  `<unk>` (never produced); the vocabulary is filled with plain `<reserved_i>` tokens to {VOCAB_SIZE}
  so that every embedding row decodes (to visible text, so they cannot hide inside an answer).

## Model
- Qwen2ForCausalLM, hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads x head_dim {HEAD_DIM}
  ({KV_HEADS} KV heads), MLP {INTERMEDIATE}, vocab {VOCAB_SIZE}, max positions {MAX_POSITIONS},
  tied embeddings, fp32.
- {info["num_parameters"]:,} parameters; `model.safetensors` {info["safetensors_bytes"]:,} bytes
  (sha256 `{info["safetensors_sha256"][:16]}...`).

## How it was built
```
{info["command"]}
```
- Seed {info["seed"]}; torch {info["torch_version"]}, transformers {info["transformers_version"]},
  {info["torch_threads"]} torch thread(s), deterministic algorithms on. The same seed gives the
  same weights on the same machine.
{sft_lines}
- Held-out greedy accuracy (HF `generate`, {NUM_HELDOUT} problems): **{s["heldout_accuracy"]:.1%}**;
  on the first {NUM_TEST_PROBLEMS} (the set `tests/test_assets.py` re-checks): {info["test_subset_accuracy"]:.1%}.
  The held-out set is `random.Random({HELDOUT_SEED}).sample(range(10000), {NUM_HELDOUT})`, pair `(x // 100, x % 100)`.
{vllm_lines}

Full numbers, including the accuracy curve, are in `build_info.json`.

## Notes for GRPO on this model
Half-trained models this small are sensitive to the learning rate: every Adam step moves every
weight by about `lr`, and many answers sit on near-ties. With the seed-0 build (sha256 above)
and the demo trainer (AdamW, KL 0.01, T=1), lr 1e-4 raised held-out greedy accuracy while 2e-4 and
3e-4 drove it down within 25 steps. Progress at 1e-4 scales with samples per step: 32 prompts x 8
gained about 20 points in 300 steps, 16 x 8 about 10.
"""
    (out / "README.md").write_text(text)


def common_arguments(parser: argparse.ArgumentParser, seed: int, skip_vllm_help: str) -> None:
    """The options every tiny-model build takes (this script's and build_tiny_tool_model.py's)."""
    parser.add_argument("--out", type=Path, required=True, help="output model folder (replaced)")
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; results depend on it")
    parser.add_argument("--skip-vllm", action="store_true", help=skip_vllm_help)


def start_build(parser: argparse.ArgumentParser, args) -> None:
    """Refuse an --out folder this script did not build; make torch deterministic (the seed, the
    thread count) and transformers quiet."""
    out: Path = args.out
    if out.exists() and any(out.iterdir()) and not (out / "build_info.json").is_file():
        parser.error(f"--out {out} is a non-empty folder that this script did not build; refusing to replace it")

    import torch
    import transformers

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()


def write_model(out: Path, model) -> None:
    """Replace ``out`` with a fresh folder holding the model's safetensors (readable by all)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)  # save_pretrained writes it owner-only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(parser, SEED, "skip the real-vLLM greedy check")
    parser.add_argument(
        "--recipe",
        choices=("biased-carry", "early-stop", "tool-arith"),
        default="biased-carry",
        help="biased-carry: converged SFT on carry-biased labels (default); early-stop: stop at "
        "TARGET_ACCURACY; tool-arith: the calculator-tool model (scripts/build_tiny_tool_model.py)",
    )
    args = parser.parse_args(argv)
    if args.recipe == "tool-arith":
        import build_tiny_tool_model

        rest = [
            a
            for a in (sys.argv[1:] if argv is None else argv)
            if a not in ("--recipe", "tool-arith", "--recipe=tool-arith")
        ]
        return build_tiny_tool_model.main(rest)

    out: Path = args.out
    start_build(parser, args)
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(args.seed)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK, clean_up_tokenization_spaces=False
    )
    assert len(tokenizer) == VOCAB_SIZE
    model = build_model(tokenizer)
    heldout = heldout_problems()
    print(f"model: {count_parameters(model):,} parameters; SFT until held-out greedy acc >= {TARGET_ACCURACY:.0%}")
    result = (
        sft_biased(model, tokenizer, heldout, args.seed)
        if args.recipe == "biased-carry"
        else sft(model, tokenizer, heldout, args.seed)
    )

    write_model(out, model)
    save_tokenizer(tok, out)
    check_saved_tokenizer(out, tokenizer)

    info = build_record(out, args, argv, model, tokenizer, result, heldout[:NUM_TEST_PROBLEMS])
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    write_readme(out, info)
    print(json.dumps({k: v for k, v in info.items() if k not in ("sft", "test_subset_hf_answers")}, indent=2))
    print(f"SFT: {result.steps} steps, {result.seconds:.1f} s, held-out greedy acc {result.heldout_accuracy:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
