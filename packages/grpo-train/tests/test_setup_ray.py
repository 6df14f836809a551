"""Local Ray head start-ups (grpo_train.setup.start_local_head): grpo processes on one node take
turns under a node-wide flock, and a head that fails to start is shut down and started once more.

The failure they address (a clean-clone CI run, two `grpo train` runs started in the same second):
Ray's raylet aborted with "Timed out waiting for file .../metrics_agent_port_..." because its
dashboard agent, importing under load, missed the raylet's fixed 15 s; `ray.init` then raised "The
current node timed out during startup". benchmarks/e2e/repro_ray_head_start.py reproduces it with
real Ray by delaying the agent; these tests prove the lock across real processes and the retry.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from grpo_train.setup import node_start_lock, start_local_head

RAY_FAILURE = (
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)

HOLDER = """
import sys, time
from pathlib import Path
from grpo_train.setup import node_start_lock
with node_start_lock(Path(sys.argv[1])):
    Path(sys.argv[2]).write_text("held")
    time.sleep(float(sys.argv[3]))
    Path(sys.argv[2]).write_text(repr(time.time()))
time.sleep(30)  # still alive: the release is the lock's, not the process exit's
"""


def _holder(tmp_path, hold_s: float) -> tuple[subprocess.Popen, object]:
    lock, note = tmp_path / "start.lock", tmp_path / "note"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(note), str(hold_s)])
    deadline = time.time() + 120
    while not note.exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    return proc, note


def test_a_second_process_starts_its_head_only_after_the_first_released_the_lock(tmp_path):
    proc, note = _holder(tmp_path, hold_s=1.5)
    try:
        started = []
        start_local_head(lambda: started.append(time.time()), lambda: None, lock_path=tmp_path / "start.lock")
        released = float(note.read_text())
        assert started[0] >= released, (started, released)
        assert proc.poll() is None  # the holder process still runs: the lock, not its exit, let us in
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_holder_frees_the_lock(tmp_path):
    proc, _ = _holder(tmp_path, hold_s=600)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    with node_start_lock(tmp_path / "start.lock", wait_s=30) as locked:
        assert locked
    assert time.monotonic() - t0 < 5


def test_a_lock_held_past_the_wait_lets_the_start_go_ahead_with_a_warning(tmp_path, capsys):
    lock = tmp_path / "start.lock"
    with node_start_lock(lock) as first, node_start_lock(lock, wait_s=0.3) as second:
        assert (first, second) == (True, False)
    assert f"warning: {lock} held for over 0.3 s; starting Ray without it" in capsys.readouterr().err


def test_a_failed_head_start_is_shut_down_and_started_once_more(tmp_path, capsys):
    calls = []

    def start():
        calls.append("start")
        if calls.count("start") == 1:
            raise Exception(RAY_FAILURE)

    start_local_head(start, lambda: calls.append("shutdown"), lock_path=tmp_path / "lock")
    assert calls == ["start", "shutdown", "start"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: Ray's local head did not start ({RAY_FAILURE}); starting it again (attempt 2 of 2)"]


def test_a_head_that_fails_twice_raises_the_second_failure(tmp_path):
    calls = []

    def start():
        calls.append("start")
        raise RuntimeError(f"failure {calls.count('start')}")

    with pytest.raises(RuntimeError, match="failure 2"):
        start_local_head(start, lambda: calls.append("shutdown"), lock_path=tmp_path / "lock")
    assert calls == ["start", "shutdown", "start", "shutdown"]
