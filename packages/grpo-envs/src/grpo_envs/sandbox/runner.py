"""Parent side of the sandbox: start the child, feed it, watch it, kill it, classify the result."""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_CHILD_SCRIPT = Path(__file__).with_name("child.py")
_RESULT_CAP = 2 << 20
_STDERR_TAIL = 4096
_READ_CHUNK = 1 << 16
# Fresh uids for sandboxed runs (root only): far above any real account, one per run, so the
# process limit counts that run's processes only and a cleanup can kill exactly them.
_UID_BASE = 1_500_000_000
_UID_SPAN = 1 << 28
_REAP_ROUNDS = 50
_ZYGOTE_TIMEOUT_S = 60.0
_ZYGOTE_REPLY_BYTES = 4096

# Imported before the privilege drop: after it the interpreter's own files may be unreadable
# (e.g. a Python installed under /root). Other stdlib modules import when world-readable.
DEFAULT_PRELOAD = (
    "abc", "array", "base64", "bisect", "calendar", "cmath", "collections", "collections.abc",
    "contextlib", "copy", "dataclasses", "datetime", "decimal", "enum", "fractions", "functools",
    "hashlib", "heapq", "io", "itertools", "json", "math", "numbers", "operator", "pprint",
    "queue", "random", "re", "statistics", "string", "struct", "textwrap", "threading", "time",
    "types", "typing", "unicodedata", "weakref",
)

STATUSES = ("ok", "runtime_error", "timeout", "memory_error", "output_limit", "violation", "sandbox_error")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    cpu_time_s: float = 5.0
    """CPU seconds (RLIMIT_CPU, rounded up to whole seconds)."""
    wall_time_s: float | None = None
    """Wall-clock seconds before the process group is killed; None: 2 * cpu_time_s + 2."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS)."""
    file_size_mb: int = 16
    """Largest file the solution may write (RLIMIT_FSIZE)."""
    tmpfs_mb: int = 64
    """Size of the private /tmp working directory (mount namespace only)."""
    max_processes: int = 16
    """RLIMIT_NPROC (tasks, threads included) of the run's own uid."""
    max_open_files: int = 64
    stdout_bytes: int = 4 << 20
    """More output than this kills the run (status ``output_limit``)."""

    @property
    def wall_s(self) -> float:
        return self.wall_time_s if self.wall_time_s is not None else 2 * self.cpu_time_s + 2


@dataclass(frozen=True)
class Isolation:
    """Which layers to use. Each applies where the machine allows; ``require`` makes one mandatory."""

    drop_privileges: bool = True
    """As root: run the solution under a fresh uid (no effect otherwise)."""
    network_namespace: bool = True
    mount_namespace: bool = True
    audit_hook: bool = True
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    site_packages: bool = False
    """Let the solution import installed third-party packages (start Python without -S); list
    the ones it needs in ``preload`` when the install is not world-readable."""
    require: tuple[str, ...] = ()
    """Layers that must be in place or the run fails with ``sandbox_error``: any of
    ``uid``, ``netns``, ``mountns``, ``audit``."""


@dataclass
class SandboxResult:
    status: str
    """One of STATUSES."""
    stdout: str = ""
    stderr: str = ""
    """The last few KB."""
    value: Any = None
    """Return value of a function call (JSON-decoded)."""
    error: str | None = None
    returncode: int | None = None
    wall_s: float = 0.0
    isolation: dict = field(default_factory=dict)


