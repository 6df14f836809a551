"""Sandbox child side: runs inside the jail, before and around the untrusted solution.

Started by :mod:`grpo_envs.sandbox.runner` as ``python -I [-S] -X utf8 child.py JOB_FILE`` (inside
nsjail, or as a plain process where the config allows running without the jail). Standard
library only. Fd 0 is the test's input, 1 and 2 the solution's output; the job names the fd of the result
pipe to the runner ("fd 3" below). Everything before ``_run_solution`` is trusted code:

1. read the job (source, mode, limits);
2. in plain mode only, the resource limits (in the jail nsjail sets them, with cgroups);
3. the audit hook (a diagnostic, not the boundary): an attempt to spawn a program, open a
   socket or send a signal to another process is reported on fd 3 at once and ends the run
   (exit code ``VIOLATION_EXIT``), so a solution cannot catch it and carry on;
4. ``{"started": true}`` on fd 3, the solution, and one JSON line with its result.

The runner reads fd 3 as a log of JSON lines: a violation line stays there whatever the solution
does next. The job arrives as ``marshal`` data (written by the runner) and the lines are written
by ``_to_json``: importing ``json`` (enum, re...) would double the start-up time of every run.
"""

from __future__ import annotations

import builtins
import errno
import marshal
import math
import os
import sys
from _json import encode_basestring_ascii

RESULT_FD = 3
"""Set from the job: the fd the runner passed for the result pipe."""
VIOLATION_EXIT = 86
_MB = 2**20
_ERROR_CHARS = 1000
_VALUE_CHARS = 1 << 20

# Python-level events that no solution needs: reported as violations (diagnostic; the jail
# contains them anyway).
_DENIED_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "subprocess.Popen",
        "pty.spawn",
        "os.killpg",
        "signal.pthread_kill",
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyaddr",
        "os.setuid",
        "os.setgid",
        "os.chroot",
        "sys.remote_exec",
    }
)


def main(job_data: bytes) -> None:
    global RESULT_FD
    try:
        job = marshal.loads(job_data)
        RESULT_FD = job["result_fd"]
        if job.get("rlimits"):
            _set_limits(job["limits"])
        if job["audit"]:
            _install_audit_hook()
    except BaseException as exc:  # noqa: BLE001 - a set-up failure is the sandbox's, not the solution's
        _report({"status": "sandbox_error", "error": _describe(exc)})
        os._exit(2)
    _report({"started": True})
    reply = _run_solution(job)
    _flush_std()
    _report(reply)
    os._exit(0)


def _set_limits(limits: dict) -> None:
    import resource

    cpu = max(1, -int(-limits["cpu_time_s"] // 1))
    memory = limits["memory_mb"] * _MB
    file_size = limits["file_size_mb"] * _MB
    pairs = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (memory, memory)),
        (resource.RLIMIT_FSIZE, (file_size, file_size)),
        (resource.RLIMIT_NOFILE, (limits["max_open_files"], limits["max_open_files"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    for which, (soft, hard) in pairs:
        _, old_hard = resource.getrlimit(which)
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))


def _install_audit_hook() -> None:
    my_pid, result_fd = os.getpid(), RESULT_FD
    deny_events, write, frame, exit_now = _DENIED_EVENTS, os.write, _frame, os._exit

    def violation(what: str) -> None:
        try:
            write(result_fd, frame({"violation": what}))
        finally:
            exit_now(VIOLATION_EXIT)

    def hook(event: str, args: tuple) -> None:
        if event in deny_events:
            violation(event)
        elif event == "os.kill" and args and args[0] not in (0, my_pid):
            violation(f"os.kill({args[0]})")

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
        # Python ignores SIGXFSZ, so RLIMIT_FSIZE surfaces as EFBIG; a full private /tmp as ENOSPC.
        status = "output_limit" if exc.errno in (errno.EFBIG, errno.ENOSPC) else "runtime_error"
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
    """The value as JSON text (the runner decodes it), or the JSON of its repr."""
    try:
        text = _to_json(value)
    except (TypeError, RecursionError):
        text = _to_json(repr(value))
    if len(text) > _VALUE_CHARS:
        raise ValueError(f"return value too large ({len(text)} characters as JSON)")
    return _Raw(text)


class _Raw(str):
    """JSON text to embed as it is."""


def _to_json(value) -> str:
    """What json.dumps gives for JSON-able values (tuples as lists); TypeError for the rest."""
    if isinstance(value, _Raw):
        return str.__str__(value)
    if value is None or value is True or value is False:
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, str):
        return encode_basestring_ascii(value)
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return (
            float.__repr__(value)
            if math.isfinite(value)
            else ("NaN" if value != value else "Infinity" if value > 0 else "-Infinity")
        )
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_to_json(v) for v in value) + "]"
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if isinstance(k, str):
                key = k
            elif k is None or isinstance(k, (bool, int, float)):
                key = _to_json(k)
            else:
                raise TypeError(f"keys must be str, int, float, bool or None, not {type(k).__name__}")
            items.append(encode_basestring_ascii(key) + ": " + _to_json(v))
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _frame(record: dict) -> bytes:
    return (_to_json(record) + "\n").encode()


def _report(reply: dict) -> None:
    data = _frame(reply)
    try:
        while data:
            data = data[os.write(RESULT_FD, data) :]
    except OSError:
        pass


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: child.py JOB_FILE (started by grpo_envs.sandbox)")
    with open(sys.argv[1], "rb") as f:
        main(f.read())
