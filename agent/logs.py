"""The agent's log directory (a fresh, private directory per agent run) and
torch's agent events (:class:`EventLog`, ``--event-log-handler``).

Workers' output and error files go under ``<log_dir>/<run_id>_<random>/``. The
name is unpredictable and the directory is created (never reused) with mode 0700,
as ``tempfile.mkdtemp`` does: in a shared ``--log-dir`` such as ``/tmp``, nobody
else can create the path first (a symlink to a file of this user's, say) and so
make the workers' output land elsewhere, nor read it afterwards.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import socket
import string
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .config import ConfigError, LaunchConfig, Std
from .errors import load_error_file

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing import LogsDest

__all__ = [
    "EventLog",
    "EventStatus",
    "StartedWorker",
    "WorkerLogs",
    "console_prefix",
    "make_log_root",
    "worker_logs",
]

#: The part of the run id kept in the directory name: enough to recognise the run,
#: short enough for any file system's 255-byte name limit.
_NAME_RUN_ID_CHARS = 64


def make_log_root(log_dir: str | None, run_id: str) -> str:
    """Create this agent's log directory in ``log_dir`` (None: the temp directory).

    ``log_dir`` itself is created if missing, as torchrun does.

    Raises:
        ConfigError: ``log_dir`` is not a directory, or this user cannot create
            entries in it.
    """
    safe_run_id = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:_NAME_RUN_ID_CHARS]
    if log_dir is None:
        prefix = f"rallypoint_{safe_run_id}_"
    else:
        prefix = f"{safe_run_id}_"
        if os.path.lexists(log_dir) and not os.path.isdir(log_dir):
            raise ConfigError(f"--log-dir {log_dir!r} is not a directory")
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--log-dir {log_dir!r}: cannot create it: {exc.strerror}") from None
    try:
        return tempfile.mkdtemp(prefix=prefix, dir=log_dir)
    except OSError as exc:
        where = f"--log-dir {log_dir!r}" if log_dir is not None else "the temp directory"
        raise ConfigError(
            f"{where}: cannot create the run's log directory there: {exc.strerror}"
        ) from None


def console_prefix(template: str | None, role: str, rank: int, local_rank: int) -> str:
    """The prefix of a worker's teed console lines, as torchrun writes it.

    ``template`` (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``) is a
    ``string.Template`` over ``role_name``, ``rank`` (global) and ``local_rank``;
    unknown names stay as written. Without one: ``[<role><local rank>]:``.
    """
    if not template:
        return f"[{role}{local_rank}]:"
    return string.Template(template).safe_substitute(
        role_name=role, rank=rank, local_rank=local_rank
    )


@dataclass(frozen=True)
class WorkerLogs:
    """Where one worker's streams and error file go."""

    error_file: str
    redirect: Std
    tee: Std
    console: bool
    stdout_file: str
    stderr_file: str
    #: (filtered file, filters) of the stream's duplicated lines, or None.
    duplicate_stdout: tuple[str, tuple[str, ...]] | None = None
    duplicate_stderr: tuple[str, tuple[str, ...]] | None = None


def _fresh_file(path: str) -> None:
    # torch creates (or empties) each attempt's filtered file even if nothing matches.
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb"):
        pass


