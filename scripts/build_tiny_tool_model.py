"""Build `arith-tool-tiny`, the bundled tiny model of the calculator-tool demo (`grpo_tool_arith_tiny.yaml`).

The job: a ~1M-parameter Qwen2-style model (the size class of `arith-tiny`) with its own tokenizer
and a tiny chat template that renders `tools=` and tool messages, SFT-warmed on synthetic 4-digit
addition conversations. A tool trace calls the `calculator` tool in the Hermes format
(`<tool_call>{"name": "calculator", "arguments": {"expression": "1234+5678"}}</tool_call>`), reads
the tool's result and answers it; a direct trace answers at once, "in its head". Adding 4-digit
numbers is out of reach of a model this small (arith-tiny gets 61 % on 2 digits), so direct
answers are mostly wrong and the tool truly helps. The traces are deliberately biased: a trace
skips the tool with probability TOOL_SKIP_PROB, so the warmed model prefers to answer directly
(greedy: mostly wrong) while still sampling well-formed calls often, a preference that only the
reward can fix. The boundary: this script knows the row format of `grpo_data.arithmetic`
(`digits=4`, prompt "1234+5678=") and the calculator env's tool schema, but imports no grpo package.

Steps: tokenizer (+ chat template) -> model -> SFT on rendered traces -> save -> check the saved
tokenizer and template (the rendered traces equal a fresh render) -> greedy multi-turn evaluation
with a simulated calculator (HF) -> optional first-turn agreement with real vLLM -> build_info.json
and README.md.

Usage (reproducible: the same seed gives the same weights on the same machine):
    uv run --no-sync python scripts/build_tiny_model.py --recipe tool-arith \
        --out packages/grpo-train/src/grpo_train/assets/arith-tool-tiny
(or this file directly with the same arguments less `--recipe`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_tiny_model as base  # noqa: E402  (the same tokenizer pipeline and model family)

# --- Task: 4-digit addition, the rows of grpo_data.arithmetic with digits=4. ---
DIGITS = 4
NUM_HELDOUT = 128
HELDOUT_SEED = 20261125
TOOL_NAME = "calculator"  # the calculator env's tool (grpo_envs.calculator_env)
MAX_NEW_TOKENS = 24  # a call is 17 tokens with two 4-digit operands

# --- Tokenizer: digits and operators one token each; the chat markers and the fixed JSON frame of a
# call are added tokens, so a whole call is ~17 tokens and a conversation fits in MAX_POSITIONS. ---
PAD, EOS, UNK = base.PAD, base.EOS, base.UNK
TOOLS_OPEN, TOOLS_CLOSE, USER, ASSISTANT, RESULT, END = "<tools>", "</tools>", "<user>", "<asst>", "<result>", "<end>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FRAME_NAME, FRAME_ARGS, FRAME_CLOSE = '{"name": "', '", "arguments": {"expression": "', '"}}'
ADDED_TOKENS = [
    TOOLS_OPEN,
    TOOLS_CLOSE,
    USER,
    ASSISTANT,
    RESULT,
    END,
    CALL_OPEN,
    CALL_CLOSE,
    TOOL_NAME,
    FRAME_NAME,
    FRAME_ARGS,
    FRAME_CLOSE,
]
VOCAB_SIZE = 32
# Tools render as their names (the demo's one tool is one token); an assistant turn ends with <eos>,
# which is also the token generation stops on; tool results and user turns end with <end>.
CHAT_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function.name if t.function is defined else t.name }}"
    "{% endfor %}</tools>{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' %}<asst>{{ m.content }}<eos>"
    "{%- elif m.role == 'tool' %}<result>{{ m.content }}<end>"
    "{%- else %}<user>{{ m.content }}<end>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<asst>{% endif -%}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "integer expression",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]

# --- Model: arith-tiny's shape with room for a whole conversation ---
MAX_POSITIONS = 96

# --- SFT ---
SEED = 0
BATCH_SIZE = 64
LEARNING_RATE = 1e-3
WARMUP_STEPS = 50
SFT_STEPS = 600
GRAD_CLIP = 1.0
EVAL_EVERY = 100
# A trace answers without the tool with this probability (its label: the true sum). The warmed
# model then starts most answers directly (greedy: wrong on most 4-digit sums) and calls the tool
# in about 1 - TOOL_SKIP_PROB of its samples: GRPO's reward has both kinds in most groups.
TOOL_SKIP_PROB = 0.6


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def call_text(a: int, b: int) -> str:
    return f"{CALL_OPEN}{FRAME_NAME}{TOOL_NAME}{FRAME_ARGS}{a}+{b}{FRAME_CLOSE}{CALL_CLOSE}"


def problems(rng: random.Random, n: int) -> list[tuple[int, int]]:
    top = 10**DIGITS - 1
    return [(rng.randint(0, top), rng.randint(0, top)) for _ in range(n)]


def heldout_problems() -> list[tuple[int, int]]:
    return problems(random.Random(HELDOUT_SEED), NUM_HELDOUT)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def train_tokenizer():
    """Characters of the task text (digits, "+", "=") through arith-tiny's Qwen2 pipeline, then the
    markers and the call's JSON frame as added (non-special: they decode visibly) tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    alphabet = sorted(set("0123456789+="))
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[],
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(base.QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, EOS, UNK)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    reserved = VOCAB_SIZE - tok.get_vocab_size()
    tok.add_tokens([AddedToken(f"<reserved_{i}>", special=False, normalized=False) for i in range(reserved)])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def save_tokenizer(tok, out: Path) -> None:
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
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Traces: ids built the way the multi-turn rollout builds them (prompt render, generated ids,
# the tool message rendered by difference), checked against a fresh render of the conversation.
# ---------------------------------------------------------------------------------------------
def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def prompt_ids(tokenizer, a: int, b: int) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt_text(a, b)}],
            tools=TOOLS,
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
    )


