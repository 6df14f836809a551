"""plot_run on synthetic metrics.jsonl files: a real PNG of the right size, and the error cases."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from grpo_train.plotting import DPI, FIG_HEIGHT_IN, FIG_WIDTH_IN, plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_rows(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def synthetic_rows(kl_key: str = "kl_penalty") -> list[dict]:
    rows = []
    for step in range(1, 21):
        rows.append(
            {"step": step, "split": "train", "reward_mean": step / 20, "accuracy": step / 25, kl_key: 1e-3 * step}
        )
        if step % 5 == 0:
            rows.append({"step": step, "split": "val", "accuracy": step / 22})
    rows.append({"step": 21, "split": "train", "reward_mean": float("nan")})  # a NaN leaves a gap, no crash
    return rows


@pytest.mark.parametrize("kl_key", ["kl_penalty", "kl"])
def test_png_written_with_the_right_dimensions(tmp_path, kl_key):
    write_rows(tmp_path, synthetic_rows(kl_key))
    out = plot_run(tmp_path)
    assert out == tmp_path / "plots" / "training.png"
    assert out.stat().st_size > 10_000  # three panels with lines, not an empty canvas
    assert png_size(out) == (int(FIG_WIDTH_IN * DPI), int(FIG_HEIGHT_IN * DPI))
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp file left


def test_panels_draw_the_logged_series(tmp_path):
    from matplotlib.image import imread

    write_rows(tmp_path, synthetic_rows())
    image = imread(plot_run(tmp_path))  # [H, W, 4] floats in 0..1
    assert image.shape == (int(FIG_HEIGHT_IN * DPI), int(FIG_WIDTH_IN * DPI), 4)
    third = image.shape[1] // 3
    for panel in range(3):  # every panel holds coloured (non-grey) line pixels
        rgb = image[:, panel * third : (panel + 1) * third, :3]
        colourful = (rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.3
        assert colourful.sum() > 100, f"panel {panel} has no curve"


def test_missing_series_still_plots(tmp_path):
    write_rows(tmp_path, [{"step": 1, "split": "train", "loss": 0.1}])
    assert png_size(plot_run(tmp_path)) == (int(FIG_WIDTH_IN * DPI), int(FIG_HEIGHT_IN * DPI))


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl does not exist"):
        plot_run(tmp_path)


def test_no_train_rows_is_a_value_error(tmp_path):
    write_rows(tmp_path, [{"step": 5, "split": "val", "accuracy": 0.5}])
    with pytest.raises(ValueError, match="no train rows"):
        plot_run(tmp_path)
    write_rows(tmp_path, [])
    with pytest.raises(ValueError, match="no train rows"):
        plot_run(tmp_path)


def test_bad_row_names_file_and_line(tmp_path):
    write_rows(tmp_path, [{"step": 1, "split": "train", "reward_mean": 0.1}])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write("{not json\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
        plot_run(tmp_path)
