"""Atomic checkpoints of a run: step_N folders that are either complete or absent.

`CheckpointManager.save` has the caller write a checkpoint's components (policy weights,
optimizer, dataloader, RNG state, ...) into a fresh hidden temporary folder, adds
`trainer_state.json` as the completeness marker and `manifest.json` (a content hash of every file,
see `state_io`), fsyncs everything and renames the folder to `step_N` in one step. On resume
`newest_intact` checks the hashes and falls back past damaged checkpoints. A crash at any
point leaves either the previous checkpoints untouched or the new one complete; hidden
leftovers (`.tmp-*`, `.old-*`, `.del-*`) are never mistaken for checkpoints and are cleaned up
by the next manager that finds their process gone.

This module decides where and how checkpoints land, never what is in them: it knows nothing
about models or optimizers. torch and numpy are imported only inside the functions that need
them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_train.errors import NoIntactCheckpoint  # re-exported: its old home
from grpo_train.state_io import MANIFEST_FILE, load_state, save_state, verify_manifest, write_manifest

log = logging.getLogger(__name__)

STEP_PREFIX = "step_"
TRAINER_STATE_FILE = "trainer_state.json"
RNG_STEM = "rng"
DAMAGED_SUFFIX = ".damaged"
"""A damaged step_N newer than the resume point is renamed step_N.damaged (kept for a person to
look at, out of pruning's and resume's way)."""
CONFIG_FILE = "config.json"
"""The resolved run config a checkpoint was written under (compared with the config on resume)."""
METRICS_FILE = "checkpoint_metrics.json"
"""Metrics of a checkpoint, kept beside it so pruning works the same after a restart."""

_STEP_DIR = re.compile(r"^step_(\d+)$")
# Hidden folders: .tmp- (being written), .old- (a replaced step_N set aside), .del- (pruned),
# named <kind>-step_<N>-<host>-<pid>-<random>. The host matters on a shared file system: a pid
# can only be checked for liveness on the machine that owns it.
_HIDDEN_DIR = re.compile(r"^\.(tmp|old|del)-step_(\d+)-(.+)-(\d+)-[0-9a-f]{8}$")


# ---------------------------------------------------------------------------- durability
def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (files first, then their folder)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"


def _unique_suffix() -> str:
    return f"{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _process_alive(host: str, pid: int) -> bool:
    """Whether the writer may still be running; unknowable (so assumed) for another host's pid."""
    if host != _host() or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


# ------------------------------------------------------------------------------ rng state
def save_rng_state(folder: Path, stem: str = RNG_STEM) -> None:
    """Save the python, numpy, torch CPU (and CUDA, if available) generator states as the state
    file pair `folder/<stem>.{json,safetensors}` (no pickle)."""
    import random

    import numpy as np
    import torch

    algorithm, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "algorithm": algorithm,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    save_state(state, folder, stem)