def observation_ids(tokenizer, result: str) -> list[int]:
    return encode(tokenizer, f"{RESULT}{result}{END}{ASSISTANT}")


def trace(tokenizer, a: int, b: int, use_tool: bool) -> tuple[list[int], list[int]]:
    """(ids, labels) of one conversation; labels on the assistant's tokens (+ <eos>) only."""
    eos = tokenizer.eos_token_id
    ids = prompt_ids(tokenizer, a, b)
    labels = [-100] * len(ids)
    if use_tool:
        call = encode(tokenizer, call_text(a, b)) + [eos]
        obs = observation_ids(tokenizer, str(a + b))
        ids += call + obs
        labels += call + [-100] * len(obs)
    answer = encode(tokenizer, str(a + b)) + [eos]
    return ids + answer, labels + answer


def check_traces(tokenizer) -> None:
    """The carried ids of both trace kinds equal a fresh render of the whole conversation."""
    for a, b in ((0, 0), (1234, 8765), (9999, 9999), (7, 450)):
        msgs = [{"role": "user", "content": prompt_text(a, b)}]
        tool = [
            *msgs,
            {"role": "assistant", "content": call_text(a, b)},
            {"role": "tool", "name": TOOL_NAME, "content": str(a + b)},
            {"role": "assistant", "content": str(a + b)},
        ]
        for use_tool, conv in ((True, tool), (False, [*msgs, {"role": "assistant", "content": str(a + b)}])):
            fresh = list(tokenizer.apply_chat_template(conv, tools=TOOLS, tokenize=True, return_dict=False))
            ids, _ = trace(tokenizer, a, b, use_tool)
            if ids != fresh:
                raise RuntimeError(f"trace ids differ from a fresh render for {a}+{b} (tool={use_tool})")


def check_saved_tokenizer(out: Path, trained) -> None:
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(out)
    for text in [call_text(1234, 5678), f"{RESULT}6912{END}{ASSISTANT}6912", "0+9999=", *ADDED_TOKENS]:
        if encode(loaded, text) != encode(trained, text) or loaded.decode(encode(loaded, text)) != text:
            raise RuntimeError(f"{type(loaded).__name__} from {out} encodes or decodes {text!r} differently")
    if len(loaded) != VOCAB_SIZE or loaded.eos_token_id != trained.eos_token_id or loaded.bos_token_id is not None:
        raise RuntimeError(f"{type(loaded).__name__} from {out}: {len(loaded)} tokens or other special ids")
    check_traces(loaded)


