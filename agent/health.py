"""The pre-flight health check: may this node take part in the round about to start?

Before its workers start in a round, a node can check itself (``--health-check``):

1. the user's *command*, if any (a shell command run with the round's environment;
   exit status 0 is healthy);
2. ``import torch`` and a small matrix product on each device of the node's kind
   (every visible CUDA device for ``"cuda"``, the CPU for ``"cpu"``), compared with
   the CPU's float64 result;
3. the user's *callable*, if any (``module:function`` or ``path.py:function``,
   called with no arguments; raising, exiting, or returning a false value other
   than None is unhealthy);
4. among several nodes, unless ``collective=False``: a small rendezvous on the
   round's ``MASTER_ADDR:MASTER_PORT``, where every node posts whether steps 1-3
   passed and group rank 0 posts a verdict, then, if every node came and passed,
   an all-reduce of ones through a fresh process group (NCCL on CUDA, gloo
   otherwise) whose sum must be the world size.

Steps 2-4 run in a fresh Python process (:mod:`rallypoint.agent.worker.health`)
and step 1 in a shell, each in a session of its own: a hung driver call, a
segfault in a CUDA library or a user check that never returns cannot take the
agent down or wedge it. At the deadline the process group and every descendant
are SIGKILLed, and the check reports a timeout.

The check's budget is ``timeout`` seconds, not counting the time it takes to start
the check process's Python and import torch. That import says nothing about the
node's devices or network, and where Python lives on a shared filesystem (NFS,
Lustre) it can take tens of seconds on a healthy node, so the budget's clock stops
while it runs, and the result reports it apart (:attr:`HealthResult.import_seconds`).
The import has an allowance of its own, ``import_timeout`` (300 s by default): a
node that cannot import torch within it (a hung mount) fails in stage ``torch``. Of
the budget, the local steps (1-3) get the first half, so a node that fails on its
own still reaches the rendezvous in time to *tell* its peers; rank 0 waits for the
others until three quarters of it; the collective gets the rest.

Blame. A failing check says whose fault it was (:attr:`HealthResult.fault`), so
that one sick node does not make its healthy peers exclude themselves:

* ``"self"``: a local step failed or hung here; this node should exclude itself.
* ``"peers"``: this node is fine, but the group ranks in :attr:`HealthResult.peers`
  failed their own checks or never came (they exclude themselves, or are gone):
  the round will change; this node should not start workers in it, nor exclude
  itself.
* ``"group"``: every node came and passed on its own, but the collective among
  them failed or hung (a network or fabric problem no single node can be blamed
  for), or the check's rendezvous itself could not be held.

:class:`FailureWindow` decides when workers that fail again and again make a node
exclude itself (``limit`` failures within ``window`` seconds).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import psutil

from . import _reaper
from .errors import describe_exit
from .worker.health import GROUP_STAGES, LOCAL_STAGES, SPEC_ENV

__all__ = [
    "LOCAL_SHARE",
    "RENDEZVOUS_SHARE",
    "STAGES",
    "FailureWindow",
    "Fault",
    "HealthCheckConfig",
    "HealthCheckConfigError",
    "HealthResult",
    "run_health_check",
]

#: Who a failed check blames (see the module docstring).
Fault = Literal["none", "self", "peers", "group"]

#: Every stage name a result can carry, in the order they run.
STAGES: tuple[str, ...] = (*LOCAL_STAGES, *GROUP_STAGES)

#: Share of ``timeout`` the local steps (command, matmul, callable) may use.
LOCAL_SHARE = 0.5
#: Rank 0 waits for every node's status until this share of ``timeout``.
RENDEZVOUS_SHARE = 0.75

_MIN_TIMEOUT = 1.0
_MAX_TIMEOUT = 7 * 24 * 3600.0
_POLL = 0.02
_TAIL_LINES = 6
_TAIL_CHARS = 600
logger = logging.getLogger("rallypoint.agent")
_CALLABLE = re.compile(
    r"^(?:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*|[^:\0]+\.py):[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$"
)


class HealthCheckConfigError(ValueError):
    """A health-check setting that cannot work; the message says which and why."""


def _check_seconds(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
        or value > _MAX_TIMEOUT
    ):
        raise HealthCheckConfigError(
            f"{name} must be a number of seconds in [{_MIN_TIMEOUT:g}, "
            f"{_MAX_TIMEOUT:g}] (a week), got {value!r}"
        )
    if value < _MIN_TIMEOUT:
        raise HealthCheckConfigError(
            f"{name} must be at least {_MIN_TIMEOUT:g} s (the check starts Python and "
            f"imports torch; 30-60 s suits most nodes), got {value!r}"
        )


@dataclass(frozen=True)
class HealthCheckConfig:
    """What the pre-flight health check runs. Validated on construction.

    Attributes:
        enabled: run the check at all (``--health-check``). False: every call
            passes at once, and a ``command`` or ``callable`` is an error.
        timeout: seconds the whole check may take, at least 1 and at most a week.
        command: a shell command run with the round's environment; exit 0 is
            healthy. None: no command.
        callable: ``module:function`` (or ``path/file.py:function``) called with
            no arguments in the check's process; raising, exiting, or returning a
            false value other than None is unhealthy. None: no callable.
        collective: with more than one node in the round, meet the other nodes and
            run an all-reduce among them.
        import_timeout: seconds the check process may take to start Python and
            import torch, apart from ``timeout`` (which does not count that time); a
            node slower than this fails in stage ``torch``. Same bounds as ``timeout``.
    """

    enabled: bool = False
    timeout: float = 60.0
    command: str | None = None
    callable: str | None = None
    collective: bool = True
    import_timeout: float = 300.0

    def __post_init__(self) -> None:
        for name in ("enabled", "collective"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise HealthCheckConfigError(f"{name} must be True or False, got {value!r}")
        for name in ("timeout", "import_timeout"):
            _check_seconds(name, getattr(self, name))
        command = self.command
        if command is not None:
            if not isinstance(command, str) or not command.strip():
                raise HealthCheckConfigError(
                    f"command must be a non-empty shell command, got {command!r}"
                )
            if "\0" in command:
                raise HealthCheckConfigError("command must not contain a NUL character")
        spec = self.callable
        if spec is not None:
            if not isinstance(spec, str):
                raise HealthCheckConfigError(
                    f"callable must be a string 'module:function', got {spec!r}"
                )
            if not _CALLABLE.match(spec):
                raise HealthCheckConfigError(
                    "callable must name a function as module:function (e.g. "
                    f"'mychecks.gpu:check') or path/file.py:function, got {spec!r}"
                )
        if not self.enabled:
            for name in ("command", "callable"):
                if getattr(self, name) is not None:
                    raise HealthCheckConfigError(
                        f"a health-check {name} is set but the health check is not enabled: "
                        f"enable it (enabled=True, --health-check) or drop the {name}"
                    )


@dataclass(frozen=True)
class HealthResult:
    """The outcome of one pre-flight health check.

    Attributes:
        ok: the node passed every stage it ran.
        reason: what passed (``ok``), or what failed and why, in one line.
        seconds: how long the check took, the import of torch included.
        stage: the stage that failed (one of :data:`STAGES`); ``""`` when ``ok``.
        fault: whom the failure blames: ``"none"`` when ok, else ``"self"``,
            ``"peers"`` or ``"group"`` (see the module docstring).
        peers: the group ranks blamed when ``fault == "peers"``, sorted.
        import_seconds: how long the check process took to start Python and import
            torch, which the check's budget does not count; None when it did not
            get that far (or did not run).
    """

    ok: bool
    reason: str
    seconds: float
    stage: str
    fault: Fault = "none"
    peers: tuple[int, ...] = ()
    import_seconds: float | None = None

    @property
    def exclude_self(self) -> bool:
        """True when this node should exclude itself: the failure is its own."""
        return self.fault == "self"


class FailureWindow:
    """Counts failures in a sliding time window (``--exclude-after``-style policies).

    Pure: the caller passes the time (any clock, in seconds). :meth:`record`
    returns True when the failure it records makes ``limit`` failures within the
    last ``window`` seconds (inclusive): the node should exclude itself. The
    window then starts empty, so the next exclusion needs ``limit`` new failures.
    """

    def __init__(self, limit: int, window: float) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise HealthCheckConfigError(f"limit must be an integer >= 1, got {limit!r}")
        if (
            isinstance(window, bool)
            or not isinstance(window, (int, float))
            or not math.isfinite(window)
            or window <= 0
        ):
            raise HealthCheckConfigError(
                f"window must be a positive, finite number of seconds, got {window!r}"
            )
        self.limit = limit
        self.window = float(window)
        self._times: deque[float] = deque()

    def _expire(self, now: float) -> None:
        # A clock that went back leaves newer-looking entries in place; they age
        # out once the clock passes them by more than the window.
        self._times = deque(t for t in self._times if now - t <= self.window)

    def count(self, now: float) -> int:
        """Failures recorded within ``window`` seconds before ``now``."""
        self._expire(now)
        return len(self._times)

    def record(self, now: float) -> bool:
        """Record a failure at ``now``; True when it makes ``limit`` within the window."""
        self._expire(now)
        self._times.append(now)
        if len(self._times) >= self.limit:
            self._times.clear()
            return True
        return False

    def reset(self) -> None:
        """Forget every recorded failure."""
        self._times.clear()


def run_health_check(
    config: HealthCheckConfig, *, round_env: Mapping[str, str], device: str
) -> HealthResult:
    """Run the pre-flight check of this node for the round described by ``round_env``.

    Args:
        config: what to run; a disabled check passes at once.
        round_env: the round's rendezvous for the check, as a worker would get it:
            ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` (this node's *group* rank) and
            ``WORLD_SIZE`` (the number of *nodes*); also added to the environment of
            the command, the callable and the check process (with ``RALLYPOINT_ROUND``,
            when given, separating rounds' keys). Only needed with ``collective``.
        device: ``"cuda"`` (every visible CUDA device), ``"cuda:N"`` or ``"cpu"``.

    Blocks for at most about ``config.timeout`` seconds plus the import of torch in
    the check process (itself cut off after ``config.import_timeout``), plus the
    moments it takes to kill and reap a process. If the caller is interrupted (an
    exception, such as from a signal handler), the check's processes are killed
    before it propagates.

    Raises:
        ValueError: ``round_env`` lacks or garbles a variable the collective needs.
    """
    started = time.monotonic()
    if not config.enabled:
        return HealthResult(True, "health check disabled", 0.0, "")
    world = _world_size(round_env) if config.collective else 1
    check = _Check(config, round_env, device, started)
    with tempfile.TemporaryDirectory(prefix="rallypoint-health-") as tmp:
        return check.run(tmp, world)


class _Check:
    """One run of the check: its budgets, its environment and what passed so far.

    :meth:`run` takes the steps in order: the user's command here, then the check
    process (torch, matmul, callable and the group stages), then the verdict from
    the process's status file or, when it left none, from how it ended.

    Two clocks run. The check's budget (``timeout``) counts from the start, less
    the time the check process took to start Python and import torch (known once
    it reports it); the import itself has an allowance of its own.
    """

    def __init__(
        self, config: HealthCheckConfig, round_env: Mapping[str, str], device: str, started: float
    ) -> None:
        self.config = config
        self.device = device
        self.started = started
        self.timeout = float(config.timeout)
        self.local_budget = LOCAL_SHARE * self.timeout
        self.import_budget = float(config.import_timeout)
        self.margin = min(2.0, max(0.25, 0.05 * self.timeout))
        self.wall = time.time()
        self.env = {**os.environ, **round_env}
        self.done: list[str] = []
        self.tmp = ""
        self.status_file = ""
        self.spawned = 0.0  # monotonic time the check process was started
        self.import_seconds: float | None = None
        self.stop = ""  # why the check process was stopped: "import", "local" or "deadline"

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def spent(self) -> float:
        """Seconds of the check's budget used so far: all but the import of torch."""
        return self.elapsed() - (self.import_seconds or 0.0)

    def failed(self, stage: str, reason: str, fault: Fault = "self") -> HealthResult:
        return HealthResult(
            False, reason, self.elapsed(), stage, fault, import_seconds=self.import_seconds
        )

    def run(self, tmp: str, world: int) -> HealthResult:
        """Every step, with ``tmp`` for the outputs and the status file."""
        self.tmp = tmp
        self.status_file = os.path.join(tmp, "status.jsonl")
        local_failure = self._run_command()
        if local_failure is not None and world == 1:
            return self.failed(local_failure["stage"], local_failure["reason"])
        run = self._run_worker(local_failure)
        result = self._judge(run, local_failure)
        self._log_import()
        return result

    def _run_command(self) -> dict[str, str] | None:
        """Run the user's command, if any: its failure as ``{"stage", "reason"}``, or None."""
        command = self.config.command
        if command is None:
            return None
        kill_at = self.started + self.local_budget
        run = _run(["/bin/sh", "-c", command], self.env, self.tmp, "command", kill_at)
        if run.error:
            return {"stage": "command", "reason": f"cannot run command: {run.error}"}
        if run.code is None:
            return {
                "stage": "command",
                "reason": f"command timed out after {self.local_budget:g} s (the local checks' "
                f"share of the {self.timeout:g} s health check){_tail(run.stderr)}",
            }
        if run.code != 0:
            return {
                "stage": "command",
                "reason": f"command failed ({describe_exit(run.code)})"
                f"{_tail(run.stderr) or _tail(run.stdout)}",
            }
        self.done.append("command")
        return None

    def _spec(self, local_failure: dict[str, str] | None) -> dict[str, object]:
        """The check process's instructions (see :mod:`.worker.health`). Its deadlines
        are wall-clock times as if the import took no time; the process moves them on
        by the time it took, as the watch here does with its own."""
        wall, timeout = self.wall, self.timeout
        return {
            "status_file": self.status_file,
            "device": self.device,
            "callable": self.config.callable,
            "collective": self.config.collective,
            "local_failure": local_failure,
            "timeout": timeout,
            "local_budget": self.local_budget,
            "margin": self.margin,
            "spawned": time.time(),
            "started": wall,
            "local_deadline": wall + self.local_budget,
            "rendezvous_deadline": wall + RENDEZVOUS_SHARE * timeout,
            "deadline": wall + timeout,
        }

    def _watch(self) -> bool:
        """Polled while the check process runs: True to stop it now, why in :attr:`stop`."""
        records = _records(self.status_file)
        if self.import_seconds is None:
            self.import_seconds = _imported(records)
        if self.import_seconds is None:
            if time.monotonic() - self.spawned > self.import_budget:
                self.stop = "import"
        elif self.spent() >= self.timeout:
            self.stop = "deadline"
        elif (
            self.spent() > self.local_budget + self.margin and _last_stage(records) in LOCAL_STAGES
        ):
            # Still in a local stage well past the local share: this node is stuck.
            self.stop = "local"
        return bool(self.stop)

    def _run_worker(self, local_failure: dict[str, str] | None) -> _Run:
        """Run the check process until it exits or the watch stops it."""
        argv = [sys.executable, "-m", "rallypoint.agent.worker.health"]
        spec = json.dumps(self._spec(local_failure))
        worker_env = {**self.env, SPEC_ENV: spec, "PYTHONUNBUFFERED": "1"}
        self.spawned = time.monotonic()
        # The watch stops it sooner; this bounds it even if the status file goes unread.
        kill_at = self.spawned + self.import_budget + self.timeout
        return _run(argv, worker_env, self.tmp, "check", kill_at, stop_early=self._watch)

    def _judge(self, run: _Run, local_failure: dict[str, str] | None) -> HealthResult:
        """The check's result from the process's result line, or from how it ended."""
        records = _records(self.status_file)
        if self.import_seconds is None:  # it may have exited between two polls
            self.import_seconds = _imported(records)
        stage = _last_stage(records) or "torch"
        if run.error:
            return self.failed(stage, f"cannot start the check process: {run.error}")
        result = _result(records)
        if result is not None:
            return self._reported(result)
        if local_failure is not None:
            # It only went on to tell its peers; its own failure is the news.
            return self.failed(local_failure["stage"], local_failure["reason"])
        return self._ended(run, stage)

    def _reported(self, result: dict[str, object]) -> HealthResult:
        """The result the check process wrote, with the command's pass in the summary."""
        ok = bool(result.get("ok"))
        done = self.done
        summary = ", ".join([*done, str(result["summary"])] if result.get("summary") else done)
        if self.import_seconds is not None:
            summary += (
                f" (importing torch took {self.import_seconds:.1f} s, not counted in the "
                f"{self.timeout:g} s budget)"
            )
        peers = result.get("peers")
        return HealthResult(
            ok,
            f"passed: {summary}" if ok else str(result.get("reason")),
            self.elapsed(),
            "" if ok else str(result.get("stage")),
            "none" if ok else _fault(result.get("fault")),
            tuple(int(p) for p in peers) if isinstance(peers, list) else (),
            self.import_seconds,
        )

    def _ended(self, run: _Run, stage: str) -> HealthResult:
        """The result of a check process that wrote none: stopped, or it died in ``stage``."""
        local = stage in LOCAL_STAGES
        if self.stop == "import":
            return self.failed(
                "torch",
                f"starting Python and importing torch took more than {self.import_budget:g} s "
                f"(its allowance, apart from the {self.timeout:g} s health check; a hung "
                f"filesystem?){_tail(run.stderr)}",
            )
        if self.stop == "local":
            return self.failed(
                stage,
                f"timed out after {self.local_budget:g} s in stage {stage} (the local checks' "
                f"share of the {self.timeout:g} s health check){_tail(run.stderr)}",
            )
        if run.code is None:
            return self.failed(
                stage,
                f"timed out after {self.timeout:g} s in stage {stage}{_tail(run.stderr)}",
                "self" if local else "group",
            )
        return self.failed(
            stage,
            f"the check process ended ({describe_exit(run.code)}) in stage {stage}"
            f"{_tail(run.stderr)}",
            "self" if local else "group",
        )

    def _log_import(self) -> None:
        took = self.import_seconds
        if took is None:
            return
        if took > self.local_budget:
            # It used to fail the check; it still slows every worker's start.
            logger.warning(
                "health check: importing torch took %.1f s, more than the local checks' "
                "%g s share of the %g s check; not counted against the check, but each "
                "worker pays it too (is Python on a slow or shared filesystem?)",
                took,
                self.local_budget,
                self.timeout,
            )
        else:
            logger.debug("health check: importing torch took %.1f s", took)


def _world_size(env: Mapping[str, str]) -> int:
    world = _int_var(env, "WORLD_SIZE", 1, None)
    _int_var(env, "RANK", 0, world - 1)
    if world > 1:
        if not env.get("MASTER_ADDR"):
            raise ValueError("round_env lacks MASTER_ADDR, the address of group rank 0")
        _int_var(env, "MASTER_PORT", 1, 65535)
    return world


def _int_var(env: Mapping[str, str], name: str, low: int, high: int | None) -> int:
    raw = env.get(name)
    if raw is None:
        raise ValueError(f"round_env lacks {name}")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"round_env {name} must be an integer, got {raw!r}") from None
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"round_env {name} must be {bound}, got {value}")
    return value


def _fault(value: object) -> Fault:
    if value == "self":
        return "self"
    if value == "peers":
        return "peers"
    return "group"


@dataclass(frozen=True)
class _Run:
    code: int | None  # None: killed at the deadline (or stopped early)
    stdout: str
    stderr: str
    error: str = ""  # it could not be started


def _run(
    argv: Sequence[str],
    env: Mapping[str, str],
    tmp: str,
    name: str,
    kill_at: float,
    stop_early: Callable[[], bool] | None = None,
) -> _Run:
    """Run ``argv`` in a session of its own until it exits or ``kill_at`` (monotonic).

    Whatever exits or not, its process group is SIGKILLed before it is reaped
    (leftover background jobs go too); at the deadline, also every descendant that
    left the group. ``stop_early``, a callable polled meanwhile, ends it sooner.
    """
    out_path = os.path.join(tmp, f"{name}.stdout")
    err_path = os.path.join(tmp, f"{name}.stderr")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        try:
            popen = subprocess.Popen(
                _reaper.die_with_agent(argv),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            return _Run(None, "", "", error=str(exc))
    code: int | None = None
    try:
        while True:
            code = _peek_exit(popen)
            if code is not None:
                break
            if time.monotonic() >= kill_at:
                break
            if stop_early is not None and stop_early():
                break
            time.sleep(_POLL)
    finally:
        _kill(popen, tree=code is None)
    return _Run(code, _read(out_path), _read(err_path))


def _peek_exit(popen: subprocess.Popen[bytes]) -> int | None:
    """Its exit code once it has exited, without reaping it: its pid, which names its
    process group, stays taken until :func:`_kill` has signalled that group."""
    if not hasattr(os, "waitid"):
        return popen.poll()
    try:
        info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return popen.poll()
    if info is None:
        return None
    return int(info.si_status) if info.si_code == os.CLD_EXITED else -int(info.si_status)


def _kill(popen: subprocess.Popen[bytes], *, tree: bool) -> None:
    descendants: list[psutil.Process] = []
    if tree:
        with contextlib.suppress(psutil.Error):
            descendants = psutil.Process(popen.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signal.SIGKILL)
    for proc in descendants:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    # A process stuck in the kernel (a wedged driver) may take a moment to die; the
    # check does not wait on it forever.
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=5)
    with contextlib.suppress(psutil.Error):
        psutil.wait_procs(descendants, timeout=2)


def _read(path: str) -> str:
    try:
        with open(path, "rb") as fp:
            fp.seek(0, os.SEEK_END)
            fp.seek(max(0, fp.tell() - 8 * _TAIL_CHARS))
            return fp.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _tail(text: str) -> str:
    """': line; line' from the last lines of ``text``, or '' when it is empty."""
    lines = [line.strip() for line in text.splitlines() if line.strip()][-_TAIL_LINES:]
    joined = "; ".join(lines)
    if len(joined) > _TAIL_CHARS:
        joined = "..." + joined[-_TAIL_CHARS:]
    return f": {joined}" if joined else ""


def _records(path: str) -> list[dict[str, object]]:
    try:
        with open(path, encoding="utf-8") as fp:
            lines = fp.read().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def _last_stage(records: list[dict[str, object]]) -> str:
    stages = [str(r["stage"]) for r in records if r.get("event") == "stage"]
    return stages[-1] if stages else ""


def _imported(records: list[dict[str, object]]) -> float | None:
    """Seconds the check process took to start and import torch, once it says."""
    for record in records:
        seconds = record.get("seconds")
        if record.get("event") == "imported" and isinstance(seconds, (int, float)):
            return max(0.0, float(seconds))
    return None


def _result(records: list[dict[str, object]]) -> dict[str, object] | None:
    results = [r for r in records if r.get("event") == "result"]
    return results[-1] if results else None
