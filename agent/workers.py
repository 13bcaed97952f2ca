"""Worker processes: start them, route their output, watch them, and stop them for good.

Each worker runs in its own session (``start_new_session=True``), so it leads a
process group the agent can signal as a whole: stopping a worker sends SIGTERM to
its group (and to any descendant that escaped it), waits a grace period, then
SIGKILLs whatever is left. On Linux each worker also asks the kernel to SIGKILL it
when the agent dies (``PR_SET_PDEATHSIG``, set by util-linux's ``setpriv`` just
before it execs the worker), so even a SIGKILLed agent leaves no worker behind.

Output: per local rank and stream, ``redirect`` sends it to the attempt's log file
only, ``tee`` to the file and to the agent's console with a ``[role/rank]`` prefix.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

import psutil

from .config import Std

__all__ = ["WorkerGroup", "WorkerLaunch", "WorkerProcess", "die_with_agent", "kill_tree"]

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


@dataclass(frozen=True)
class WorkerLaunch:
    """How to start one worker: its command, environment and output routing."""

    local_rank: int
    global_rank: int
    argv: Sequence[str]
    env: Mapping[str, str]
    log_dir: str
    error_file: str
    redirect: Std = Std.NONE
    tee: Std = Std.NONE
    console: bool = True
    prefix: str = ""


@dataclass
class WorkerProcess:
    """A started worker and where its output goes."""

    launch: WorkerLaunch
    popen: subprocess.Popen[bytes]
    start_time: float
    exit_time: float | None = None
    threads: list[threading.Thread] = field(default_factory=list)
    files: list[IO[bytes]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """The worker's pid (also its process group and session id)."""
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while running."""
        code = self.popen.poll()
        if code is not None and self.exit_time is None:
            self.exit_time = time.time()
        return code


def _pump(source: IO[bytes], log: IO[bytes], console: IO[str] | None, prefix: str) -> None:
    # Line by line so that prefixed console lines from different ranks interleave
    # whole; the file gets the raw bytes.
    with source:
        for line in iter(source.readline, b""):
            log.write(line)
            log.flush()
            if console is not None:
                text = line.decode("utf-8", errors="replace")
                console.write(f"{prefix}{text}" if text.endswith("\n") else f"{prefix}{text}\n")
                console.flush()


class WorkerGroup:
    """The workers of one attempt on this agent."""

    def __init__(self) -> None:
        self.workers: list[WorkerProcess] = []

    def start(self, launches: Sequence[WorkerLaunch]) -> None:
        """Start every worker; on a failed start, stop the ones already running and raise.

        Raises:
            OSError: a worker's program could not be executed (message names it).
        """
        try:
            for launch in launches:
                self.workers.append(_start_one(launch))
        except BaseException:
            self.stop(grace=0.0)
            raise

    def poll(self) -> dict[int, int | None]:
        """Exit code per local rank (None while the worker runs)."""
        return {w.launch.local_rank: w.poll() for w in self.workers}

    def stop(self, grace: float) -> None:
        """SIGTERM every worker's process tree, wait up to ``grace`` s, then SIGKILL the rest."""
        if not self.workers:
            return
        trees = [_tree(w.pid) for w in self.workers]
        for tree in trees:
            _signal_tree(tree, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for worker in self.workers:
            remaining = deadline - time.monotonic()
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.popen.wait(timeout=max(remaining, 0.0))
        for tree in trees:
            _signal_tree(tree, signal.SIGKILL)
        for worker in self.workers:
            worker.popen.wait()
            worker.poll()
            for thread in worker.threads:
                # A pump ends at EOF, which an escaped grandchild holding the pipe
                # could delay; it is a daemon thread, so bound the wait.
                thread.join(timeout=1.0)
            for fp in worker.files:
                fp.close()
        self.workers = []

    @property
    def pids(self) -> list[int]:
        """Pids of the current workers."""
        return [w.pid for w in self.workers]


@dataclass
class _Tree:
    pgid: int
    members: list[psutil.Process]


def _tree(pid: int) -> _Tree:
    members: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    return _Tree(pgid=pid, members=members)


def _signal_tree(tree: _Tree, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(tree.pgid, sig)
    # Descendants that started their own session are outside the group.
    for proc in tree.members:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def kill_tree(pid: int, grace: float = 0.0) -> None:
    """SIGTERM ``pid``'s process group and descendants, then SIGKILL after ``grace``."""
    tree = _tree(pid)
    _signal_tree(tree, signal.SIGTERM)
    with contextlib.suppress(psutil.Error):
        psutil.wait_procs(tree.members, timeout=grace)
    _signal_tree(tree, signal.SIGKILL)


def _start_one(launch: WorkerLaunch) -> WorkerProcess:
    os.makedirs(launch.log_dir, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(launch.error_file)
    files: list[IO[bytes]] = []
    pumps: list[tuple[Std, IO[bytes], IO[str] | None]] = []
    streams: dict[Std, int | IO[bytes] | None] = {}
    routes: tuple[tuple[Std, str, IO[str]], ...] = (
        (Std.OUT, "stdout", sys.stdout),
        (Std.ERR, "stderr", sys.stderr),
    )
    for bit, name, console in routes:
        path = os.path.join(launch.log_dir, f"{name}.log")
        log: IO[bytes]
        # The files outlive this function: WorkerGroup.stop closes them.
        if launch.tee & bit:
            log = open(path, "wb")  # noqa: SIM115
            files.append(log)
            streams[bit] = subprocess.PIPE
            pumps.append((bit, log, console if launch.console else None))
        elif launch.redirect & bit:
            log = open(path, "wb")  # noqa: SIM115
            files.append(log)
            streams[bit] = log
        elif not launch.console:
            streams[bit] = subprocess.DEVNULL
        else:
            streams[bit] = None
    try:
        popen = subprocess.Popen(
            die_with_agent(launch.argv),
            env=dict(launch.env),
            stdin=subprocess.DEVNULL,
            stdout=streams[Std.OUT],
            stderr=streams[Std.ERR],
            start_new_session=True,
        )
    except OSError as exc:
        for fp in files:
            fp.close()
        raise OSError(exc.errno, f"cannot start worker {launch.argv[0]!r}: {exc.strerror}") from exc
    worker = WorkerProcess(launch=launch, popen=popen, start_time=time.time(), files=files)
    for bit, log, sink in pumps:
        source = popen.stdout if bit == Std.OUT else popen.stderr
        assert source is not None  # PIPE was requested for this stream
        thread = threading.Thread(
            target=_pump,
            args=(source, log, sink, launch.prefix),
            name=f"rallypoint-tee-{launch.global_rank}-{bit.name}",
            daemon=True,
        )
        thread.start()
        worker.threads.append(thread)
    return worker
