"""Finding every process a worker started, wherever it went, and stopping it.

A worker's helpers do not stay in its process tree: one started in a session of its
own (a data service, a profiler) leaves it when the worker dies, and a daemon that
double-forked leaves it at once; both are reparented to the nearest child
subreaper, or init. So each worker carries a random token in its environment
(:data:`TOKEN_ENV`), which every process it starts inherits, and the token, not the
tree, says which processes are the worker's: :func:`sweep` finds them in ``/proc``
wherever they were reparented. A process that clears its environment, or that runs
as another user, is outside this net.

A pid is only signalled while it provably names a token carrier: through a pidfd
opened *before* the token is read, so if the process behind the pid changed the
check fails, or the signal reaches nobody (no recycled pid is ever signalled).
Without pidfds (Linux before 5.3) the process's start time is compared around the
check, which leaves a window of microseconds.

The ``rallypoint run`` agent also makes itself the workers' child subreaper
(:func:`become_subreaper`): orphans come back to it rather than to init, so it can
collect them when it stops them (``agent/workers.py``), and their pids stay theirs
until it does. Each process the agent starts is wrapped by :func:`die_with_agent`,
so the kernel kills it when the agent dies.

This module imports only the standard library: each group of workers' watchdog runs
it as a script, ``python -I -S _reaper.py FD`` (see :func:`watch`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import secrets
import select
import shutil
import signal
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass

TOKEN_ENV = "RALLYPOINT_WORKER_TOKEN"
_TOKEN_KEY = TOKEN_ENV.encode() + b"="
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
#: a SIGKILL sweep gives up after this many passes that still found new carriers
_MAX_PASSES = 50


# Sets the parent-death signal, then becomes the worker (same pid). Used only where
# util-linux's setpriv is missing. No preexec_fn: Python code between fork and exec
# deadlocks or aborts in a process whose other threads hold locks (gRPC's etcd
# client does), and it forces fork() where subprocess would otherwise use vfork().
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


@functools.cache
def _setpriv() -> str | None:
    return shutil.which("setpriv")


def die_with_agent(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped so the kernel SIGKILLs the worker when the agent dies (Linux)."""
    if sys.platform != "linux":
        return list(argv)
    setpriv = _setpriv()
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "KILL", "--", *argv]
    return [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]


def new_token() -> str:
    """A fresh worker token (128 random bits)."""
    return secrets.token_hex(16)


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux), so that
    orphans are reparented to it instead of init. False where it cannot be."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def is_subreaper() -> bool:
    """Whether this process is a child subreaper (see :func:`become_subreaper`)."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        ok = int(libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
    return ok and flag.value != 0


@dataclass(frozen=True)
class ProcStat:
    """What ``/proc/PID/stat`` says about a process."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    zombie: bool
    #: start time in clock ticks since boot: with the pid, names the process for good
    start: int


def proc_stat(pid: int) -> ProcStat | None:
    """``pid``'s stat, or None when there is no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            data = fp.read()
    except OSError:
        return None
    # The command name may contain anything, even ") ": the fields follow the last ")".
    fields = data[data.rindex(b")") + 2 :].split()
    return ProcStat(
        pid=pid,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        zombie=fields[0] in (b"Z", b"X"),
        start=int(fields[19]),
    )


def token_of(pid: int) -> str | None:
    """The worker token in ``pid``'s environment (None: none, gone, or unreadable;
    a zombie has no environment left)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fp:
            environ = fp.read()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(_TOKEN_KEY):
            return entry[len(_TOKEN_KEY) :].decode("ascii", errors="replace")
    return None


def _pids() -> list[int]:
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    return [int(name) for name in names if name.isdigit()]


def carriers(tokens: Collection[str]) -> list[int]:
    """Pids of the live processes (this one excepted) whose environment carries one
    of ``tokens``. A snapshot: check again before signalling (:func:`signal_carrier`)."""
    me = os.getpid()
    return [pid for pid in _pids() if pid != me and token_of(pid) in tokens]


def children(parent: int) -> list[ProcStat]:
    """The processes whose parent is ``parent`` now (zombies included)."""
    found = []
    for pid in _pids():
        stat = proc_stat(pid)
        if stat is not None and stat.ppid == parent:
            found.append(stat)
    return found


def signal_carrier(pid: int, tokens: Collection[str], sig: int) -> bool:
    """Send ``sig`` to ``pid`` if it is a live process carrying one of ``tokens``
    (see the module docstring for why this never signals a recycled pid).
    True: it was sent."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        return _signal_carrier_by_start(pid, tokens, sig)
    try:
        if token_of(pid) not in tokens:
            return False
        # The token was read from the pidfd's process if that process has not
        # exited since the pidfd was opened: the pid could not change owners.
        if select.select([pidfd], [], [], 0)[0]:
            return False
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        os.close(pidfd)


def _signal_carrier_by_start(pid: int, tokens: Collection[str], sig: int) -> bool:
    before = proc_stat(pid)
    if before is None or token_of(pid) not in tokens or proc_stat(pid) != before:
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
        return True
    return False


def sweep(
    tokens: Collection[str],
    sig: int = signal.SIGKILL,
    *,
    skip_pids: Collection[int] = (),
    skip_pgids: Collection[int] = (),
) -> set[tuple[int, int]]:
    """Send ``sig`` once to every process carrying one of ``tokens``, except those
    in ``skip_pids`` or whose process group is in ``skip_pgids`` (already
    signalled). With SIGKILL, sweep again until a pass finds no carrier it has not
    killed yet: a carrier may have started another one just before its end.
    Returns the (pid, start time) of every process signalled."""
    signalled: set[tuple[int, int]] = set()
    if not tokens:
        return signalled
    for _ in range(_MAX_PASSES if sig == signal.SIGKILL else 1):
        fresh = False
        for pid in carriers(tokens):
            stat = proc_stat(pid)
            if stat is None or (pid, stat.start) in signalled:
                continue
            if pid in skip_pids or stat.pgid in skip_pgids:
                continue
            if signal_carrier(pid, tokens, sig):
                signalled.add((pid, stat.start))
                fresh = True
        if not fresh:
            break
    return signalled


def watch(fd: int) -> None:
    """The watchdog of one group of workers (``agent/workers.py``): reads lines
    ``+PGID TOKEN`` (watch a worker) and ``-PGID`` (forget it) from ``fd``, whose
    write end only the agent holds. End of file with workers still watched means
    the agent died without stopping them (any death closes its descriptors): then
    every process carrying a watched token is SIGKILLed, wherever it went."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watched: dict[int, str] = {}
    rest = b""
    while True:
        data = os.read(fd, 4096)
        if not data:
            break
        *lines, rest = (rest + data).split(b"\n")
        for line in lines:
            words = line[1:].split()
            if line[:1] == b"+" and words:
                watched[int(words[0])] = words[1].decode() if len(words) > 1 else ""
            elif line[:1] == b"-" and words:
                watched.pop(int(words[0]), None)
    if not watched:
        return
    if os.path.isdir("/proc"):
        sweep({token for token in watched.values() if token})
        return
    for pgid in watched:  # no /proc to find the carriers in: the workers' groups
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