def worker_logs(
    config: LaunchConfig, attempt_dir: str, envs: Mapping[int, dict[str, str]]
) -> dict[int, WorkerLogs]:
    """Decide each worker's log files for one attempt and set its ``TORCHELASTIC_ERROR_FILE``.

    Without ``config.logs_specs``: ``attempt_dir/<local rank>/{stdout,stderr}.log``
    and ``error.json``, per ``redirects``, ``tee`` and ``local_ranks_filter``. With
    one, torch's ``LogsSpecs.reify`` decides (as under torchrun). Teed lines that
    match ``duplicate_*_filters`` also go to ``filtered_stdout.log`` /
    ``filtered_stderr.log`` (torch's names and place), for the ranks shown on the
    console.
    """
    out_filters = tuple(config.duplicate_stdout_filters or ())
    err_filters = tuple(config.duplicate_stderr_filters or ())
    dest: LogsDest | None = None
    if config.logs_specs is not None:
        dest = config.logs_specs.reify(dict(envs))
        filtered = (str(dest.filtered_stdout), str(dest.filtered_stderr))
    else:
        filtered = (
            os.path.join(attempt_dir, "filtered_stdout.log"),
            os.path.join(attempt_dir, "filtered_stderr.log"),
        )
    if out_filters:
        _fresh_file(filtered[0])
    if err_filters:
        _fresh_file(filtered[1])
    result: dict[int, WorkerLogs] = {}
    for local_rank, env in envs.items():
        if dest is not None:
            logs = _spec_logs(dest, local_rank)
        else:
            logs = _own_logs(config, attempt_dir, local_rank)
            env["TORCHELASTIC_ERROR_FILE"] = logs.error_file
        shown = logs.tee if logs.console else Std.NONE
        result[local_rank] = dataclasses.replace(
            logs,
            duplicate_stdout=_duplicate(filtered[0], out_filters, shown & Std.OUT),
            duplicate_stderr=_duplicate(filtered[1], err_filters, shown & Std.ERR),
        )
    return result


def _duplicate(
    path: str, filters: tuple[str, ...], shown: Std
) -> tuple[str, tuple[str, ...]] | None:
    """Where a stream's filtered lines go: only a stream shown on the console, and
    only with filters."""
    return (path, filters) if filters and shown else None


def _spec_logs(dest: LogsDest, local_rank: int) -> WorkerLogs:
    """A worker's files as torch's ``LogsSpecs`` decided them."""
    stdout_file = str(dest.stdouts.get(local_rank, ""))
    stderr_file = str(dest.stderrs.get(local_rank, ""))
    error_file = str(dest.error_files.get(local_rank, ""))
    if error_file == os.devnull:
        error_file = ""  # nothing to read back (and never a file to remove)
    return WorkerLogs(
        error_file=error_file,
        redirect=(Std.OUT if stdout_file else Std.NONE) | (Std.ERR if stderr_file else Std.NONE),
        tee=(Std.OUT if local_rank in dest.tee_stdouts else Std.NONE)
        | (Std.ERR if local_rank in dest.tee_stderrs else Std.NONE),
        console=True,  # the spec's own decision: unshown streams go to os.devnull
        stdout_file=stdout_file,
        stderr_file=stderr_file,
    )


def _own_logs(config: LaunchConfig, attempt_dir: str, local_rank: int) -> WorkerLogs:
    """A worker's files in rallypoint's layout, per the config's routing flags."""
    rank_dir = os.path.join(attempt_dir, str(local_rank))
    return WorkerLogs(
        error_file=os.path.join(rank_dir, "error.json"),
        redirect=config.redirects.get(local_rank, Std.NONE),
        tee=config.tee.get(local_rank, Std.NONE),
        console=config.local_ranks_filter is None or local_rank in config.local_ranks_filter,
        stdout_file=os.path.join(rank_dir, "stdout.log"),
        stderr_file=os.path.join(rank_dir, "stderr.log"),
    )


@dataclass(frozen=True)
class StartedWorker:
    """What an agent event says about one started worker."""

    local_rank: int
    global_rank: int
    role_rank: int
    role_world_size: int
    pid: int


class EventStatus(enum.Enum):
    """The states torch's agent events name (``torchelastic.worker.status.<state>``)."""

    START = "START"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    #: a worker the agent stopped because another failed
    TERMINATED = "TERMINATED"


#: What an event is about (torch's ``EventSource``).
_Source = Literal["WORKER", "AGENT"]