# ---------------------------------------------------------------------------------------------
# Greedy evaluation: up to two assistant turns, the calculator simulated by Python's `+`.
# ---------------------------------------------------------------------------------------------
def parse_call(text: str) -> tuple[int, int] | None:
    """The operands of a well-formed call in the trained format, else None."""
    if not (text.startswith(CALL_OPEN) and text.endswith(CALL_CLOSE)):
        return None
    try:
        body = json.loads(text[len(CALL_OPEN) : -len(CALL_CLOSE)])
        a, b = body["arguments"]["expression"].split("+")
        return (int(a), int(b)) if body["name"] == TOOL_NAME else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def greedy_conversations(model, tokenizer, probs: list[tuple[int, int]]) -> list[dict]:
    import torch

    eos = tokenizer.eos_token_id
    records = []
    model.eval()
    with torch.no_grad():
        for a, b in probs:
            ids = prompt_ids(tokenizer, a, b)
            rec = {"problem": prompt_text(a, b), "called": False, "call_ok": False, "answer": ""}
            for turn in range(2):
                x = torch.tensor([ids])
                out = model.generate(
                    input_ids=x,
                    attention_mask=torch.ones_like(x),
                    do_sample=False,
                    max_new_tokens=MAX_NEW_TOKENS,
                    eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id,
                )
                new = out[0, len(ids) :].tolist()
                text = tokenizer.decode(new, skip_special_tokens=True)
                if turn == 0 and text.startswith(CALL_OPEN):
                    rec["called"] = True
                    operands = parse_call(text)
                    rec["call_ok"] = operands == (a, b)
                    result = str(sum(operands)) if operands else "error"
                    ids = ids + new + ([] if new and new[-1] == eos else [eos]) + observation_ids(tokenizer, result)
                    continue
                rec["answer"] = text
                break
            rec["correct"] = rec["answer"].strip() == str(a + b)
            records.append(rec)
    return records


def summary(records: list[dict]) -> dict:
    n = len(records)
    called = [r for r in records if r["called"]]
    return {
        "accuracy": sum(r["correct"] for r in records) / n,
        "tool_call_rate": len(called) / n,
        "call_ok_rate": sum(r["call_ok"] for r in called) / max(len(called), 1),
        "accuracy_with_call": sum(r["correct"] for r in called) / max(len(called), 1),
        "accuracy_without_call": sum(r["correct"] for r in records if not r["called"]) / max(n - len(called), 1),
    }


def forced_call_accuracy(model, tokenizer, probs: list[tuple[int, int]]) -> float:
    """Greedy continuation after a forced `<tool_call>`: fraction of exactly right calls."""
    import torch

    ok = 0
    call_open = tokenizer.convert_tokens_to_ids(CALL_OPEN)
    with torch.no_grad():
        for a, b in probs:
            ids = prompt_ids(tokenizer, a, b) + [call_open]
            x = torch.tensor([ids])
            out = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            ok += parse_call(tokenizer.decode(out[0, len(ids) - 1 :].tolist(), skip_special_tokens=True)) == (a, b)
    return ok / len(probs)