def run_python(
    source: str,
    *,
    stdin: str = "",
    call: tuple[str, list, dict] | None = None,
    limits: SandboxLimits = SandboxLimits(),
    isolation: Isolation = Isolation(),
) -> SandboxResult:
    """Run ``source`` in a sandboxed process. Thread-safe.

    With ``call=None`` the source runs as a script fed ``stdin``; with
    ``call=(fn_name, args, kwargs)`` the source is executed and then ``fn_name(*args, **kwargs)``
    (or ``Solution().fn_name``) is called and its JSON-able return value reported.
    """
    run_dir = Path(tempfile.mkdtemp(prefix="grpo-sandbox-"))
    uid = _fresh_uid() if isolation.drop_privileges and os.geteuid() == 0 else None
    started = time.monotonic()
    pid = None
    fds: list[int] = []
    try:
        workdir = run_dir / "work"
        workdir.mkdir()
        if uid is not None:
            os.chown(workdir, uid, uid)
        else:
            workdir.chmod(0o700)
        job = {
            "source": source,
            "call": None if call is None else {"fn_name": call[0], "args": list(call[1]), "kwargs": dict(call[2])},
            "limits": asdict(limits),
            "uid": uid,
            "workdir": str(workdir),
            "netns": isolation.network_namespace,
            "mountns": isolation.mount_namespace,
            "audit": isolation.audit_hook,
            "require": list(isolation.require),
        }
        job_path = run_dir / "job.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        input_path = run_dir / "input.txt"
        input_path.write_text(stdin, encoding="utf-8")
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        result_r, result_w = os.pipe()
        fds = [stdout_r, stderr_r, result_r]
        child_fds = [os.open(input_path, os.O_RDONLY), stdout_w, stderr_w, result_w]
        try:
            pid = _spawn(isolation, str(job_path), child_fds)
        finally:
            for fd in child_fds:
                os.close(fd)
        started = time.monotonic()
        stdout, stderr, result, stop = _collect(fds, limits)
        return _classify(stdout, stderr, result, stop, time.monotonic() - started)
    except (OSError, ZygoteError) as exc:
        return SandboxResult("sandbox_error", error=f"could not run the sandbox: {exc}", wall_s=time.monotonic() - started)
    finally:
        for fd in fds:
            os.close(fd)
        if pid is not None:
            _kill_group(pid)
        if uid is not None:
            _reap_uid(uid)
        shutil.rmtree(run_dir, ignore_errors=True)


class ZygoteError(RuntimeError):
    """The zygote process could not be started or stopped answering."""


