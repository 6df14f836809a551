"""Sandbox child side: a zygote that forks one jailed process per run. Standard library only.

Process tree, all started by :mod:`grpo_envs.sandbox.runner`:

- **zygote** (``python -I [-S] child.py --zygote FD PRELOAD_JSON``, one per host process and
  preload list): imports the modules solutions commonly use, once, then waits on a Unix socket
  for requests (a job file and four fds: stdin, stdout, stderr, result). For each it forks:
- **monitor** (root when the host is root): its own session and process group (the group the
  runner kills), the four fds as 0/1/2/3 and nothing else; it forks the run, waits for it and
  writes its exit status to the result pipe;
- **run**: sets up the jail, then runs the untrusted solution. Everything up to
  ``_run_solution`` is trusted code that runs before a single line of the solution:

1. read the job (source, mode, limits) while still able to read the run folder;
2. new network namespace (no interfaces but a downed loopback); as root also a new mount
   namespace with fresh size-limited tmpfs mounts on /tmp, /var/tmp and /dev/shm, /tmp being
   the working directory;
3. resource limits; 4. drop to the job's fresh uid (root only); no new privileges;
5. the audit hook (Python-level policy, defence in depth);
6. run the solution and write one JSON line to the result pipe.

The zygote exists for speed: importing the preloaded modules costs ~100 ms per process, a
fork ~1 ms. They must be imported before the uid drop anyway, because the interpreter's own
install may be unreadable to the fresh uid (e.g. a Python under /root).
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import importlib
import io
import json
import math
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
_MB = 2**20
_ERROR_CHARS = 1000
_VALUE_CHARS = 1 << 20
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# Python-level events the solution may not raise (see module docstring of grpo_envs.sandbox).
_DENIED_EVENTS = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "pty.spawn", "os.killpg", "signal.pthread_kill",
    "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
    "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
    "os.setuid", "os.setgid", "os.chroot", "sys.remote_exec",
})
_DENIED_PREFIXES = ("ctypes.", "_ctypes.", "cffi.")
_DENIED_IMPORTS = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "cffi", "_cffi_backend", "mmap"})
_PATH_EVENTS = frozenset({
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
    "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile",
    "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.move", "os.mkfifo", "os.mknod",
})
_READABLE_FILES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/etc/localtime")
_READABLE_DIRS = ("/usr/share/zoneinfo",)


class SandboxViolation(PermissionError):
    """Raised by the audit hook when the solution attempts a forbidden operation."""


RESULT_FD = 3
_REQUEST_BYTES = 4096


def serve(sock_fd: int, preload: list[str]) -> None:
    """Zygote loop: preload, then fork a monitor per request until the runner hangs up."""
    import random
    import socket

    _preload(preload)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    sock = socket.socket(fileno=sock_fd)
    sock.send(b'{"ready": true}')
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _REQUEST_BYTES, 4)
        except OSError:
            return
        if not data:
            return  # the runner's process is gone
        if len(fds) != 4:
            for fd in fds:
                os.close(fd)
            sock.send(b'{"error": "expected 4 fds"}')
            continue
        pid = os.fork()
        if pid == 0:
            try:
                _monitor(data.decode(), fds, sock, random)
            finally:
                os._exit(70)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())


def _monitor(job_path: str, fds: list[int], zygote_sock, random_module) -> None:
    os.setsid()
    zygote_sock.close()
    stdin, stdout, stderr, result = fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2), (result, RESULT_FD)):
        os.dup2(fd, target)
    os.closerange(RESULT_FD + 1, _max_fd())
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        random_module.seed()  # each run gets fresh randomness, not the zygote's state
        _run(job_path)  # never returns
    for fd in (0, 1, 2):  # only the run may hold the pipes: EOF means it (and its children) ended
        os.close(fd)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    _report(RESULT_FD, {"exit_status": os.waitstatus_to_exitcode(status)})
    os._exit(0)


def _max_fd() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 65536


def _run(job_path: str) -> None:
    isolation = {"uid": False, "netns": False, "mountns": False, "audit": False}
    try:
        with open(job_path, encoding="utf-8") as f:
            job = json.load(f)
        _fresh_std_streams()
        workdir = _isolate(job, isolation)
        _set_limits(job["limits"], own_uid=job["uid"] is not None)
        if job["uid"] is not None:
            _drop_privileges(job["uid"])
            isolation["uid"] = True
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        violations: list[str] = []
        if job["audit"]:
            _install_audit_hook(workdir, violations)
            isolation["audit"] = True
        _check_required(job["require"], isolation)
    except BaseException as exc:  # noqa: BLE001 - any set-up failure is the sandbox's, not the solution's
        _report(RESULT_FD, {"status": "sandbox_error", "error": _describe(exc), "isolation": isolation})
        os._exit(2)
    reply = _run_solution(job)
    if violations:
        reply = {"status": "violation", "error": "; ".join(dict.fromkeys(violations))[:_ERROR_CHARS]}
    reply["isolation"] = isolation
    _flush_std()
    _report(RESULT_FD, reply)
    os._exit(0)


def _fresh_std_streams() -> None:
    """Text streams over the run's fds 0/1/2 (the zygote's objects may hold state)."""
    def stream(fd: int, mode: str, **kwargs) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding="utf-8", **kwargs)

    sys.stdin = stream(0, "r", errors="replace")
    sys.stdout = stream(1, "w", errors="replace")
    sys.stderr = stream(2, "w", errors="backslashreplace", line_buffering=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


# ---------------------------------------------------------------------- set-up (trusted)
def _preload(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


_libc = None


def _libc_call(name: str, *args) -> int:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    rc = getattr(_libc, name)(*args)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return rc


def _prctl(option: int, value: int) -> None:
    try:
        _libc_call("prctl", option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _isolate(job: dict, isolation: dict) -> str:
    """Enter new namespaces where the kernel lets us; return the working directory."""
    is_root = os.geteuid() == 0
    if job["netns"]:
        for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET) if not is_root else (CLONE_NEWNET,):
            try:
                _libc_call("unshare", flags)
                isolation["netns"] = True
                break
            except OSError:
                continue
    workdir = job["workdir"]
    if job["mountns"] and is_root:
        try:
            _libc_call("unshare", CLONE_NEWNS)
            _libc_call("mount", b"none", b"/", None, MS_REC | MS_PRIVATE, None)
            _mount_tmpfs("/tmp", job["limits"]["tmpfs_mb"], job["uid"])
            workdir = "/tmp"
            isolation["mountns"] = True
        except OSError:
            pass  # e.g. no CAP_SYS_ADMIN in this container: the parent's work folder is used
        if isolation["mountns"]:
            for target in ("/var/tmp", "/dev/shm"):  # other world-writable places, best effort
                try:
                    _mount_tmpfs(target, 1, job["uid"])
                except OSError:
                    pass
    os.chdir(workdir)
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    return workdir


def _mount_tmpfs(target: str, size_mb: int, uid: int | None) -> None:
    owner = 0 if uid is None else uid
    options = f"size={size_mb}m,mode=0700,uid={owner},gid={owner}".encode()
    _libc_call("mount", b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options)


def _set_limits(limits: dict, own_uid: bool) -> None:
    cpu = max(1, math.ceil(limits["cpu_time_s"]))
    memory = limits["memory_mb"] * _MB
    file_size = limits["file_size_mb"] * _MB
    pairs = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_FSIZE, (file_size, file_size)),
        (resource.RLIMIT_NOFILE, (limits["max_open_files"], limits["max_open_files"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    nproc = limits["max_processes"]
    if not own_uid and os.geteuid() != 0:
        # Without a uid of its own the limit counts every task of the host user: allow those too.
        nproc += _tasks_of_uid(os.getuid())
    pairs.append((resource.RLIMIT_NPROC, (nproc, nproc)))
    for which, (soft, hard) in pairs:
        _, old_hard = resource.getrlimit(which)
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))


def _tasks_of_uid(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return count


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.geteuid() != uid or os.getuid() != uid:
        raise OSError("privilege drop failed")


def _check_required(required: list[str], isolation: dict) -> None:
    missing = [name for name in required if not isolation.get(name)]
    if missing:
        raise OSError(f"required isolation not available here: {', '.join(missing)}")


def _install_audit_hook(workdir: str, violations: list[str]) -> None:
    workdir = os.path.realpath(workdir)
    readable_dirs = [workdir, *_READABLE_DIRS]
    for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path}:
        if p and os.path.isabs(p):
            readable_dirs.append(os.path.realpath(p))
    readable_files = frozenset(_READABLE_FILES)
    my_pid = os.getpid()
    realpath, fspath, join, getcwd = os.path.realpath, os.fspath, os.path.join, os.getcwd
    deny_events, deny_prefixes, deny_imports = _DENIED_EVENTS, _DENIED_PREFIXES, _DENIED_IMPORTS
    path_events = _PATH_EVENTS

    def resolve(path) -> str | None:
        if isinstance(path, int):
            return None
        try:
            path = fspath(path)
            if isinstance(path, bytes):
                path = path.decode("utf-8", "surrogateescape")
            return realpath(join(getcwd(), path))
        except Exception:  # noqa: BLE001 - anything odd is treated as outside
            return "/"

    def inside(path: str, roots) -> bool:
        return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)

    def deny(what: str):
        violations.append(what)
        raise SandboxViolation(f"sandbox: {what} is not allowed")

    def hook(event: str, args: tuple) -> None:
        if event in deny_events or event.startswith(deny_prefixes):
            deny(event)
        elif event == "os.kill":
            if args and args[0] not in (0, my_pid):
                deny(f"os.kill({args[0]})")
        elif event == "import":
            if args and str(args[0]).split(".")[0] in deny_imports:
                deny(f"import {args[0]}")
        elif event == "open":
            path = resolve(args[0])
            if path is None:
                return
            mode = args[1] if len(args) > 1 else None
            flags = args[2] if len(args) > 2 else 0
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            if writing:
                if path != "/dev/null" and not inside(path, (workdir,)):
                    deny(f"writing {path}")
            elif path not in readable_files and not inside(path, readable_dirs):
                deny(f"reading {path}")
        elif event in path_events:
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)):
                    path = resolve(arg)
                    if path is not None and not inside(path, (workdir,)):
                        deny(f"{event}({path})")

    sys.addaudithook(hook)


# ---------------------------------------------------------------------- the solution
def _run_solution(job: dict) -> dict:
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    call = job["call"]
    try:
        code = compile(job["source"], "solution.py", "exec")
        if call is None:
            exec(code, namespace)
            return {"status": "ok"}
        namespace["__name__"] = "solution"
        exec(code, namespace)
        value = _find_function(namespace, call["fn_name"])(*call["args"], **call["kwargs"])
        return {"status": "ok", "value": _json_value(value)}
    except SystemExit as exc:
        if exc.code in (None, 0) and call is None:
            return {"status": "ok"}
        return {"status": "runtime_error", "error": f"SystemExit({exc.code!r})"[:_ERROR_CHARS]}
    except MemoryError:
        return {"status": "memory_error", "error": "MemoryError"}
    except OSError as exc:
        # Python ignores SIGXFSZ, so RLIMIT_FSIZE surfaces as EFBIG.
        status = "output_limit" if exc.errno == errno.EFBIG else "runtime_error"
        return {"status": status, "error": _describe(exc)}
    except BaseException as exc:  # noqa: BLE001 - every failure of the solution is a result
        return {"status": "runtime_error", "error": _describe(exc)}


def _find_function(namespace: dict, fn_name: str):
    fn = namespace.get(fn_name)
    if callable(fn):
        return fn
    solution = namespace.get("Solution")
    if isinstance(solution, type) and callable(getattr(solution, fn_name, None)):
        return getattr(solution(), fn_name)
    raise NameError(f"the solution defines no function {fn_name!r}")


def _json_value(value):
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = json.dumps(repr(value))
    if len(text) > _VALUE_CHARS:
        raise ValueError(f"return value too large ({len(text)} characters as JSON)")
    return json.loads(text)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, io.UnsupportedOperation):
            pass


def _report(fd: int, reply: dict) -> None:
    data = (json.dumps(reply) + "\n").encode()
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--zygote":
        serve(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        sys.exit("usage: child.py --zygote SOCKET_FD PRELOAD_JSON (started by grpo_envs.sandbox)")