def load_rng_state(folder: Path, stem: str = RNG_STEM) -> None:
    """Restore the generator states written by `save_rng_state`."""
    import random

    import numpy as np
    import torch

    path = Path(folder) / stem
    state = load_state(folder, stem)
    missing = [key for key in ("python", "numpy", "torch") if key not in state]
    if missing:
        raise ValueError(f"{path} is not an RNG state file: missing {missing}")
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    nps = state["numpy"]
    np.random.set_state(
        (nps["algorithm"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"], nps["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if not torch.cuda.is_available():
            log.warning("%s holds CUDA generator states but CUDA is not available: not restored", path)
        elif len(state["cuda"]) != torch.cuda.device_count():
            log.warning(
                "%s holds %d CUDA generator states for %d visible devices: not restored",
                path,
                len(state["cuda"]),
                torch.cuda.device_count(),
            )
        else:
            torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------- manager
class CheckpointManager:
    """Saves step_N checkpoints atomically under `root`, finds the newest, prunes the rest.

    Pruning keeps the newest checkpoint always, plus the best `keep_top_k` by
    `metrics[metric_name]`; checkpoints without a finite value of that metric rank below those
    with one, newest first, so with no metric at all the newest `keep_top_k` are kept.
    `keep_top_k=None` keeps everything. Saves are serialised by a lock (thread-safe).
    `run_config` (JSON-able) is written into every checkpoint as config.json.
    """

    def __init__(
        self,
        root: Path,
        keep_top_k: int | None = None,
        metric_name: str | None = None,
        higher_is_better: bool = True,
        run_config: dict | None = None,
    ) -> None:
        if keep_top_k is not None and keep_top_k < 1:
            raise ValueError(f"keep_top_k must be >= 1 or None (keep all), got {keep_top_k}")
        self.root = Path(root)
        self.keep_top_k = keep_top_k
        self.metric_name = metric_name
        self.higher_is_better = higher_is_better
        self._config_text = _to_json(run_config, "run_config") if run_config is not None else None
        self._lock = threading.Lock()
        self._bad_metrics: set[Path] = set()
        self.root.mkdir(parents=True, exist_ok=True)
        self._recover()

    # -- queries ------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.root / f"{STEP_PREFIX}{step}"

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints (those with trainer_state.json), ascending."""
        steps = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir() and (entry / TRAINER_STATE_FILE).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest(self) -> Path | None:
        """The newest complete checkpoint; temporary and incomplete folders are ignored."""
        steps = self.all_steps()
        return self.step_dir(steps[-1]) if steps else None

    @staticmethod
    def load_trainer_state(path: Path) -> dict:
        """trainer_state.json of the checkpoint folder `path`."""
        file = Path(path) / TRAINER_STATE_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint: {TRAINER_STATE_FILE} is missing")
        try:
            return json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}: not valid JSON ({err})") from err

    @staticmethod
    def load_run_config(path: Path) -> dict | None:
        """The run config saved in checkpoint `path`, None if it has none."""
        file = Path(path) / CONFIG_FILE
        return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None

    def newest_intact(self, say: Callable[[str], None]) -> Path | None:
        """The newest checkpoint whose files match its manifest, None if there are no checkpoints.

        The damaged checkpoints newer than it are renamed step_N.damaged (so neither resume nor
        pruning picks them again) and reported through `say` in one line. Raises
        NoIntactCheckpoint, renaming nothing, when checkpoints exist but none is intact."""
        damaged: list[tuple[Path, str]] = []
        for step in reversed(self.all_steps()):
            folder = self.step_dir(step)
            problem = verify_manifest(folder)
            if problem is None:
                if damaged:
                    moved = "; ".join(
                        f"{bad.name} ({why}) -> {self._set_aside_damaged(bad).name}" for bad, why in damaged
                    )
                    say(
                        f"warning: resuming from {folder.name}: newer checkpoint(s) failed their "
                        f"{MANIFEST_FILE} check and were moved aside: {moved}"
                    )
                return folder
            damaged.append((folder, problem))
        if damaged:
            found = "; ".join(f"{bad.name} ({why})" for bad, why in damaged)
            raise NoIntactCheckpoint(
                f"no intact checkpoint under {self.root}: {found}; restore them or start a new run (--run-dir)"
            )
        return None

    def _set_aside_damaged(self, folder: Path) -> Path:
        target = folder.with_name(folder.name + DAMAGED_SUFFIX)
        if target.exists():
            target = folder.with_name(f"{folder.name}{DAMAGED_SUFFIX}-{uuid.uuid4().hex[:8]}")
        os.rename(folder, target)
        return target

    # -- save ---------------------------------------------------------------------------
    def save(
        self,
        step: int,
        write_fn: Callable[[Path], None],
        trainer_state: dict,
        metrics: dict[str, float] | None = None,
    ) -> Path:
        """Write checkpoint `step` atomically and prune; returns root/step_{step}.

        `write_fn(folder)` writes the components into a fresh temporary folder. If it raises,
        the folder is removed, the error propagates and the existing checkpoints are untouched.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        state_text = _to_json(trainer_state, "trainer_state")
        metrics_text = _to_json(_floats(metrics), "metrics") if metrics else None

        with self._lock:
            tmp = self.root / f".tmp-{STEP_PREFIX}{step}-{_unique_suffix()}"
            tmp.mkdir()
            try:
                write_fn(tmp)
                if metrics_text is not None:
                    (tmp / METRICS_FILE).write_text(metrics_text, encoding="utf-8")
                if self._config_text is not None:
                    (tmp / CONFIG_FILE).write_text(self._config_text, encoding="utf-8")
                (tmp / TRAINER_STATE_FILE).write_text(state_text, encoding="utf-8")  # the marker
                write_manifest(tmp)  # hashes of everything above, checked by `newest_intact`
                _fsync_tree(tmp)
                final = self._publish(tmp, step)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._prune()
        log.info("saved checkpoint %s", final)
        return final

    def _publish(self, tmp: Path, step: int) -> Path:
        """Rename `tmp` to step_{step}, setting an existing one aside first and deleting it after."""
        final = self.step_dir(step)
        aside = None
        if final.exists():
            aside = self.root / f".old-{STEP_PREFIX}{step}-{_unique_suffix()}"
            os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except BaseException:
            if aside is not None:
                os.rename(aside, final)
            raise
        _fsync_path(self.root)
        if aside is not None:
            shutil.rmtree(aside)
        return final

    # -- pruning ------------------------------------------------------------------------
    def _metric(self, step: int) -> float | None:
        """The checkpoint's ranking metric; an unreadable metrics file ranks as having none
        (warned once per file) so that one damaged old checkpoint cannot stop later saves."""
        if self.metric_name is None:
            return None
        file = self.step_dir(step) / METRICS_FILE
        if not file.is_file():
            return None
        try:
            metrics = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(metrics, dict):
                raise ValueError("not a JSON object")
            value = metrics.get(self.metric_name)
        except (OSError, UnicodeDecodeError, ValueError) as err:
            if file not in self._bad_metrics:
                self._bad_metrics.add(file)
                log.warning(
                    "%s is unreadable (%s): pruning ranks this checkpoint as having no %s", file, err, self.metric_name
                )
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)

    def _prune(self) -> None:
        if self.keep_top_k is None:
            return
        steps = self.all_steps()
        if not steps:
            return

        def rank(step: int) -> tuple[bool, float, int]:
            value = self._metric(step)
            if value is None:
                return (False, 0.0, step)
            return (True, value if self.higher_is_better else -value, step)

        keep = set(sorted(steps, key=rank, reverse=True)[: self.keep_top_k]) | {steps[-1]}
        for step in steps:
            if step not in keep:
                self._delete(step)

    def _delete(self, step: int) -> None:
        # Rename first: a crash mid-rmtree must not leave a step_N that looks complete.
        doomed = self.root / f".del-{STEP_PREFIX}{step}-{_unique_suffix()}"
        os.rename(self.step_dir(step), doomed)
        shutil.rmtree(doomed)
        log.info("pruned checkpoint %s", self.step_dir(step))

    # -- crash recovery -----------------------------------------------------------------
    def _recover(self) -> None:
        """Clean up hidden folders of processes that are gone; restore a step_N set aside mid-replace."""
        for entry in sorted(self.root.iterdir()):
            match = _HIDDEN_DIR.match(entry.name)
            if not match or not entry.is_dir():
                continue
            kind, step, host, pid = match.group(1), int(match.group(2)), match.group(3), int(match.group(4))
            if _process_alive(host, pid):
                continue  # a save that may still be in progress
            final = self.step_dir(step)
            if kind == "old" and not final.exists() and (entry / TRAINER_STATE_FILE).is_file():
                os.rename(entry, final)
                log.warning("restored %s, set aside by a replace that crashed", final)
            else:
                shutil.rmtree(entry, ignore_errors=True)
                log.info("removed %s, left by a crashed process", entry)


def _to_json(obj: Any, what: str) -> str:
    try:
        return json.dumps(obj, indent=2, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{what} must be JSON-serialisable: {err}") from err


def _floats(metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError) as err:
            raise TypeError(f"checkpoint metric {key!r} must be a number, got {value!r}") from err
    return out