class _Zygote:
    """The pre-loaded process that forks every run (see ``child.py``)."""

    def __init__(self, preload: tuple[str, ...], site_packages: bool) -> None:
        self.lock = threading.Lock()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(_ZYGOTE_TIMEOUT_S)
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", *(() if site_packages else ("-S",)), "-X", "utf8", str(_CHILD_SCRIPT),
                 "--zygote", str(theirs.fileno()), json.dumps(list(preload))],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=_clean_environment(),
                start_new_session=True,  # a Ctrl-C for the host must not reach it
            )
        try:
            ready = self.sock.recv(_ZYGOTE_REPLY_BYTES)
        except OSError as exc:
            self.close()
            raise ZygoteError(f"the sandbox zygote did not start: {exc}") from exc
        if not ready:
            self.close()
            raise ZygoteError(f"the sandbox zygote exited during start-up (code {self.proc.wait()})")

    def spawn(self, job_path: str, fds: list[int]) -> int:
        """Start a run; its pid is also its process-group id."""
        with self.lock:
            socket.send_fds(self.sock, [job_path.encode()], fds)
            reply = json.loads(self.sock.recv(_ZYGOTE_REPLY_BYTES) or b"{}")
        if "pid" not in reply:
            raise ZygoteError(f"the sandbox zygote refused the run: {reply}")
        return reply["pid"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.sock.close()  # the zygote exits on EOF
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _spawn(isolation: Isolation, job_path: str, fds: list[int]) -> int:
    """Start a run on the zygote; a zygote that died is replaced once."""
    try:
        return _zygote(isolation).spawn(job_path, fds)
    except (OSError, ZygoteError):
        _zygote(isolation, restart=True)
        return _zygote(isolation).spawn(job_path, fds)


_zygotes: dict[tuple, _Zygote] = {}
_zygotes_lock = threading.Lock()


def _zygote(isolation: Isolation, restart: bool = False) -> _Zygote:
    """This process's zygote for the isolation's preload settings, (re)started when needed."""
    key = (os.getpid(), isolation.preload, isolation.site_packages)
    with _zygotes_lock:
        zygote = _zygotes.get(key)
        if zygote is None or restart or not zygote.alive():
            if zygote is not None:
                zygote.close()
            zygote = _zygotes[key] = _Zygote(isolation.preload, isolation.site_packages)
        return zygote


def _fresh_uid() -> int:
    return _UID_BASE + secrets.randbelow(_UID_SPAN)


def _clean_environment() -> dict[str, str]:
    """Nothing of the host's environment (tokens, keys, paths) reaches the solution."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
    }


def _collect(fds: list[int], limits: SandboxLimits):
    """Read stdout, stderr and the result pipe until all close, the deadline, or too much output."""
    deadline = time.monotonic() + limits.wall_s
    stdout_fd, stderr_fd, result_fd = fds
    stdout, stderr, result = bytearray(), bytearray(), bytearray()
    sinks = {stdout_fd: stdout, stderr_fd: stderr, result_fd: result}
    stop = None
    with selectors.DefaultSelector() as selector:
        for fd in sinks:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stop = "timeout"
                break
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, _READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                sink = sinks[key.fd]
                sink += chunk
                if sink is stderr and len(stderr) > 2 * _STDERR_TAIL:
                    del stderr[:-_STDERR_TAIL]
                elif sink is result and len(result) > _RESULT_CAP:
                    stop = "output_limit"
                elif sink is stdout and len(stdout) > limits.stdout_bytes:
                    stop = "output_limit"
            if stop:
                break
    return bytes(stdout[: limits.stdout_bytes]), bytes(stderr[-_STDERR_TAIL:]), bytes(result), stop


def _classify(stdout: bytes, stderr: bytes, result: bytes, stop: str | None, wall_s: float) -> SandboxResult:
    out = stdout.decode("utf-8", "replace")
    err = stderr.decode("utf-8", "replace")
    reply, returncode = _result_lines(result)
    res = SandboxResult("runtime_error", out, err, returncode=returncode, wall_s=wall_s, isolation=reply.get("isolation", {}))
    if stop is not None:
        res.status = stop
        res.error = "wall-clock limit" if stop == "timeout" else "output limit"
    elif reply.get("status") in STATUSES:
        res.status = reply["status"]
        res.error = reply.get("error")
        res.value = reply.get("value")
    elif returncode is not None and returncode < 0:
        sig = -returncode
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            res.status, res.error = "timeout", "CPU time limit"
        elif sig == signal.SIGXFSZ:
            res.status, res.error = "output_limit", "file size limit"
        elif "MemoryError" in err or "Cannot allocate memory" in err:
            res.status, res.error = "memory_error", f"killed by {_signal_name(sig)}"
        else:
            res.error = f"killed by {_signal_name(sig)}"
    elif returncode == 0:
        res.status = "ok"  # the script ended itself early (os._exit(0)); its output is judged
    else:
        res.error = f"exited with code {returncode}" if returncode is not None else "ended without a result"
    return res


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _result_lines(data: bytes) -> tuple[dict, int | None]:
    """The run's reply (last JSON line with a status) and the monitor's exit status."""
    reply, returncode = {}, None
    for line in data.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if not isinstance(item, dict):
            continue
        if "exit_status" in item:
            returncode = item["exit_status"] if isinstance(item["exit_status"], int) else None
        elif "status" in item:
            reply = item
    return reply, returncode


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_uid(uid: int) -> None:
    """Kill every process of the run's uid (children that left the process group)."""
    for _ in range(_REAP_ROUNDS):
        pids = _pids_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes owned by ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            pids.append(int(entry))
    return pids