# ---------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------
def sft(model, tokenizer, heldout: list[tuple[int, int]], seed: int, log=print) -> dict:
    import torch

    rng = random.Random(seed)
    excluded = set(heldout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    model.train()
    history = []
    start = time.perf_counter()
    eval_seconds = 0.0
    for step in range(1, SFT_STEPS + 1):
        lr = LEARNING_RATE * min(1.0, step / WARMUP_STEPS) * 0.5 * (1 + math.cos(math.pi * step / SFT_STEPS))
        for group in optimizer.param_groups:
            group["lr"] = lr
        seqs = []
        while len(seqs) < BATCH_SIZE:
            (a, b), use_tool = problems(rng, 1)[0], rng.random() >= TOOL_SKIP_PROB
            if (a, b) not in excluded:
                seqs.append(trace(tokenizer, a, b, use_tool))
        loss = base.sft_step(model, optimizer, seqs, tokenizer.pad_token_id, GRAD_CLIP)
        if step % EVAL_EVERY == 0 or step == SFT_STEPS:
            t0 = time.perf_counter()
            s = summary(greedy_conversations(model, tokenizer, heldout[:32]))
            s["forced_call_ok"] = forced_call_accuracy(model, tokenizer, heldout[:32])
            model.train()
            eval_seconds += time.perf_counter() - t0
            elapsed = time.perf_counter() - start
            history.append({"step": step, "seconds": round(elapsed, 1), "loss": round(loss.item(), 4), **s})
            log(f"step {step:4d} {elapsed:6.1f}s lr {lr:.1e} loss {loss.item():.4f} first-32 {s}")
    elapsed = time.perf_counter() - start
    return {"steps": SFT_STEPS, "seconds": elapsed, "train_seconds": elapsed - eval_seconds, "history": history}


def vllm_first_turns(model_dir: Path, tokenizer, probs: list[tuple[int, int]]) -> list[str]:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=MAX_POSITIONS, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt_ids(tokenizer, a, b)) for a, b in probs], params, use_tqdm=False
    )
    return [o.outputs[0].text for o in outs]


