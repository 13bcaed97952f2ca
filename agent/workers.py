"""Worker processes: start them, route their output, watch them, and stop them for good.

Each worker runs in its own session (``start_new_session=True``), so it leads a
process group the agent can signal as a whole: stopping a worker sends SIGTERM to
its group (and to any descendant that escaped it), waits a grace period, then
SIGKILLs whatever is left. On Linux each worker also asks the kernel to SIGKILL it
when the agent dies (``PR_SET_PDEATHSIG``, set by util-linux's ``setpriv`` just
before it execs the worker), so even a SIGKILLed agent leaves no worker behind.

What a worker starts is stopped with it, wherever it went: each worker carries a
random token in its environment that its descendants inherit, so a helper in a
session of its own or a double-forked daemon is found and stopped by its token even
after it left the worker's tree (``agent/_reaper.py``). ``rallypoint run`` makes the
agent the workers' child subreaper, so such orphans are reparented to the agent,
which collects them once they are stopped.

The parent-death signal reaches the worker only, not what the worker started (data
loader processes, a helper it launched): those would outlive a SIGKILLed agent. So
each started group of workers also has a *watchdog*, a tiny separate process in a
session of its own that holds the read end of a pipe whose write end only the agent
holds. The agent tells it each worker (process group and token) when it starts one
and tells it to forget them once they are stopped; when the pipe reaches end-of-file
while workers are still registered, the agent died without stopping them (any death,
even SIGKILL, closes its descriptors), and the watchdog SIGKILLs every process that
carries one of their tokens, checking each pid before it signals it.
An exited worker is only reaped once the watchdog has forgotten it
(:meth:`WorkerProcess.poll` looks at the exit without collecting it).

Output: per local rank and stream, ``redirect`` sends it to the attempt's log file
only, ``tee`` to the file and to the agent's console with torchrun's prefix
(``[<role><local rank>]:`` unless ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` says
otherwise).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

import psutil

from . import _reaper
from .config import Std
from .errors import ProcessFailure

__all__ = ["WorkerGroup", "WorkerLaunch", "WorkerProcess", "kill_tree"]

logger = logging.getLogger("rallypoint.agent")

# The watchdog of one group of workers (see the module docstring): a script that
# imports only the standard library, run with -I -S (no site imports, a few
# milliseconds); the agent does not wait for it to start (its lines wait in the pipe).
_WATCHDOG = _reaper.__file__


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
    #: log files of the redirected or teed streams ('': ``log_dir/stdout.log``, ...)
    stdout_file: str = ""
    stderr_file: str = ""
    #: (file, filters): teed lines containing a filter are also appended there, prefixed
    duplicate_stdout: tuple[str, tuple[str, ...]] | None = None
    duplicate_stderr: tuple[str, tuple[str, ...]] | None = None
    #: descriptors the worker inherits under the same numbers (a live worker's channel)
    pass_fds: tuple[int, ...] = ()


@dataclass
class WorkerProcess:
    """A started worker and where its output goes."""

    launch: WorkerLaunch
    popen: subprocess.Popen[bytes]
    start_time: float
    exit_time: float | None = None
    threads: list[threading.Thread] = field(default_factory=list)
    files: list[IO[bytes]] = field(default_factory=list)
    #: in the worker's environment, inherited by whatever it starts (agent/_reaper.py)
    token: str = ""

    @property
    def pid(self) -> int:
        """The worker's pid (also its process group and session id)."""
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while running.

        The exit is only looked at, not collected: an exited worker stays a zombie
        until :meth:`WorkerGroup.stop` reaps it, so its pid, which names its process
        group to the watchdog, cannot be given to an unrelated process before the
        watchdog has forgotten it.
        """
        code = self.popen.returncode
        if code is None:
            code = _peek_exit(self.popen)
        if code is not None and self.exit_time is None:
            self.exit_time = time.time()
        return code


def _peek_exit(popen: subprocess.Popen[bytes]) -> int | None:
    """``popen``'s exit code if it has exited, without reaping it (``WNOWAIT``)."""
    if not hasattr(os, "waitid"):
        return popen.poll()
    try:
        info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped
        return popen.poll()
    if info is None:
        return None
    return int(info.si_status) if info.si_code == os.CLD_EXITED else -int(info.si_status)


