"""Sandboxed execution of untrusted Python (model-written solutions).

Each run is a fresh process in its own session and process group, forked from a pre-loaded
zygote (one per host process, started on first use; see ``child.py``), with a scrubbed
environment, stdin from a file, stdout/stderr read by the parent under a size cap, and a hard
wall-clock deadline after which the whole group is killed. The zygote only saves start-up time
(~100 ms of imports per run); every isolation layer is applied per run, after the fork. Inside, before the solution's first
line, the child applies the layers below; each is used where the machine allows it, the
result says which were in place (``SandboxResult.isolation``), and ``Isolation.require``
makes any of them mandatory.

What is contained, and how (OS level = enforced by the kernel, Python level = audit hook):

=====================  =====================================================================
infinite loop          RLIMIT_CPU (SIGXCPU) and the parent's wall-clock kill → ``timeout``
memory bomb            RLIMIT_AS → MemoryError → ``memory_error``
fork bomb / processes  audit hook denies fork/exec/subprocess/posix_spawn (``violation``);
                       OS level: RLIMIT_NPROC on the run's own fresh uid, and every process of
                       that uid is killed when the run ends, even ones that left the group
huge output            parent stops reading at ``stdout_bytes`` and kills → ``output_limit``;
                       RLIMIT_FSIZE caps files
network                new network namespace: no interfaces, loopback down (OS level);
                       audit hook denies socket creation/connect/bind/DNS
signals (os.kill of    fresh uid: the kernel refuses signals to other users' processes;
the parent, kill -1)   audit hook denies os.kill/killpg of any other pid
writing outside        fresh uid: only world-writable places are writable, and the mount
the work dir           namespace replaces /tmp, /var/tmp and /dev/shm by private tmpfs mounts
                       (/tmp, size-limited, is the work dir); audit hook denies writes, renames,
                       deletes, chmod... outside the work dir
reading other files    fresh uid: files not readable by "others" (mode 0600, 0700 dirs such as
                       /root) are unreadable; private tmpfs hides the host's /tmp. Audit hook
                       denies reads outside the work dir, Python's own install and a few
                       /dev and zoneinfo files
deep recursion         RecursionError, or a C stack overflow (SIGSEGV) of the child only
                       → ``runtime_error``
=====================  =====================================================================

Guarantee: with the kernel layers (root, or a container with CAP_SYS_ADMIN — this is the case
on the project's machines) the solution cannot signal, read non-world-readable files of,
write into, or reach over the network any other process on the machine, and its CPU, memory,
processes, files and output are bounded. World-readable files (e.g. /etc/passwd, world-readable
source trees) are readable at OS level; only the audit hook blocks those, and an audit hook is
not a security boundary on its own (CPython documents it as such; ctypes, cffi, mmap and
_posixsubprocess are denied to close the obvious bypasses). Without root, only the network
namespace (via a user namespace, where allowed), the rlimits, the process-group kill and the
audit hook apply; RLIMIT_NPROC then counts all of the host user's tasks.
"""

from grpo_envs.sandbox.runner import DEFAULT_PRELOAD, STATUSES, Isolation, SandboxLimits, SandboxResult, run_python

__all__ = ["DEFAULT_PRELOAD", "STATUSES", "Isolation", "SandboxLimits", "SandboxResult", "run_python"]