class EventLog:
    """torch's agent events (``--event-log-handler``), recorded through torch's handlers.

    The same events torchrun's agent records, with the same names and metadata:
    ``torchelastic.worker.status.START`` for each worker as it starts; when the run
    ends, one per worker of the last round (``SUCCEEDED``, ``FAILED``, or
    ``TERMINATED`` for a worker the agent stopped because another failed) and one for
    the agent (``SUCCEEDED`` when the agent's run completed, whatever its workers
    did; ``FAILED`` when it was interrupted or the rendezvous closed). torch's
    duration events (``RENDEZVOUS``, ``ASSIGN_WORKER_RANKS``) are not recorded.
    With the ``null`` handler nothing is built at all.
    """

    def __init__(
        self, destination: str, *, run_id: str, role: str, max_restarts: int, entry_point: str
    ) -> None:
        self.destination = destination
        self._run_id = run_id
        self._role = role
        self._max_restarts = max_restarts
        self._entry_point = entry_point
        self._backend = ""
        self._group_rank: int | None = None
        self._group_world_size: int | None = None
        self._restarts = 0
        self._started = time.monotonic()
        self.workers: list[StartedWorker] = []

    @property
    def enabled(self) -> bool:
        """Whether events go anywhere (torch's ``null`` handler drops them)."""
        return self.destination != "null"

    def workers_started(
        self,
        workers: Sequence[StartedWorker],
        *,
        group_rank: int,
        group_world_size: int,
        restarts: int,
        backend: str,
    ) -> None:
        """Record a ``START`` event per worker of a new round."""
        self.workers = list(workers)
        self._group_rank, self._group_world_size = group_rank, group_world_size
        self._restarts, self._backend = restarts, backend
        for worker in self.workers:
            self._record(EventStatus.START, "WORKER", worker)

    def finished(
        self,
        state: EventStatus | None,
        failures: Mapping[int, tuple[int, int, str]],
        *,
        restarts: int,
    ) -> None:
        """Record the end of the run.

        Args:
            state: SUCCEEDED or FAILED for a run that completed; None for one cut
                short (signal, closed rendezvous, error): then only the agent's
                event is recorded, as FAILED.
            failures: global rank -> (exit code, pid, error file) of failed workers.
            restarts: restarts spent.
        """
        self._restarts = restarts
        if state is not None:
            for worker in self.workers:
                failure = failures.get(worker.global_rank)
                if failure is None:
                    failed = state is EventStatus.FAILED
                    self._record(EventStatus.TERMINATED if failed else state, "WORKER", worker)
                else:
                    exit_code, pid, error_file = failure
                    self._record(
                        EventStatus.FAILED,
                        "WORKER",
                        worker,
                        raw_error=json.dumps(_error_data(error_file)),
                        exit_code=exit_code,
                        pid=pid,
                    )
        # torch: the agent's run SUCCEEDED when it completed, whatever its workers did.
        agent = EventStatus.FAILED if state is None else EventStatus.SUCCEEDED
        self._record(agent, "AGENT")

    def _record(
        self,
        state: EventStatus,
        source: _Source,
        worker: StartedWorker | None = None,
        *,
        raw_error: str | None = None,
        exit_code: int | None = None,
        pid: int | None = None,
    ) -> None:
        if not self.enabled:
            return
        from torch.distributed.elastic.events import api as events_api
        from torch.distributed.elastic.events import record

        extra: dict[str, Any] = {
            "group_world_size": self._group_world_size,
            "entry_point": self._entry_point,
        }
        if worker is not None:
            # torch's layout: one-element tuples, serialised as lists.
            extra.update(
                local_rank=[worker.local_rank],
                role_rank=[worker.role_rank],
                role_world_size=[worker.role_world_size],
                exit_code=[exit_code],
                worker_pid=[pid],
            )
        metadata: dict[str, Any] = {
            "run_id": self._run_id,
            "global_rank": worker.global_rank if worker else None,
            "group_rank": self._group_rank,
            "worker_id": str(worker.pid) if worker else None,
            "role": self._role,
            "hostname": socket.getfqdn(),
            "state": state.value,
            "total_run_time": int(time.monotonic() - self._started),
            "rdzv_backend": self._backend,
            "raw_error": raw_error,
            "metadata": json.dumps(extra),
            "agent_restarts": self._restarts,
            "duration_ms": None,
        }
        event = events_api.Event(
            name=f"torchelastic.worker.status.{state.value}",
            source=events_api.EventSource[source],
            metadata=metadata,
        )
        record(event, self.destination)


def _error_data(error_file: str) -> Any:
    # torch puts the worker's error file (or its placeholder) in raw_error.
    data = load_error_file(error_file)
    return {"message": "<NONE>"} if data is None else data