def write_readme(out: Path, info: dict) -> None:
    s, e = info["sft"], info["heldout"]
    v = info.get("vllm")
    vllm_line = (
        f"- Real vLLM ({v['version']}, CPU, fp32, greedy) first turns on {v['num_problems']} held-out prompts: "
        f"{v['agreement']:.1%} identical to HF `generate`."
        if v
        else "- vLLM check: not run (`--skip-vllm`)."
    )
    text = f"""# arith-tool-tiny

The bundled tiny model of the calculator-tool demo (`grpo train -c grpo_tool_arith_tiny.yaml`): a
Qwen2-style causal LM SFT-warmed on 4-digit addition conversations that either call the
`calculator` tool or answer directly. Built by `scripts/build_tiny_tool_model.py` (also
`scripts/build_tiny_model.py --recipe tool-arith`); do not edit these files by hand.

## Task and format
- The user turn is a `grpo_data.arithmetic` row with `digits: 4` (`"1234+5678="`), rendered with
  `tools=` by the bundled chat template (`chat_template.jinja`):
  `<tools>calculator</tools><user>1234+5678=<end><asst>`.
- A tool turn: `<tool_call>{{"name": "calculator", "arguments": {{"expression": "1234+5678"}}}}</tool_call><eos>`
  (Hermes format, parsed by `grpo_envs.tool_calls`); the tool message renders as
  `<result>6912<end><asst>`; the final turn is `6912<eos>`.
- Tokenizer: digits, `+`, `=` one token each (arith-tiny's Qwen2 pipeline); the chat markers, the
  tool's name and the fixed JSON frame of a call are added, non-special tokens (they decode
  visibly); `<pad>` {info["pad_token_id"]}, `<eos>` {info["eos_token_id"]}, vocabulary filled with
  `<reserved_i>` to {VOCAB_SIZE}.

## Model
- Qwen2ForCausalLM, hidden {base.HIDDEN}, {base.LAYERS} layers, {base.HEADS} heads x head_dim {base.HEAD_DIM},
  MLP {base.INTERMEDIATE}, vocab {VOCAB_SIZE}, max positions {MAX_POSITIONS}, tied embeddings, fp32;
  {info["num_parameters"]:,} parameters, `model.safetensors` {info["safetensors_bytes"]:,} bytes
  (sha256 `{info["safetensors_sha256"][:16]}...`).

## How it was built
```
{info["command"]}
```
- Seed {info["seed"]}; torch {info["torch_version"]}, transformers {info["transformers_version"]},
  {info["torch_threads"]} torch thread(s), deterministic algorithms on.
- SFT: AdamW lr {LEARNING_RATE} ({WARMUP_STEPS} warm-up steps, cosine to 0), clipping {GRAD_CLIP}, batch
  {BATCH_SIZE}, {SFT_STEPS} steps, loss on assistant tokens + `<eos>`, fresh random 4-digit pairs
  (the held-out ones excluded). A trace skips the tool with probability {TOOL_SKIP_PROB} (label: the
  true sum, answered directly): the warmed model prefers answering directly, mostly wrong, and
  calls the tool in a minority of samples, a bias that the reward removes.
- {s["steps"]} steps, {s["seconds"]:.1f} s wall time ({s["train_seconds"]:.1f} s training) on a loaded 2-core CPU.

## Held-out greedy results ({NUM_HELDOUT} problems, `random.Random({HELDOUT_SEED})`, calculator simulated)
- accuracy **{e["accuracy"]:.1%}**; tool-call rate {e["tool_call_rate"]:.1%}
  (calls exactly right: {e["call_ok_rate"]:.1%}); accuracy when calling {e["accuracy_with_call"]:.1%},
  without {e["accuracy_without_call"]:.1%}.
- With the first token forced to `<tool_call>`, the greedy call is exactly right on
  {info["forced_call_ok"]:.1%} of them.
{vllm_line}

Full numbers (and the SFT curve) are in `build_info.json`.
"""
    (out / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    base.common_arguments(parser, SEED, "skip the real-vLLM first-turn check")
    args = parser.parse_args(argv)
    out: Path = args.out
    base.start_build(parser, args)

    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK, clean_up_tokenization_spaces=False
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    check_traces(tokenizer)
    base.MAX_POSITIONS, base.VOCAB_SIZE = MAX_POSITIONS, VOCAB_SIZE
    model = base.build_model(tokenizer)
    heldout = heldout_problems()
    print(f"model: {base.count_parameters(model):,} parameters")
    result = sft(model, tokenizer, heldout, args.seed)

    base.write_model(out, model)
    save_tokenizer(tok, out)
    check_saved_tokenizer(out, tokenizer)

    records = greedy_conversations(model, tokenizer, heldout)
    info = {
        "command": "uv run --no-sync python scripts/build_tiny_model.py --recipe tool-arith "
        + " ".join(a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--recipe", "tool-arith")),
        "seed": args.seed,
        "torch_threads": args.threads,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "num_parameters": base.count_parameters(model),
        "safetensors_bytes": (out / "model.safetensors").stat().st_size,
        "safetensors_sha256": base.sha256(out / "model.safetensors"),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "heldout_seed": HELDOUT_SEED,
        "num_heldout": NUM_HELDOUT,
        "digits": DIGITS,
        "tool_skip_prob": TOOL_SKIP_PROB,
        "sft": result,
        "heldout": summary(records),
        "forced_call_ok": forced_call_accuracy(model, tokenizer, heldout),
        "heldout_first_turns": [r["called"] for r in records],
    }
    if not args.skip_vllm:
        import vllm

        probs = heldout[:32]
        hf_first = []
        with torch.no_grad():
            for a, b in probs:
                x = torch.tensor([prompt_ids(tokenizer, a, b)])
                o = model.generate(
                    input_ids=x,
                    attention_mask=torch.ones_like(x),
                    do_sample=False,
                    max_new_tokens=MAX_NEW_TOKENS,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                )
                hf_first.append(tokenizer.decode(o[0, x.shape[1] :].tolist(), skip_special_tokens=True))
        vl = vllm_first_turns(out, tokenizer, probs)
        info["vllm"] = {
            "version": vllm.__version__,
            "num_problems": len(probs),
            "agreement": sum(x == y for x, y in zip(vl, hf_first)) / len(probs),
            "mismatches": [{"hf": h, "vllm": v} for h, v in zip(hf_first, vl) if h != v],
        }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    write_readme(out, info)
    print(json.dumps({k: v for k, v in info.items() if k not in ("sft", "heldout_first_turns")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
