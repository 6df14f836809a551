"""MetricsLogger against the real back ends: JSONL, wandb offline, TensorBoard event files, console."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from grpo_train.config.schema import LoggerConfig
from grpo_train.loggers import MetricsLogger, format_train_line, format_val_line

TRAIN = {
    "reward_mean": 0.62,
    "accuracy": 0.625,
    "loss": -0.013,
    "kl_penalty": 0.0021,
    "grad_norm": 0.41,
    "lr": 1e-4,
    "timing/step_s": 0.93,
    "tokens_per_s": 2140.0,
}


def make_cfg(**overrides) -> LoggerConfig:
    base = {"console_enabled": False, "wandb_enabled": False, "tensorboard_enabled": False}
    return LoggerConfig(**{**base, **overrides})


def make_logger(run_dir: Path, start_step: int = 0, total_steps: int = 60, **overrides) -> MetricsLogger:
    return MetricsLogger(make_cfg(**overrides), run_dir, "test-run", {"seed": 7}, total_steps, start_step)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------------- jsonl
def test_jsonl_rows_for_train_and_val(tmp_path):
    with make_logger(tmp_path) as logger:
        logger.log(TRAIN, step=1)
        logger.log({"accuracy": 0.71, "pass@1": 0.71}, step=1, split="val")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows == [
        {"step": 1, "split": "train", **TRAIN},
        {"step": 1, "split": "val", "accuracy": 0.71, "pass@1": 0.71},
    ]


def test_numpy_scalars_are_written_as_plain_numbers(tmp_path):
    np = pytest.importorskip("numpy")
    with make_logger(tmp_path) as logger:
        logger.log({"a": np.float32(0.5), "b": np.int64(3), "c": True}, step=2)
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 2, "split": "train", "a": 0.5, "b": 3, "c": 1}]


def test_resume_drops_replayed_steps(tmp_path):
    with make_logger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log({"reward_mean": step / 10}, step=step)
        logger.log({"accuracy": 0.5}, step=3, split="val")
        logger.log_samples([{"prompt": "p", "response": "r", "reward": 1.0}], step=5)
    with make_logger(tmp_path, start_step=3) as logger:
        logger.log({"reward_mean": 0.44}, step=4)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["split"]) for r in rows] == [
        (1, "train"),
        (2, "train"),
        (3, "train"),
        (3, "val"),
        (4, "train"),
    ]
    assert rows[-1]["reward_mean"] == 0.44
    assert (tmp_path / "samples.jsonl").read_text() == ""


def test_a_restart_before_the_first_checkpoint_replaces_the_logs(tmp_path):
    """The run died at step 3 without a checkpoint: it starts again from step 0 in the same
    folder, and the logs must read 1, 2 (not 1, 2, 3, 1, 2)."""
    with make_logger(tmp_path, wandb_enabled=True) as logger:
        logger.log({"accuracy": 0.1}, step=0, split="val")
        for step in (1, 2, 3):
            logger.log({"reward_mean": step / 10}, step=step)
        logger.log_samples([{"prompt": "p", "response": "r", "reward": 1.0}], step=0)
    first_id = (tmp_path / "wandb_id.txt").read_text()
    with make_logger(tmp_path, wandb_enabled=True) as logger:
        for step in (1, 2):
            logger.log({"reward_mean": step}, step=step)
    assert [(r["step"], r["reward_mean"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 1), (2, 2)]
    assert (tmp_path / "samples.jsonl").read_text() == ""
    assert (tmp_path / "wandb_id.txt").read_text() != first_id  # a new wandb run: it cannot un-log steps


def test_a_restart_from_step_0_purges_tensorboard(tmp_path):
    with make_logger(tmp_path, tensorboard_enabled=True) as logger:
        for step in (1, 2, 3):
            logger.log({"reward_mean": float(step)}, step=step)
    with make_logger(tmp_path, tensorboard_enabled=True) as logger:
        logger.log({"reward_mean": 10.0}, step=1)
    assert read_tensorboard(tmp_path)["train/reward_mean"] == [(1, 10.0)]


def test_resume_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train", "x": 1}\n{"step": 2, "spl')
    make_logger(tmp_path, start_step=2).close()
    assert read_jsonl(path) == [{"step": 1, "split": "train", "x": 1}]


def test_nan_and_inf_are_logged_without_crash(tmp_path, capsys):
    with make_logger(tmp_path, console_enabled=True, tensorboard_enabled=True) as logger:
        logger.log({"loss": float("nan"), "kl_penalty": float("inf"), "tokens_per_s": float("nan")}, step=1)
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert math.isnan(row["loss"]) and row["kl_penalty"] == math.inf
    assert "loss nan kl inf" in capsys.readouterr().out


def test_bad_inputs_raise_clear_errors(tmp_path):
    logger = make_logger(tmp_path)
    with pytest.raises(ValueError, match="split"):
        logger.log({"x": 1.0}, step=1, split="test")
    with pytest.raises(TypeError, match="'x' must be a number"):
        logger.log({"x": "high"}, step=1)
    with pytest.raises(ValueError, match="reserved"):
        logger.log({"step": 1.0}, step=1)
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        logger.log({"x": 1.0}, step=2)


# ------------------------------------------------------------------------------- console
def test_console_line_format():
    assert format_train_line(TRAIN, 12, 60) == (
        "step 12/60 | reward 0.62 acc 0.62 | loss -0.013 kl 0.0021 | gn 0.41 lr 1.0e-04 | 0.93 s/step 2.1k tok/s"
    )
    assert format_train_line({"loss": 0.5}, 3, 100) == "step   3/100 | loss 0.5"
    # the first step of a process also carries its start-up time (process start -> first step)
    assert (
        format_train_line({"loss": 0.5, "timing/startup_s": 12.34}, 1, 100)
        == "step   1/100 | loss 0.5 | start-up 12.3 s"
    )
    assert format_val_line({"pass@8": 0.9, "accuracy": 0.71, "pass@1": 0.71}, 10) == (
        "val step 10 | accuracy 0.71 pass@1 0.71 pass@8 0.90"
    )


def test_console_prints_one_line_per_step_and_samples(tmp_path, capsys):
    with make_logger(
        tmp_path, console_enabled=True, num_val_samples_to_print=1, total_steps=60, start_step=11
    ) as logger:
        logger.log(TRAIN, step=12)
        logger.log({"accuracy": 0.71, "pass@1": 0.71}, step=12, split="val")
        logger.log_samples(
            [{"prompt": "2+3=", "response": "5", "reward": 1.0}, {"prompt": "4+4=", "response": "9", "reward": 0.0}],
            step=12,
        )
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert (
        "step 12/60 | reward 0.62 acc 0.62 | loss -0.013 kl 0.0021 | gn 0.41 lr 1.0e-04 | 0.93 s/step 2.1k tok/s"
        in lines
    )
    assert "val step 12 | accuracy 0.71 pass@1 0.71" in lines
    assert "prompt:   2+3=" in lines and "response: 5" in lines
    assert "4+4=" not in captured.out  # only num_val_samples_to_print are shown ...
    samples = read_jsonl(tmp_path / "samples.jsonl")  # ... but every sample is kept
    assert [s["prompt"] for s in samples] == ["2+3=", "4+4="] and all(s["step"] == 12 for s in samples)
    assert "12/60" in captured.err  # the tqdm bar, resumed at start_step and advanced once


# --------------------------------------------------------------------------------- wandb
WANDB_FLUSH_TIMEOUT_S = 30.0


def read_wandb_records(path: Path):
    """Records of a .wandb file (LevelDB-log framing: 7-byte file header, 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2

    block, chunk_header = 32 * 1024, 7
    data = path.read_bytes()
    if len(data) < 7:  # not even the file header written yet
        return
    assert data[:4] == b":W&B"
    pos, buffer = 7, b""
    while pos + chunk_header <= len(data):
        if block - pos % block < chunk_header:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + chunk_header])
        pos += chunk_header
        if (kind == 0 and length == 0) or pos + length > len(data):  # end, or a chunk still being written
            break
        chunk = data[pos : pos + length]
        pos += length
        buffer = chunk if kind in (1, 2) else buffer + chunk  # FULL/FIRST start, MIDDLE/LAST continue
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buffer)
            yield record