def _pump(
    source: IO[bytes],
    log: IO[bytes],
    console: IO[str] | None,
    prefix: str,
    duplicate: tuple[IO[bytes], tuple[str, ...]] | None = None,
) -> None:
    # Line by line so that prefixed console lines from different ranks interleave
    # whole; the file gets the raw bytes. Duplicated lines (torchrun's
    # --duplicate-*-filters) go, prefixed, to a file every rank appends to: one
    # unbuffered write per line, so lines from different ranks never mix.
    with source:
        for line in iter(source.readline, b""):
            log.write(line)
            log.flush()
            if console is None and duplicate is None:
                continue
            text = line.decode("utf-8", errors="replace")
            shown = f"{prefix}{text}" if text.endswith("\n") else f"{prefix}{text}\n"
            if console is not None:
                console.write(shown)
                console.flush()
            if duplicate is not None and any(needle in text for needle in duplicate[1]):
                duplicate[0].write(shown.encode("utf-8"))


class _Watchdog:
    """Kills the watched workers' process groups if the agent dies without stopping
    them (see the module docstring). POSIX only; one per started group of workers."""

    def __init__(self) -> None:
        read_end, self._fd = os.pipe()  # neither end is inherited by the workers
        try:
            self.popen: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-I", "-S", _WATCHDOG, str(read_end)],
                pass_fds=(read_end,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a signal to the agent's process group misses it
            )
        except OSError:
            os.close(self._fd)
            raise
        finally:
            os.close(read_end)

    def _send(self, line: str) -> None:
        # A line is far below PIPE_BUF: each write lands whole.
        with contextlib.suppress(OSError):  # the watchdog died: nothing more to do
            os.write(self._fd, line.encode())

    def watch(self, pgid: int, token: str) -> None:
        self._send(f"+{pgid} {token}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def close(self) -> None:
        """End the watchdog (it kills what the workers still watched started,
        normally none are)."""
        os.close(self._fd)
        popen, self.popen = self.popen, None
        if popen is not None:
            try:
                popen.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()


class WorkerGroup:
    """The workers of one attempt on this agent."""

    def __init__(self) -> None:
        self.workers: list[WorkerProcess] = []
        #: started processes that are not workers yet (warm spares): never polled,
        #: stopped with the group
        self.spares: list[WorkerProcess] = []
        self._watchdog: _Watchdog | None = None
        #: (pid, start time) of the workers' strays signalled and not yet collected:
        #: one that died of a forwarded signal is a zombie with no token left to show
        self._strays: set[tuple[int, int]] = set()
        #: held by stop() and fence(): a fence from the lease guard's thread never
        #: signals workers that stop() is reaping
        self._lock = threading.Lock()

    def start(self, launches: Sequence[WorkerLaunch]) -> None:
        """Start every worker; on a failed start, stop the ones already running and raise.

        Raises:
            OSError: a worker's program could not be executed (message names it).
        """
        try:
            self._ensure_watchdog()
            for launch in launches:
                worker = _start_one(launch)
                self.workers.append(worker)
                if self._watchdog is not None:
                    self._watchdog.watch(worker.pid, worker.token)
        except BaseException:
            self.stop(grace=0.0)
            raise

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None and os.name == "posix":
            try:
                self._watchdog = _Watchdog()
            except OSError as exc:
                logger.warning(
                    "cannot start the workers' watchdog (%s): processes the workers start "
                    "may outlive this agent if it is killed",
                    exc,
                )

    def start_spare(self, launch: WorkerLaunch, piped: Std = Std.NONE) -> WorkerProcess:
        """Start a process that becomes a worker later (:meth:`adopt`). Its streams
        in ``piped`` go to the agent, which tees them once it is adopted (it needs
        the worker's log files and prefix); the others stay on the console.

        Raises:
            OSError: its program could not be executed.
        """
        self._ensure_watchdog()
        spare = _start_one(launch, _Routes(streams={
            bit: subprocess.PIPE if piped & bit else None for bit in (Std.OUT, Std.ERR)
        }))  # fmt: skip
        self.spares.append(spare)
        if self._watchdog is not None:
            self._watchdog.watch(spare.pid, spare.token)
        return spare

    def adopt(self, spare: WorkerProcess, launch: WorkerLaunch) -> None:
        """Make ``spare`` the worker of ``launch`` (its local rank's current worker, if
        any, is stopped for good first)."""
        with self._lock:
            old = self.worker(launch.local_rank)
            if old is not None:
                self._reap([old], grace=0.0)
                self.workers.remove(old)
            self.spares.remove(spare)
            os.makedirs(launch.log_dir, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(launch.error_file)
            spare.launch = launch
            spare.start_time = time.time()
            # Its piped streams (the spare was started with the launch's tee) are
            # teed from now on, to this launch's files.
            routes = _route_streams(launch, only=launch.tee)
            spare.files.extend(routes.files)
            _start_pumps(spare, routes.pumps)
            self.workers.append(spare)

    def discard(self, spare: WorkerProcess) -> None:
        """Stop a spare that will not be adopted, for good (a spare the group
        stopped already, with its workers, is done with)."""
        with self._lock:
            if spare in self.spares:
                self._reap([spare], grace=0.0)
                self.spares.remove(spare)

    def worker(self, local_rank: int) -> WorkerProcess | None:
        """The current worker of ``local_rank`` (None: there is none)."""
        for worker in self.workers:
            if worker.launch.local_rank == local_rank:
                return worker
        return None

    def replace(self, launches: Sequence[WorkerLaunch]) -> None:
        """Start a worker for each of ``launches`` in place of its local rank's current
        one, if any, which is killed first if it still runs (the others keep running).

        Raises:
            OSError: a worker's program could not be executed.
        """
        with self._lock:
            for launch in launches:
                old = self.worker(launch.local_rank)
                if old is not None:
                    self._reap([old], grace=0.0)
                    self.workers.remove(old)
        self.start(launches)

    def kill(self, local_rank: int) -> None:
        """SIGKILL ``local_rank``'s worker tree now, without reaping it: :meth:`poll`
        then reports its exit (a worker found hung)."""
        with self._lock:
            worker = self.worker(local_rank)
            if worker is not None:
                _signal_tree(_tree(worker.pid, worker.token), signal.SIGKILL)

    def poll(self) -> dict[int, int | None]:
        """Exit code per local rank (None while the worker runs)."""
        return {w.launch.local_rank: w.poll() for w in self.workers}

    def failures(self, role: str, local_ranks: Sequence[int]) -> list[ProcessFailure]:
        """The failures of the workers of ``local_ranks`` (exited: see :meth:`poll`),
        root cause (the earliest) first."""
        by_rank = {w.launch.local_rank: w for w in self.workers}
        failures = []
        for local_rank in local_ranks:
            worker = by_rank[local_rank]
            code = worker.poll()
            failures.append(
                ProcessFailure.from_exit(
                    role=role,
                    local_rank=local_rank,
                    global_rank=worker.launch.global_rank,
                    pid=worker.pid,
                    exitcode=code if code is not None else 0,
                    exit_time=worker.exit_time or time.time(),
                    error_file=worker.launch.error_file,
                )
            )
        return sorted(failures, key=lambda f: f.time)

    def fence(self, grace: float) -> bool:
        """Stop every worker's process tree now (SIGTERM, up to ``grace`` s, then
        SIGKILL), from any thread, without reaping: :meth:`poll` then reports the
        exits and :meth:`stop` reaps them. False: there were no workers."""
        with self._lock:
            if not self.workers:
                return False
            self._kill_trees(grace, signal.SIGTERM)
            return True

    def stop(self, grace: float, sig: signal.Signals | None = signal.SIGTERM) -> None:
        """Send ``sig`` (SIGTERM unless given: a stop signal the agent received is
        forwarded, as torchrun does; None: they were sent one already, see
        :meth:`forward`) to every worker's process tree, wait up to ``grace`` s,
        then SIGKILL the rest."""
        with self._lock:
            self._stop(grace, sig)

    def forward(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every worker's process tree now, without waiting (a
        preempted agent lets them checkpoint while it leaves the rendezvous)."""
        with self._lock:
            trees = [_tree(w.pid, w.token) for w in self.workers]
            for tree in trees:
                _signal_tree(tree, sig)
            self._strays |= _signal_strays(trees, sig)

    def _kill_trees(
        self,
        grace: float,
        sig: signal.Signals | None,
        workers: Sequence[WorkerProcess] | None = None,
    ) -> None:
        """``sig`` to the process tree of each of ``workers`` (None: every worker), up
        to ``grace`` s for them to exit, then SIGKILL to what is left of the trees
        (nothing is reaped)."""
        chosen = self.workers if workers is None else workers
        trees = [_tree(w.pid, w.token) for w in chosen]
        for tree in trees:
            if sig is not None:
                _signal_tree(tree, sig)
        if sig is not None:
            self._strays |= _signal_strays(trees, sig)
        deadline = time.monotonic() + grace
        pause = 0.001
        while any(w.poll() is None for w in chosen):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.05)
        for tree in trees:
            _signal_tree(tree, signal.SIGKILL)
        killed = _signal_strays(trees, signal.SIGKILL)
        self._strays |= killed
        _collect_adopted(trees, self._strays, killed)

    def _stop(self, grace: float, sig: signal.Signals | None = signal.SIGTERM) -> None:
        if self.workers or self.spares:
            self._reap([*self.workers, *self.spares], grace, sig)
        self._close_watchdog()
        self.workers = []
        self.spares = []

    def _reap(
        self,
        workers: Sequence[WorkerProcess],
        grace: float,
        sig: signal.Signals | None = signal.SIGTERM,
    ) -> None:
        """Stop ``workers`` for good: kill their trees, then collect them."""
        self._kill_trees(grace, sig, workers)
        # Every group is killed: the watchdog forgets them before reaping frees the pids.
        if self._watchdog is not None:
            for worker in workers:
                self._watchdog.forget(worker.pid)
        for worker in workers:
            worker.popen.wait()
            worker.poll()
            for thread in worker.threads:
                # A pump ends at EOF, which an escaped grandchild holding the pipe
                # could delay; it is a daemon thread, so bound the wait.
                thread.join(timeout=1.0)
            for fp in worker.files:
                fp.close()

    def _close_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.close()

    @property
    def pids(self) -> list[int]:
        """Pids of the current workers."""
        return [w.pid for w in self.workers]


@dataclass
class _Tree:
    """A worker's process group and its descendants now; its token names the
    processes it started wherever they went (:func:`_signal_strays`)."""

    pgid: int
    members: list[psutil.Process]
    token: str = ""


def _tree(pid: int, token: str = "") -> _Tree:
    members: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    return _Tree(pgid=pid, members=members, token=token)


def _signal_tree(tree: _Tree, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(tree.pgid, sig)
    # Descendants that started their own session are outside the group.
    for proc in tree.members:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def _signal_strays(trees: Sequence[_Tree], sig: signal.Signals) -> set[tuple[int, int]]:
    """``sig`` to the processes the workers of ``trees`` started that left their
    trees (a helper whose parent died, a daemon), found by token in one sweep for
    all (SIGKILL: to every carrier, until none is left; any other signal: once, to
    the carriers that :func:`_signal_tree` did not reach). Returns the (pid, start
    time) of the processes signalled."""
    tokens = {tree.token for tree in trees if tree.token}
    if not tokens or sys.platform != "linux":
        return set()
    if sig == signal.SIGKILL:
        return _reaper.sweep(tokens)
    members = {proc.pid for tree in trees for proc in tree.members}
    return _reaper.sweep(tokens, sig, skip_pids=members, skip_pgids={t.pgid for t in trees})


def _collect_adopted(
    trees: Sequence[_Tree],
    strays: set[tuple[int, int]],
    killed: set[tuple[int, int]],
    bound: float = 5.0,
) -> None:
    """Reap the processes of ``trees`` that were reparented to this agent (its
    workers' child subreaper), waiting up to ``bound`` s for the ``killed`` ones to
    die; then forget the ``strays`` that are gone.

    A child is one of them if it is one of the ``strays`` signalled as token
    carriers (same pid and start time), or if it is in the session or process group
    of a worker not yet reaped (no other process can hold that id then; one still
    alive, which cleared its environment, is SIGKILLed here: as a child, its pid is
    its own until reaped). Any other child is left alone: its owner in this process
    reaps it. The workers themselves (each its group's and session's leader) are
    reaped by their :class:`subprocess.Popen`.
    """
    if _reaper.is_subreaper():
        _reap_adopted({tree.pgid for tree in trees}, strays, killed, bound)
    # Forget the strays that are gone (reaped here, or by a parent that outlived them).
    for pid, start in list(strays):
        stat = _reaper.proc_stat(pid)
        if stat is None or stat.start != start:
            strays.discard((pid, start))


def _reap_adopted(
    leaders: set[int], strays: set[tuple[int, int]], killed: set[tuple[int, int]], bound: float
) -> None:
    me = os.getpid()
    deadline = time.monotonic() + bound
    while True:
        dying = False
        for child in _reaper.children(me):
            if child.pid in leaders:
                continue
            identity = (child.pid, child.start)
            in_a_worker_session = child.sid in leaders or child.pgid in leaders
            if identity not in strays and not in_a_worker_session:
                continue
            if child.zombie:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child.pid, os.WNOHANG)
            elif in_a_worker_session:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
                dying = True
            elif identity in killed:
                dying = True  # SIGKILLed: gone in a moment
        if not dying or time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant it has now (also
    those that left the group: a new session, a daemon), with no chance to clean up
    (a host lost). The caller reaps ``pid`` if it is its child."""
    _signal_tree(_tree(pid), signal.SIGKILL)


#: A teed stream: which one, its log file, the console (None: not shown) and the
#: shared file its filtered lines are copied to, with the filters.
_Pump = tuple[Std, IO[bytes], IO[str] | None, tuple[IO[bytes], tuple[str, ...]] | None]


@dataclass
class _Routes:
    """Where a worker's streams go: what ``Popen`` gets per stream, the teed streams
    to pump, and the files this agent opened (closed by :meth:`WorkerGroup.stop`)."""

    streams: dict[Std, int | IO[bytes] | None] = field(default_factory=dict)
    pumps: list[_Pump] = field(default_factory=list)
    files: list[IO[bytes]] = field(default_factory=list)


def stream_targets(launch: WorkerLaunch) -> tuple[str | None, str | None]:
    """Where a process adopted as ``launch``'s worker points its stdout and stderr
    itself: a log file, ``os.devnull``, or None to leave the stream where it is (the
    agent's console, or, for a teed stream, the pipe the agent tees from: the spare
    was started with the launch's tee, see :meth:`WorkerGroup.start_spare`)."""
    targets: list[str | None] = []
    for bit, name, given_path in (
        (Std.OUT, "stdout", launch.stdout_file),
        (Std.ERR, "stderr", launch.stderr_file),
    ):
        if launch.tee & bit:
            targets.append(None)
        elif launch.redirect & bit:
            targets.append(given_path or os.path.join(launch.log_dir, f"{name}.log"))
        elif not launch.console:
            targets.append(os.devnull)
        else:
            targets.append(None)
    return targets[0], targets[1]


def _route_streams(launch: WorkerLaunch, only: Std = Std.ALL) -> _Routes:
    """Where ``launch``'s streams go (those in ``only``): opens its log files."""
    routes = _Routes()
    for bit, name, console, given_path, duplicate in (
        (Std.OUT, "stdout", sys.stdout, launch.stdout_file, launch.duplicate_stdout),
        (Std.ERR, "stderr", sys.stderr, launch.stderr_file, launch.duplicate_stderr),
    ):
        if not only & bit:
            continue
        path = given_path or os.path.join(launch.log_dir, f"{name}.log")
        log: IO[bytes]
        # The files outlive this function: WorkerGroup.stop closes them.
        if launch.tee & bit:
            log = open(path, "wb")  # noqa: SIM115
            routes.files.append(log)
            routes.streams[bit] = subprocess.PIPE
            copy: tuple[IO[bytes], tuple[str, ...]] | None = None
            if duplicate is not None:
                shared: IO[bytes] = open(duplicate[0], "ab", buffering=0)  # noqa: SIM115
                routes.files.append(shared)
                copy = (shared, duplicate[1])
            routes.pumps.append((bit, log, console if launch.console else None, copy))
        elif launch.redirect & bit:
            log = open(path, "wb")  # noqa: SIM115
            routes.files.append(log)
            routes.streams[bit] = log
        elif not launch.console:
            routes.streams[bit] = subprocess.DEVNULL
        else:
            routes.streams[bit] = None
    return routes


def _start_one(launch: WorkerLaunch, routes: _Routes | None = None) -> WorkerProcess:
    """Start ``launch``'s process, its streams routed as ``routes`` says (None: as
    the launch says)."""
    os.makedirs(launch.log_dir, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(launch.error_file)
    if routes is None:
        routes = _route_streams(launch)
    token = _reaper.new_token()
    try:
        popen = subprocess.Popen(
            _reaper.die_with_agent(launch.argv),
            env={**launch.env, _reaper.TOKEN_ENV: token},
            stdin=subprocess.DEVNULL,
            stdout=routes.streams[Std.OUT],
            stderr=routes.streams[Std.ERR],
            start_new_session=True,
            pass_fds=launch.pass_fds,
        )
    except OSError as exc:
        for fp in routes.files:
            fp.close()
        raise OSError(exc.errno, f"cannot start worker {launch.argv[0]!r}: {exc.strerror}") from exc
    worker = WorkerProcess(
        launch=launch, popen=popen, start_time=time.time(), files=routes.files, token=token
    )
    _start_pumps(worker, routes.pumps)
    return worker


def _start_pumps(worker: WorkerProcess, pumps: Sequence[_Pump]) -> None:
    """Tee ``worker``'s piped streams (its launch's prefix and rank)."""
    launch = worker.launch
    for bit, log, sink, copy in pumps:
        source = worker.popen.stdout if bit == Std.OUT else worker.popen.stderr
        assert source is not None  # PIPE was requested for this stream
        thread = threading.Thread(
            target=_pump,
            args=(source, log, sink, launch.prefix, copy),
            name=f"rallypoint-tee-{launch.global_rank}-{bit.name}",
            daemon=True,
        )
        thread.start()
        worker.threads.append(thread)
