"""Sandbox containment: each hostile program is stopped with the right status, fast, and the
host (this test process, its files, its network, its process table) is unharmed.

Most cases run twice: with every layer (the default) and with the audit hook off, to show the
kernel layers (fresh uid, namespaces, rlimits) hold on their own. The OS-layer cases need root
(or CAP_SYS_ADMIN) and are skipped elsewhere.
"""

import os
import socket
import sys
import time

import pytest

from grpo_envs.sandbox import DEFAULT_PRELOAD, Isolation, SandboxLimits, run_python
from grpo_envs.sandbox.runner import _UID_BASE

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="kernel isolation layers need root here")
FAST = SandboxLimits(cpu_time_s=1, wall_time_s=4, memory_mb=256, max_processes=8)
# socket and subprocess are preloaded so that, where the stdlib is unreadable to the fresh uid
# (a Python under /root), the audit hook and not a failed import is what stops the program.
FULL = Isolation(preload=DEFAULT_PRELOAD + ("socket", "subprocess"))
OS_ONLY = Isolation(audit_hook=False, preload=FULL.preload)


def _sandbox_pids():
    """Live processes of any sandbox uid (zombies are dead, awaiting their reaper)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid < _UID_BASE:
                    continue
                with open(f"/proc/{entry}/stat", "rb") as f:
                    state = f.read().rpartition(b")")[2].split()[0]
            except (OSError, IndexError):
                continue
            if state not in (b"Z", b"X"):
                pids.append(int(entry))
    return pids


@pytest.fixture(autouse=True)
def host_unharmed():
    before = set(os.listdir("/tmp"))
    t0 = time.monotonic()
    yield
    assert time.monotonic() - t0 < 30, "a sandbox test took too long"
    assert _sandbox_pids() == [], "sandboxed processes survived their run"
    leftovers = {n for n in set(os.listdir("/tmp")) - before if n.startswith("grpo-sandbox-")}
    assert not leftovers, f"run folders left behind: {leftovers}"


def test_correct_programs_run():
    r = run_python("import sys\nprint(sum(map(int, sys.stdin.read().split())))", stdin="1 2 3\n", limits=FAST)
    assert (r.status, r.stdout) == ("ok", "6\n")
    r = run_python("def add(a, b):\n    return [a + b, 'x']", call=("add", [2, 3], {}), limits=FAST)
    assert (r.status, r.value) == ("ok", [5, "x"])
    r = run_python("class Solution:\n    def twice(self, x):\n        return 2 * x", call=("twice", [4], {}), limits=FAST)
    assert (r.status, r.value) == ("ok", 8)
    r = run_python("import sys\nprint('partial')\nsys.exit(0)", limits=FAST)
    assert (r.status, r.stdout) == ("ok", "partial\n")


@needs_root
def test_all_layers_are_in_place_here():
    r = run_python("print(1)", limits=FAST, isolation=Isolation(require=("uid", "netns", "mountns", "audit")))
    assert r.status == "ok"
    assert r.isolation == {"uid": True, "netns": True, "mountns": True, "audit": True}


def test_missing_required_layer_is_a_sandbox_error():
    r = run_python("print(1)", limits=FAST, isolation=Isolation(audit_hook=False, require=("audit",)))
    assert r.status == "sandbox_error"
    assert "required isolation not available here: audit" in r.error
    assert r.stdout == ""  # the solution never ran


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET_TOKEN", "hunter2")
    r = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ.get('GRPO_TEST_SECRET_TOKEN'))", limits=FAST)
    assert r.status == "ok"
    assert "hunter2" not in r.stdout and "GRPO_TEST_SECRET_TOKEN" not in r.stdout


@pytest.mark.parametrize("isolation", [FULL, OS_ONLY], ids=["full", "os-only"])
def test_infinite_loop(isolation):
    t0 = time.monotonic()
    r = run_python("while True:\n    pass", limits=FAST, isolation=isolation)
    assert r.status == "timeout"
    assert time.monotonic() - t0 < FAST.wall_s + 2


def test_sleeping_program_hits_the_wall_clock():
    r = run_python("import time\ntime.sleep(60)", limits=SandboxLimits(cpu_time_s=1, wall_time_s=1))
    assert (r.status, r.error) == ("timeout", "wall-clock limit")


def test_fork_bomb_is_denied_by_the_audit_hook():
    r = run_python("import os\nwhile True:\n    os.fork()", limits=FAST)
    assert r.status == "violation" and "os.fork" in r.error


@needs_root
def test_fork_bomb_is_bounded_by_the_kernel():
    # Without the hook: RLIMIT_NPROC on the run's own uid stops it, and every process of that
    # uid (the autouse fixture checks) is killed at the end, even those that left the group.
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n        os.setsid()\n    except OSError:\n        pass"
    r = run_python(bomb, limits=FAST, isolation=OS_ONLY)
    assert r.status == "timeout"


@pytest.mark.parametrize("isolation", [FULL, OS_ONLY], ids=["full", "os-only"])
@pytest.mark.parametrize("program", ["x = bytearray(2 ** 34)", "a = []\nwhile True:\n    a.append(bytearray(10 ** 7))"],
                         ids=["one-block", "growing"])
def test_memory_bomb(program, isolation):
    r = run_python(program, limits=FAST, isolation=isolation)
    assert r.status == "memory_error"


@pytest.mark.parametrize("isolation", [FULL, OS_ONLY], ids=["full", "os-only"])
def test_writing_outside_the_work_dir(tmp_path, isolation):
    if isolation is OS_ONLY and not ROOT:
        pytest.skip("kernel isolation layers need root here")
    # Under the host's /tmp (the sandbox's /tmp is a private tmpfs, where this folder is absent)
    # and in the root folder (denied by the hook, and to the fresh uid by permissions).
    targets = [tmp_path / "pwned.txt", f"/grpo-sandbox-pwned-{os.getpid()}.txt"]
    try:
        for target in targets:
            r = run_python(f"open({str(target)!r}, 'w').write('x')\nprint('wrote')", limits=FAST, isolation=isolation)
            assert r.status in (("violation", "runtime_error") if isolation is FULL else ("runtime_error",))
            assert not os.path.exists(target)
        r = run_python(f"open({targets[1]!r}, 'w')", limits=FAST, isolation=isolation)
        assert r.status == ("violation" if isolation is FULL else "runtime_error")
    finally:
        for target in targets:
            if os.path.exists(target):
                os.remove(target)
    # writing inside the work dir is fine
    r = run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())", limits=FAST, isolation=isolation)
    assert (r.status, r.stdout) == ("ok", "ok\n")


@pytest.mark.parametrize(
    ("isolation", "expected"),
    [(FULL, {"violation", "runtime_error"}),  # hook (or, as root, the private /tmp hides it)
     (OS_ONLY, {"runtime_error"}),  # the private /tmp hides the file
     (Isolation(audit_hook=False, mount_namespace=False), {"runtime_error"})],  # the fresh uid may not read it
    ids=["full", "os-only", "uid-only"],
)
def test_reading_a_secret_file(tmp_path, isolation, expected):
    """The secret is also the expected output: a leak would make the test pass."""
    if isolation is not FULL and not ROOT:
        pytest.skip("kernel isolation layers need root here")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-41")
    secret.chmod(0o600)
    r = run_python(f"print(open({str(secret)!r}).read())", limits=FAST, isolation=isolation)
    assert r.status in expected
    assert "TOPSECRET" not in r.stdout + r.stderr + (r.error or "")


@needs_root
@pytest.mark.parametrize("isolation", [FULL, OS_ONLY], ids=["full", "os-only"])
def test_reading_root_only_files(isolation):
    """Outside /tmp: /etc/shadow (root-only) stays unreadable to the fresh uid."""
    if not os.path.exists("/etc/shadow"):
        pytest.skip("no /etc/shadow here")
    r = run_python("print(open('/etc/shadow').read())", limits=FAST, isolation=isolation)
    assert r.status == ("violation" if isolation is FULL else "runtime_error")
    assert "PermissionError" in r.error or isolation is FULL
    assert r.stdout == ""


def test_reading_world_readable_files_outside_is_denied_by_the_hook():
    r = run_python("print(open('/etc/passwd').read())", limits=FAST)
    assert r.status == "violation" and "reading /etc/passwd" in r.error


@pytest.mark.parametrize("isolation", [FULL, OS_ONLY], ids=["full", "os-only"])
def test_network(isolation):
    if isolation is OS_ONLY and not ROOT:
        pytest.skip("kernel isolation layers need root here")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        program = f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\ns.sendall(b'leak')\nprint('connected')"
        r = run_python(program, limits=FAST, isolation=isolation)
        assert r.status == ("violation" if isolation is FULL else "runtime_error")
        assert isolation is FULL or "Network is unreachable" in r.error
        assert "connected" not in r.stdout
        with pytest.raises(socket.timeout):
            server.accept()


@pytest.mark.parametrize("isolation", [FULL, OS_ONLY], ids=["full", "os-only"])
def test_killing_the_parent(isolation):
    if isolation is OS_ONLY and not ROOT:
        pytest.skip("kernel isolation layers need root here")
    for program in ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                    f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",
                    f"import os, signal\nos.killpg(os.getpgid({os.getpid()}), signal.SIGKILL)"):
        r = run_python(program, limits=FAST, isolation=isolation)
        assert r.status == ("violation" if isolation is FULL else "runtime_error"), program
    # kill(-1) reaches every process the sender may signal: for the fresh uid, only its own
    r = run_python("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('alive')", limits=FAST, isolation=isolation)
    assert r.status == ("violation" if isolation is FULL else "ok")
    # we are alive, and the sandbox still works
    assert run_python("print(2)", limits=FAST).stdout == "2\n"


def test_huge_output_is_cut_off():
    t0 = time.monotonic()
    r = run_python("import sys\nsys.stdout.write('x' * 100_000_000)", limits=FAST)
    assert r.status == "output_limit"
    assert len(r.stdout) <= FAST.stdout_bytes
    assert time.monotonic() - t0 < 10


def test_huge_file_is_cut_off():
    r = run_python("open('big', 'w').write('x' * (64 * 2 ** 20))", limits=SandboxLimits(cpu_time_s=2, file_size_mb=1))
    assert r.status == "output_limit"


def test_deep_recursion():
    r = run_python("def f(n):\n    return f(n + 1)\nf(0)", limits=FAST)
    assert (r.status, r.error.split(":")[0]) == ("runtime_error", "RecursionError")


def test_c_stack_overflow_kills_only_the_child():
    program = ("import sys, functools\nsys.setrecursionlimit(10 ** 8)\n"
               "def f(n):\n    return functools.reduce(lambda a, b: f(n + 1), [1, 2])\nf(0)")
    r = run_python(program, limits=FAST)
    assert (r.status, r.error) == ("runtime_error", "killed by SIGSEGV")


def test_unbounded_python_recursion_runs_out_of_time_or_memory():
    program = "import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n    return f(n + 1) + 1\nf(0)"
    assert run_python(program, limits=FAST).status in ("timeout", "memory_error")


@pytest.mark.parametrize("program", ["import ctypes\nctypes.CDLL(None).kill(1, 9)", "import subprocess\nsubprocess.run(['ls'])",
                                     "import os\nos.system('ls')"])
def test_escape_hatches_are_denied(program):
    r = run_python(program, limits=FAST, isolation=FULL)
    assert r.status == "violation"


def test_caught_violation_still_fails():
    program = "try:\n    open('/etc/passwd').read()\nexcept PermissionError:\n    pass\nprint('fine')"
    r = run_python(program, limits=FAST)
    assert r.status == "violation"


def test_runs_do_not_share_state():
    """Each run is a fresh fork of the zygote: fresh randomness, globals and modules."""
    program = "import random, math\nmath.pi = 3\nprint(random.random())"
    first, second = (run_python(program, limits=FAST) for _ in range(2))
    assert first.status == second.status == "ok"
    assert first.stdout != second.stdout
    assert run_python("import math\nprint(math.pi)", limits=FAST).stdout.startswith("3.14159")


def test_a_dead_zygote_is_replaced():
    from grpo_envs.sandbox import runner

    assert run_python("print(1)", limits=FAST).status == "ok"
    zygote = runner._zygote(Isolation())
    zygote.proc.kill()
    zygote.proc.wait()
    r = run_python("print(2)", limits=FAST)
    assert (r.status, r.stdout) == ("ok", "2\n")
    assert runner._zygote(Isolation()) is not zygote


def test_concurrent_runs_keep_their_own_io():
    from concurrent.futures import ThreadPoolExecutor

    program = "import sys\nn = int(sys.stdin.read())\nprint(n * n)"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda n: run_python(program, stdin=str(n), limits=FAST), range(12)))
    assert [r.stdout for r in results] == [f"{n * n}\n" for n in range(12)]
