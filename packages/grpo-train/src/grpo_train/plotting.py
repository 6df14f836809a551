"""The end-of-run plot: reward, accuracy and KL over steps, read from a run's metrics.jsonl.

It reads only the JSONL file that `grpo_train.loggers.MetricsLogger` writes, so it works on a
finished, crashed or copied run folder alike. matplotlib is imported lazily and drawn through
the Agg canvas directly (no pyplot, no global backend switch), so plotting is safe from any
thread and never opens a window.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from grpo_train.loggers import METRICS_FILE

PLOT_FILE = Path("plots") / "training.png"
FIG_WIDTH_IN = 15.0
FIG_HEIGHT_IN = 4.0
DPI = 100
KL_KEYS = ("kl_penalty", "kl")
"""Train keys tried in order for the KL panel."""

Series = dict[int, float]


def read_metrics(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl file; a ValueError names the file and line of a bad row."""
    if not path.is_file():
        raise ValueError(f"no metrics to plot: {path} does not exist")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({err.msg})") from err
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError(
                    f"{path}:{lineno}: expected an object with an integer 'step', got {line.strip()[:80]!r}"
                )
            rows.append(row)
    return rows


def _series(rows: list[dict], split: str, key: str) -> Series:
    """step -> value of `key` in `split` rows; a later row of the same step wins."""
    out: Series = {}
    for row in rows:
        if row.get("split", "train") == split and isinstance(row.get(key), (int, float)):
            out[row["step"]] = float(row[key])
    return out


def _draw(ax, title: str, curves: list[tuple[str, Series, str]]) -> None:
    # matplotlib: only when a plot is drawn; `import grpo_train.plotting` stays light
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    drawn = False
    for label, series, marker in curves:
        if not series:
            continue
        steps = sorted(series)
        # NaN values stay NaN: matplotlib leaves a gap there instead of a misleading line.
        ax.plot(steps, [series[s] for s in steps], marker=marker, markersize=3 if marker else 0, label=label)
        drawn = True
    if drawn:
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_run(run_dir: Path) -> Path:
    """Write <run_dir>/plots/training.png (reward, accuracy, KL over steps) and return its path."""
    # matplotlib: only when a plot is drawn; `import grpo_train.plotting` stays light
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    rows = read_metrics(metrics_path)
    if not any(row.get("split", "train") == "train" for row in rows):
        raise ValueError(f"no train rows to plot in {metrics_path}")

    kl_key = next((k for k in KL_KEYS if _series(rows, "train", k)), KL_KEYS[0])
    fig = Figure(figsize=(FIG_WIDTH_IN, FIG_HEIGHT_IN), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    reward_ax, accuracy_ax, kl_ax = fig.subplots(1, 3)
    _draw(reward_ax, "reward", [("train reward_mean", _series(rows, "train", "reward_mean"), "")])
    _draw(
        accuracy_ax,
        "accuracy",
        [("train", _series(rows, "train", "accuracy"), ""), ("val", _series(rows, "val", "accuracy"), "o")],
    )
    _draw(kl_ax, "KL", [(f"train {kl_key}", _series(rows, "train", kl_key), "")])
    fig.suptitle(run_dir.name)

    out = run_dir / PLOT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=DPI)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
