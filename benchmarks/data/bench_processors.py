"""Prompts per second of the grpo-data pipeline on generated rows.

Measures, on N generated arithmetic rows (default 100,000):
- row generation alone (ArithmeticDataset),
- each built-in processor through a ProcessedDataset ("plain", "math" with a system prompt and a
  prompt template, "chat"),
- the StatefulDataLoader path (batches of 64, "plain") with 0 and 2 worker processes,
- loading the same rows from a JSONL file with ResponseDataset (read + validate + map).

The tokenizer is grpo_data.testing's character-level tokenizer (built locally, nothing
downloaded) unless --tokenizer names a local tokenizer folder. Writes a Markdown report with
the machine (CPU model, cores, load), versions and the git commit.

    uv run --no-sync python benchmarks/data/bench_processors.py --out benchmarks/results/data_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BATCH_SIZE = 64


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "packages/grpo-data", "benchmarks/data"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        return sha + (" (grpo-data has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def timed(fn) -> tuple[tuple[float, float], object]:
    """((wall seconds, this process's CPU seconds), result). CPU time is the steadier number on
    a shared machine; it leaves out worker processes."""
    start, cpu_start = time.perf_counter(), time.process_time()
    result = fn()
    return (time.perf_counter() - start, time.process_time() - cpu_start), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument(
        "--tokenizer", default=None, help="local tokenizer folder (default: the char-level test tokenizer)"
    )
    parser.add_argument("--out", default=None, help="write the Markdown report here")
    args = parser.parse_args()

    import torch
    import torchdata
    import transformers

    from grpo_data.arithmetic import ArithmeticDataset
    from grpo_data.dataloader import make_dataloader
    from grpo_data.datasets import ProcessedDataset
    from grpo_data.records import TaskSpec
    from grpo_data.response_dataset import ResponseDataset
    from grpo_data.testing import make_char_tokenizer

    if args.tokenizer:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
        tokenizer_name = args.tokenizer
    else:
        tokenizer = make_char_tokenizer()
        tokenizer_name = "grpo_data.testing char-level (WordLevel + Split) PreTrainedTokenizerFast"

    n = args.rows
    rows = ArithmeticDataset(size=n, seed=0)
    results: list[tuple[str, int, float, float]] = []

    def record(name: str, count: int, seconds: tuple[float, float]) -> None:
        wall, cpu = seconds
        results.append((name, count, wall, cpu))
        print(
            f"{name:<60} {count / wall:>10,.0f} /s wall {count / cpu:>10,.0f} /s CPU  ({count:,} in {wall:.2f} s)",
            flush=True,
        )

    seconds, _ = timed(lambda: [rows[i] for i in range(n)])
    record("row generation (ArithmeticDataset)", n, seconds)

    materialised = [rows[i] for i in range(n)]
    chat_rows = [{"messages": [{"role": "user", "content": r["problem"]}], "answer": r["answer"]} for r in materialised]
    cases = [
        ("processor 'plain' (demo: raw text, no chat template)", materialised, "plain", TaskSpec("arithmetic")),
        ("processor 'math' (chat template, system prompt, template)", materialised, "math",
         TaskSpec("math", system_prompt="You are a careful calculator.", prompt_template="Compute: {}")),
        ("processor 'chat' (messages in the row)", chat_rows, "chat", TaskSpec("chat")),
    ]  # fmt: skip
    for name, source, processor, spec in cases:
        ds = ProcessedDataset(source, processor, spec, tokenizer, 256)
        seconds, _ = timed(lambda: [ds[i] for i in range(n)])
        record(name, n, seconds)

    plain = ProcessedDataset(rows, "plain", TaskSpec("arithmetic"), tokenizer, 256)
    for workers in (0, 2):
        loader = make_dataloader(plain, BATCH_SIZE, shuffle=True, seed=0, num_workers=workers)
        seconds, count = timed(lambda: sum(len(b) for b in loader))
        record(f"StatefulDataLoader, 'plain', batch {BATCH_SIZE}, num_workers={workers}", count, seconds)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        path.write_text(
            "".join(json.dumps({"question": r["problem"], "answer": r["answer"]}) + "\n" for r in materialised)
        )
        seconds, ds = timed(lambda: ResponseDataset(path, input_key="question", output_key="answer"))
        record("ResponseDataset load from JSONL (read, validate, map)", len(ds), seconds)

    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?", "?", "?")
    lines = [
        "# grpo-data pipeline throughput (CPU)",
        "",
        f"Produced by `benchmarks/data/bench_processors.py --rows {n}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| machine | |",
        "|---|---|",
        f"| CPU | {cpu_model()} |",
        f"| cores (os.cpu_count) | {os.cpu_count()} |",
        f"| torch threads | {torch.get_num_threads()} |",
        f"| load average at the end (1/5/15 min) | {' / '.join(f'{x:.2f}' if isinstance(x, float) else x for x in load)} |",
        f"| Python | {platform.python_version()} |",
        f"| torch / torchdata / transformers | {torch.__version__} / {torchdata.__version__} / {transformers.__version__} |",
        f"| tokenizer | {tokenizer_name} |",
        f"| git commit | {git_commit()} |",
        "",
        "| stage | items | wall s | items/s (wall) | main-process CPU s | items/s (CPU) |",
        "|---|---:|---:|---:|---:|---:|",
        *[
            f"| {name} | {count:,} | {wall:.2f} | {count / wall:,.0f} | {cpu:.2f} | {count / cpu:,.0f} |"
            for name, count, wall, cpu in results
        ],
        "",
        "CPU time counts only the main process: with worker processes the tokenising happens in the",
        "workers, so that row's CPU rate is not a throughput. On a shared machine (see the load",
        "average) the wall rates vary from run to run; the CPU rates are the steadier figures.",
        "",
    ]
    report = "\n".join(lines)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report, encoding="utf-8")
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(report)


if __name__ == "__main__":
    main()
