"""Child process that runs math-verify for :class:`grpo_envs.verifier.MathVerifier`.

Run as a script (``python math_worker.py MEMORY_LIMIT_BYTES``); it imports only the standard
library and math-verify, so it needs nothing from grpo_envs on its path. With
``--template SOCKET_FD`` it is a fork server instead: it warms up once, then forks a ready
worker for each socket it is sent (see ``_template``). Protocol: one JSON
object per line. It first writes ``{"ready": true}``, then answers each request
``{"gold": str, "answer": str}`` with ``{"status": ..., "parsed": str | null}`` where status is
``correct``, ``wrong``, ``parse_failure``, ``gold_parse_failure`` or ``error``.

math-verify's own timeouts are switched off (``parsing_timeout=None``,
``timeout_seconds=None``): its ``signal.alarm`` cannot fire outside the main thread and
cannot stop C code either. The parent enforces the deadline by killing this process instead.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import resource
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PREVIEW_CHARS = 200


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's kill on close still applies
        pass


def _boxed(text: str) -> str:
    text = text.strip()
    if "\\boxed" in text:
        return text
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : -len(right)].strip()
            break
    return "\\boxed{" + text + "}"


def _checker():
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    extraction = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]

    def parse_boxed(text: str) -> list:
        return parse(_boxed(text), extraction_config=extraction, parsing_timeout=None)

    parse_gold = functools.lru_cache(maxsize=4096)(parse_boxed)

    def check(gold: str, answer: str) -> dict:
        gold_parsed = parse_gold(gold)
        if not gold_parsed:
            return {"status": "gold_parse_failure", "parsed": None}
        pred = parse_boxed(answer)
        if not pred:
            return {"status": "parse_failure", "parsed": None}
        correct = verify(gold_parsed, pred, timeout_seconds=None)
        return {"status": "correct" if correct else "wrong", "parsed": str(pred[-1])[:_PREVIEW_CHARS]}

    check("1", "1")  # warm up sympy and the LaTeX parser before saying ready
    return check


def _serve(check, requests, protocol) -> None:
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in requests:
        try:
            request = json.loads(line)
            reply = check(str(request["gold"]), str(request["answer"]))
        except Exception as exc:  # MemoryError included: one bad answer must not end the worker
            reply = {"status": "error", "parsed": None, "error": f"{type(exc).__name__}: {exc}"[:500]}
        protocol.write(json.dumps(reply) + "\n")


def _template(check, sock_fd: int) -> None:
    """Fork server: each request carries one connected socket; a forked, already warm worker
    serves checks on it. Workers are ready in milliseconds instead of a cold import."""
    import socket

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    sock = socket.socket(fileno=sock_fd)
    sock.send(b"ready")
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(sock, 16, 1)
        except OSError:
            return
        if not fds:
            return  # the verifier is gone
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                _die_with_parent()
                conn = fds[0]
                _serve(check, os.fdopen(os.dup(conn), "r"), os.fdopen(conn, "w", buffering=1))
            finally:
                os._exit(0)
        os.close(fds[0])
        sock.send(str(pid).encode())


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from sympy must not corrupt the protocol
    memory_limit = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if memory_limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    _die_with_parent()
    check = _checker()
    if len(sys.argv) > 3 and sys.argv[2] == "--template":
        protocol.close()
        _template(check, int(sys.argv[3]))
    else:
        _serve(check, sys.stdin, protocol)


if __name__ == "__main__":
    main()
