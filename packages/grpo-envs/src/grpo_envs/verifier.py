"""Math-verify behind a hard, process-based deadline.

Why a process and not ``signal.alarm``: math-verify's built-in timeout uses ``signal.alarm``,
which only works in a process's main thread and cannot interrupt long-running C code (big
integer powers, sympy internals), and a sympy blow-up can exhaust memory or crash. So each
:class:`MathVerifier` keeps a long-lived child process (``math_worker.py``) with math-verify's
own timeout disabled and an address-space limit, and sends it one check at a time. If a check
overruns its deadline the child is killed (SIGKILL works on any thread, in any C call) and a
warm spare takes over at once. Workers are forked from a warm template process (a fork server
that imported math-verify once), so the next spare is ready in milliseconds: a run of hostile
answers costs each its timeout, never a cold start of sympy (seconds) on top. This works the
same in a Ray actor's main thread, in any other thread, and in plain ``in_process`` use.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_WORKER_SCRIPT = Path(__file__).with_name("math_worker.py")
_READ_CHUNK = 1 << 16
_FORK_TIMEOUT_S = 30.0


class WorkerStartError(RuntimeError):
    """The math-verify child process could not start (usually: math-verify is not installed)."""


@dataclass(frozen=True)
class Verdict:
    status: str
    """correct | wrong | parse_failure | gold_parse_failure | timeout | error"""
    parsed: str | None = None
    error: str | None = None


class _WorkerProcess:
    """One math_worker.py child and the line protocol to it."""

    def __init__(self, memory_limit_bytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(_WORKER_SCRIPT), str(memory_limit_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C meant for the trainer must not kill checks mid-way
        )
        self._rfd = self.proc.stdout.fileno()
        self._buffer = b""
        self._ready = False

    def wait_ready(self, timeout_s: float) -> None:
        if self._ready:
            return
        try:
            line = self._read_line(time.monotonic() + timeout_s)
        except EOFError:
            line = None
        if line is None or not json.loads(line).get("ready"):
            code = self.proc.poll()
            self.kill()
            raise WorkerStartError(
                f"math-verify worker did not start within {timeout_s:.0f} s (exit code {code}); "
                "is math-verify installed in this Python? (pip install grpo-envs)"
            )
        self._ready = True

    def request(self, payload: dict, timeout_s: float) -> dict | None:
        """The reply, or None if the deadline passed. Raises EOFError if the child died."""
        try:
            self._send((json.dumps(payload) + "\n").encode())
        except (BrokenPipeError, OSError) as exc:
            raise EOFError(str(exc)) from exc
        line = self._read_line(time.monotonic() + timeout_s)
        return None if line is None else json.loads(line)

    def _send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def _exit_code(self) -> int | None:
        return self.proc.wait()

    def _read_line(self, deadline: float) -> bytes | None:
        fd = self._rfd
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                try:
                    chunk = os.read(fd, _READ_CHUNK)
                except OSError as exc:  # a socket whose worker was killed: ECONNRESET
                    raise EOFError(f"math-verify worker gone: {exc}") from exc
                if not chunk:
                    raise EOFError(f"math-verify worker exited with code {self._exit_code()}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class _Template(_WorkerProcess):
    """The fork server: math_worker.py --template, warm, forking one worker per request."""

    def __init__(self, memory_limit_bytes: int) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    str(_WORKER_SCRIPT),
                    str(memory_limit_bytes),
                    "--template",
                    str(theirs.fileno()),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float) -> None:
        readable, _, _ = select.select([self.sock], [], [], timeout_s)
        if not readable or self.sock.recv(16) != b"ready":
            code = self.proc.poll()
            self.kill()
            raise WorkerStartError(
                f"math-verify worker did not start within {timeout_s:.0f} s (exit code {code}); "
                "is math-verify installed in this Python? (pip install grpo-envs)"
            )

    def fork(self) -> _ForkedWorker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            socket.send_fds(self.sock, [b"fork"], [theirs.fileno()])
        self.sock.settimeout(_FORK_TIMEOUT_S)
        try:
            pid = int(self.sock.recv(32))
        except (OSError, ValueError) as exc:
            ours.close()
            raise EOFError(f"the math-verify template did not fork: {exc}") from exc
        return _ForkedWorker(ours, pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class _ForkedWorker(_WorkerProcess):
    """A worker forked by the template; we talk to it over a socket and kill it by pid."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock, self.pid = sock, pid
        self._rfd = sock.fileno()
        self._buffer = b""
        self._ready = False

    def _send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _exit_code(self) -> int | None:
        return None  # the template reaps it

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.sock.close()


def _kill_all(workers: list) -> None:
    for worker in workers:
        if worker is not None:
            worker.kill()


class MathVerifier:
    """Checks (gold, answer) pairs with math-verify, each under a hard deadline."""

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_limit_mb: int = 4096,
        spare_worker: bool = True,
        startup_timeout_s: float = 120.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._memory_limit = memory_limit_mb * 2**20
        self._spare_enabled = spare_worker
        self._workers: list = [None, None, None]  # [active, spare, template]
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        self.restarts = 0
        self._start_template()
        self._workers[0] = self._new_worker()
        self._workers[1] = self._new_worker() if spare_worker else None

    def check(self, gold: str, answer: str) -> Verdict:
        worker = self._workers[0]
        try:
            reply = worker.request({"gold": gold, "answer": answer}, self.timeout_s)
        except EOFError as exc:
            self._replace_active()
            return Verdict("error", error=f"math-verify worker died: {exc}")
        if reply is None:
            self._replace_active()
            return Verdict("timeout")
        return Verdict(reply["status"], reply.get("parsed"), reply.get("error"))

    def _start_template(self) -> None:
        template = _Template(self._memory_limit)
        self._workers[2] = template
        template.wait_ready(self.startup_timeout_s)

    def _new_worker(self) -> _ForkedWorker:
        """A ready worker forked from the template (restarted, cold, only if it died)."""
        try:
            if not self._workers[2].alive():
                raise EOFError("the template process died")
            worker = self._workers[2].fork()
        except EOFError as exc:
            log.warning("math verifier: restarting the template (%s)", exc)
            self._workers[2].kill()
            self._start_template()
            worker = self._workers[2].fork()
        worker.wait_ready(self.startup_timeout_s)
        return worker

    def _replace_active(self) -> None:
        """Kill the active worker; the spare (or a freshly forked worker) takes its place."""
        self.restarts += 1
        self._workers[0].kill()
        self._workers[0] = self._workers[1] or self._new_worker()
        self._workers[1] = self._new_worker() if self._spare_enabled else None

    def close(self) -> None:
        self._finalizer()
