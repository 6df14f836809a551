"""CheckpointManager atomicity, crash leftovers, replace and pruning; RNG and torch.save helpers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_train.checkpoint import (
    CheckpointManager,
    _host,
    load_rng_state,
    save_rng_state,
)
from grpo_train.state_io import load_state, save_state


def write_text(name: str, text: str):
    def write_fn(folder: Path) -> None:
        (folder / name).write_text(text)

    return write_fn


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ------------------------------------------------------------------------- save / load
def test_save_writes_components_and_trainer_state(tmp_path):
    torch = pytest.importorskip("torch")
    manager = CheckpointManager(tmp_path / "ckpt")
    weights = {"w": torch.arange(6.0).reshape(2, 3)}

    def write_fn(folder: Path) -> None:
        save_state(weights, folder, "policy")

    path = manager.save(3, write_fn, {"step": 3, "epoch": 0, "weight_version": 3}, metrics={"val_accuracy": 0.5})
    assert path == tmp_path / "ckpt" / "step_3" and manager.latest() == path
    assert CheckpointManager.load_trainer_state(path) == {"step": 3, "epoch": 0, "weight_version": 3}
    assert torch.equal(load_state(path, "policy")["w"], weights["w"])
    assert manager.all_steps() == [3] and hidden(tmp_path / "ckpt") == []


def test_failing_write_fn_leaves_no_trace(tmp_path):
    manager = CheckpointManager(tmp_path)
    first = manager.save(1, write_text("a.txt", "one"), {"step": 1})

    def broken(folder: Path) -> None:
        (folder / "half.bin").write_bytes(b"\0" * 100)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        manager.save(2, broken, {"step": 2})
    assert not (tmp_path / "step_2").exists() and hidden(tmp_path) == []
    assert manager.latest() == first and manager.all_steps() == [1]
    assert (first / "a.txt").read_text() == "one"


def test_bad_arguments_fail_before_writing(tmp_path):
    manager = CheckpointManager(tmp_path)
    calls = []
    with pytest.raises(TypeError, match="trainer_state must be JSON-serialisable"):
        manager.save(1, calls.append, {"step": 1, "model": object()})
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        manager.save(-1, calls.append, {"step": -1})
    with pytest.raises(TypeError, match="'acc' must be a number"):
        manager.save(1, calls.append, {"step": 1}, metrics={"acc": "high"})
    with pytest.raises(ValueError, match="keep_top_k"):
        CheckpointManager(tmp_path, keep_top_k=0)
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_load_trainer_state_of_an_incomplete_folder_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        CheckpointManager.load_trainer_state(tmp_path)


# ------------------------------------------------------------------------------ crashes
def test_crash_leftovers_are_ignored_by_latest(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(5, write_text("a.txt", "five"), {"step": 5})
    # A temp folder of a newer step that even has its marker, and a step folder without one.
    leftover = tmp_path / f".tmp-step_9-{_host()}-{os.getpid()}-0123abcd"
    leftover.mkdir()
    (leftover / "trainer_state.json").write_text('{"step": 9}')
    (tmp_path / "step_8").mkdir()
    (tmp_path / "step_8" / "policy.pt").write_bytes(b"partial")
    assert manager.latest() == tmp_path / "step_5" and manager.all_steps() == [5]


def test_real_crash_mid_save_is_ignored_and_cleaned_up(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, write_text("a.txt", "one"), {"step": 1})
    # A separate process dies (no cleanup, no finally) in the middle of write_fn.
    script = textwrap.dedent(
        f"""
        import os
        from grpo_train.checkpoint import CheckpointManager

        def write_fn(folder):
            (folder / "policy.pt").write_bytes(b"half a tensor")
            os._exit(1)

        CheckpointManager({str(tmp_path)!r}).save(2, write_fn, {{"step": 2}})
        """
    )
    assert subprocess.run([sys.executable, "-c", script]).returncode == 1
    (leftover,) = hidden(tmp_path)
    assert leftover.startswith(".tmp-step_2-")
    assert manager.latest() == tmp_path / "step_1" and manager.all_steps() == [1]
    CheckpointManager(tmp_path)  # the next run removes what the dead process left
    assert hidden(tmp_path) == [] and CheckpointManager(tmp_path).all_steps() == [1]


def test_a_replace_interrupted_between_renames_is_restored(tmp_path):
    aside = tmp_path / f".old-step_4-{_host()}-{dead_pid()}-0123abcd"
    aside.mkdir()
    (aside / "trainer_state.json").write_text('{"step": 4}')
    manager = CheckpointManager(tmp_path)
    assert manager.latest() == tmp_path / "step_4" and hidden(tmp_path) == []


def test_leftovers_of_another_host_are_left_alone(tmp_path):
    # On a shared file system the pid of another machine's writer cannot be checked here.
    other = tmp_path / f".tmp-step_7-other-node-01-{dead_pid()}-0123abcd"
    other.mkdir()
    manager = CheckpointManager(tmp_path)
    assert other.exists() and manager.latest() is None


# ------------------------------------------------------------------------------ replace
def test_saving_an_existing_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(4, write_text("old.txt", "old"), {"step": 4, "weight_version": 1})
    path = manager.save(4, write_text("new.txt", "new"), {"step": 4, "weight_version": 2})
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "new.txt", "trainer_state.json"]
    assert CheckpointManager.load_trainer_state(path)["weight_version"] == 2
    assert manager.all_steps() == [4] and hidden(tmp_path) == []


# ------------------------------------------------------------------------------ pruning
def test_pruning_without_metric_keeps_the_newest_k(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=2)
    for step in range(1, 6):
        manager.save(step, write_text("x", str(step)), {"step": step})
    assert manager.all_steps() == [4, 5] and hidden(tmp_path) == []


def test_keep_top_k_none_keeps_everything(tmp_path):
    manager = CheckpointManager(tmp_path, metric_name="val_accuracy")
    for step in range(1, 5):
        manager.save(step, write_text("x", ""), {"step": step}, {"val_accuracy": 0.1 * step})
    assert manager.all_steps() == [1, 2, 3, 4]


ACCURACIES = {1: 0.1, 2: 0.9, 3: 0.3, 4: 0.8, 5: 0.2, 6: 0.05}


@pytest.mark.parametrize(("higher_is_better", "expected"), [(True, [2, 4, 6]), (False, [1, 6])])
def test_pruning_with_metric_keeps_newest_plus_best_k(tmp_path, higher_is_better, expected):
    manager = CheckpointManager(tmp_path, keep_top_k=2, metric_name="val_accuracy", higher_is_better=higher_is_better)
    for step, accuracy in ACCURACIES.items():
        manager.save(step, write_text("x", ""), {"step": step}, {"val_accuracy": accuracy, "loss": 1.0})
    assert manager.all_steps() == expected
    assert hidden(tmp_path) == []


def test_pruning_ranks_checkpoints_without_the_metric_last(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=2, metric_name="val_accuracy")
    manager.save(1, write_text("x", ""), {"step": 1}, {"val_accuracy": 0.4})
    manager.save(2, write_text("x", ""), {"step": 2}, {"val_accuracy": float("nan")})
    manager.save(3, write_text("x", ""), {"step": 3})
    manager.save(4, write_text("x", ""), {"step": 4}, {"val_accuracy": 0.2})
    manager.save(5, write_text("x", ""), {"step": 5})
    # best two by metric: 1 (0.4), 4 (0.2); plus the newest, 5. A restarted manager agrees.
    assert manager.all_steps() == [1, 4, 5]
    restarted = CheckpointManager(tmp_path, keep_top_k=1, metric_name="val_accuracy")
    restarted.save(6, write_text("x", ""), {"step": 6})
    assert restarted.all_steps() == [1, 6]
    assert json.loads((tmp_path / "step_1" / "checkpoint_metrics.json").read_text()) == {"val_accuracy": 0.4}


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", "\udcff", b"\xff\xfe"])
def test_an_unreadable_metrics_file_of_an_old_checkpoint_does_not_stop_later_saves(tmp_path, caplog, damage):
    manager = CheckpointManager(tmp_path, keep_top_k=2, metric_name="val_accuracy")
    for step, accuracy in ((1, 0.9), (2, 0.1), (3, 0.5)):
        manager.save(step, write_text("x", ""), {"step": step}, {"val_accuracy": accuracy})
    assert manager.all_steps() == [1, 3]
    metrics_file = tmp_path / "step_1" / "checkpoint_metrics.json"
    if isinstance(damage, bytes):
        metrics_file.write_bytes(damage)
    else:
        metrics_file.write_text(damage, encoding="utf-8", errors="surrogateescape")
    for step in (4, 5):
        manager.save(step, write_text("x", ""), {"step": step}, {"val_accuracy": 0.2})
    # step_1 now ranks as having no metric: best two are 3 (0.5) and 5 (0.2, newer of the 0.2s), plus the newest.
    assert manager.all_steps() == [3, 5]
    warnings = [r.getMessage() for r in caplog.records if "checkpoint_metrics.json is unreadable" in r.getMessage()]
    assert len(warnings) == 1 and "step_1" in warnings[0]


# ------------------------------------------------------------------------------ helpers
def draws():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        np.random.randn(3).tolist(),  # exercises the cached Gaussian
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (4,)).tolist(),
    )


def test_rng_round_trip_gives_identical_draws(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leave a cached Gaussian in numpy's state
    folder = tmp_path / "rng"
    save_rng_state(folder)
    expected = draws()
    draws()  # move every generator on
    load_rng_state(folder)
    assert draws() == expected
    assert set(load_state(folder, "rng")) >= {"python", "numpy", "torch"}


def test_load_rng_state_rejects_another_file(tmp_path):
    pytest.importorskip("torch")
    save_state({"weights": 1}, tmp_path, "rng")
    with pytest.raises(ValueError, match="not an RNG state file"):
        load_rng_state(tmp_path)


def test_eval_checkpoint_path_is_policy_model_and_refuses_missing_or_damaged(tmp_path):
    """`grpo eval --checkpoint` (run.checkpoint_model_path): serves <checkpoint>/policy/model of an intact
    checkpoint; one without that folder, or whose files no longer match the manifest, is refused by name."""
    from grpo_train.errors import StartupError
    from grpo_train.run import checkpoint_model_path

    def write(folder: Path) -> None:
        (folder / "policy" / "model").mkdir(parents=True)
        (folder / "policy" / "model" / "config.json").write_text("{}")

    manager = CheckpointManager(tmp_path / "ckpt")
    good = manager.save(1, write, {"step": 1})
    assert checkpoint_model_path(str(good)) == str(good / "policy" / "model")
    bare = manager.save(2, lambda folder: None, {"step": 2})
    with pytest.raises(StartupError, match="has no policy/model folder"):
        checkpoint_model_path(str(bare))
    (good / "policy" / "model" / "config.json").write_text('{"changed": 1}')
    with pytest.raises(StartupError, match="is damaged"):
        checkpoint_model_path(str(good))