def test_wandb_offline_run_folder_has_the_logged_values(tmp_path):
    with make_logger(tmp_path, wandb_enabled=True) as logger:
        logger.log(TRAIN, step=1)
        logger.log({"reward_mean": float("nan")}, step=2)
        logger.log({"accuracy": 0.71}, step=2, split="val")
    run_id = (tmp_path / "wandb_id.txt").read_text().strip()
    (run_file,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    # run.finish() returns before wandb-core's writer has flushed the file: wait for the exit record.
    deadline = time.monotonic() + WANDB_FLUSH_TIMEOUT_S
    while not any(r.WhichOneof("record_type") == "exit" for r in read_wandb_records(run_file)):
        assert time.monotonic() < deadline, f"{run_file} has no exit record after {WANDB_FLUSH_TIMEOUT_S} s"
        time.sleep(0.1)

    history, run_record = [], None
    for record in read_wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            )
        elif kind == "run":
            run_record = record.run
    assert run_record.display_name == "test-run" and run_record.project == "grpo"
    assert {u.key: json.loads(u.value_json) for u in run_record.config.update}["seed"] == 7
    by_step = {row["_step"]: row for row in history}
    assert {k: by_step[1][f"train/{k}"] for k in TRAIN} == TRAIN
    assert math.isnan(by_step[2]["train/reward_mean"]) and by_step[2]["val/accuracy"] == 0.71


# --------------------------------------------------------------------------- tensorboard
def read_tensorboard(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_read_back(tmp_path):
    with make_logger(tmp_path, tensorboard_enabled=True) as logger:
        logger.log(TRAIN, step=1)
        logger.log({"reward_mean": 0.7}, step=2)
        logger.log({"accuracy": 0.71}, step=2, split="val")
    scalars = read_tensorboard(tmp_path)
    assert set(scalars) == {f"train/{k}" for k in TRAIN} | {"val/accuracy"}
    for key, value in TRAIN.items():
        assert scalars[f"train/{key}"][0] == (1, pytest.approx(value, rel=1e-6))
    assert scalars["train/reward_mean"][1] == (2, pytest.approx(0.7))
    assert scalars["val/accuracy"] == [(2, pytest.approx(0.71))]


def test_tensorboard_resume_purges_replayed_steps(tmp_path):
    with make_logger(tmp_path, tensorboard_enabled=True) as logger:
        for step in range(1, 6):
            logger.log({"reward_mean": float(step)}, step=step)
    with make_logger(tmp_path, start_step=3, tensorboard_enabled=True) as logger:
        logger.log({"reward_mean": 40.0}, step=4)
    assert read_tensorboard(tmp_path)["train/reward_mean"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_tensorboard_config_must_not_move_the_event_files(tmp_path):
    with pytest.raises(ValueError, match="log_dir"):
        make_logger(tmp_path, tensorboard_enabled=True, tensorboard={"log_dir": "elsewhere"})
