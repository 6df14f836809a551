"""Start-up cost of the data pipeline: building the demo's datasets, then drawing rows.

Measures, with the demo config (grpo_arith_tiny: 100,000 arithmetic training rows, 256
validation rows, 'plain' processor) and the bundled model's tokenizer:
- build: `grpo_data.datasets.build_data` on the config's data section (what `grpo train` does
  before the first step);
- first 640 draws (the demo's 40 steps x 16 prompts) and one full epoch of draws;
- a 10 MB prompt drawn 3 times (a JSONL file of 4 rows, one of them 10 MB, 'plain' processor,
  max_input_seq_length 16).

Prints a Markdown table with wall and CPU seconds, the load average and the git commit.

    uv run --no-sync python benchmarks/data/bench_build.py
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def timed(fn):
    start, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - start, time.process_time() - cpu, result


def main() -> None:
    from transformers import AutoTokenizer

    from grpo_cli.configs import CONFIG_DIR
    from grpo_data.config import DataConfig, DatasetEntry
    from grpo_data.datasets import build_data
    from grpo_train.assets import builtin_model_path
    from grpo_train.config import load_config

    cfg, _ = load_config("grpo_arith_tiny.yaml", [], [CONFIG_DIR])
    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path("arith-tiny"))
    rows = []
    wall, cpu, splits = timed(lambda: build_data(cfg.data.data_config(), tokenizer))
    rows.append(("build_data (demo: 100,000 + 256 rows)", wall, cpu))
    train = splits.train[0]
    wall, cpu, _ = timed(lambda: [train[i] for i in range(640)])
    rows.append(("640 draws (the demo's 40 steps x 16 prompts)", wall, cpu))
    wall, cpu, _ = timed(lambda: [train[i] for i in range(len(train))])
    rows.append((f"one epoch of draws ({len(train):,})", wall, cpu))

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "huge.jsonl"
        big = "1+1=" * (10 * 2**20 // 4)
        with open(path, "w") as f:
            for text in ("1+2=", big, "3+4=", "5+6="):
                f.write(json.dumps({"problem": text, "answer": "3"}) + "\n")
        entry = DatasetEntry(
            dataset_name="ResponseDataset",
            data_path=str(path),
            input_key="problem",
            output_key="answer",
            processor="plain",
            max_input_seq_length=16,
        )
        wall, cpu, huge = timed(lambda: build_data(DataConfig(train=entry), tokenizer).train[0])
        rows.append(("build a 4-row JSONL with one 10 MB prompt", wall, cpu))
        wall, cpu, _ = timed(lambda: [huge[1] for _ in range(3)])
        rows.append(("draw the 10 MB prompt 3 times", wall, cpu))

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(f"commit {commit}, load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} cores\n")
    print("| stage | wall s | CPU s |\n|---|---:|---:|")
    for name, wall, cpu in rows:
        print(f"| {name} | {wall:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
