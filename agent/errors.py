"""Worker errors: the ``@record`` decorator, the error file, and the failure report.

A worker entry point decorated with :func:`record` writes any exception it raises,
with its traceback, to the JSON file named by ``TORCHELASTIC_ERROR_FILE``. The file
has torch's layout (``{"message": {"message": ..., "extraInfo": {"py_callstack":
..., "timestamp": ...}}}``), so torch's tooling reads it too; rallypoint adds a
float ``time`` next to torch's whole-second ``timestamp`` to order failures that
happen within the same second.

The agent turns each failed worker into a :class:`ProcessFailure` and prints
:func:`format_failures`: the first failure (smallest timestamp) is the root cause.
"""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from rich.console import Console
from rich.table import Table

__all__ = [
    "ERROR_FILE_ENV",
    "AgentError",
    "ProcessFailure",
    "format_failures",
    "load_error_file",
    "read_error_file",
    "record",
    "write_error_file",
]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

_P = ParamSpec("_P")
_R = TypeVar("_R")


class AgentError(RuntimeError):
    """The agent could not run the job (bad rendezvous setup, closed job, ...)."""


def write_error_file(path: str, exc: BaseException) -> None:
    """Write ``exc`` and its traceback to ``path`` in torch's error-file layout.

    An existing file is kept: torch's rule is that the first writer (the root
    cause, e.g. a child process of the worker) wins.
    """
    if os.path.exists(path):
        return
    now = time.time()
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__)
                ),
                "timestamp": str(int(now)),
                "time": now,
            },
        }
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fp:
        json.dump(data, fp)
    os.replace(tmp, path)


def record(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a worker entry point so that an uncaught exception lands in the error file.

    Without ``TORCHELASTIC_ERROR_FILE`` in the environment (the function runs
    outside an agent) the exception simply propagates. ``SystemExit`` with code 0
    or None is a normal exit and is not recorded.
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (0, None):
                _record_exception(exc)
            raise
        except BaseException as exc:
            _record_exception(exc)
            raise

    return wrapper


def _record_exception(exc: BaseException) -> None:
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            write_error_file(path, exc)
        except OSError as err:
            # The original exception matters more than a failed report of it.
            print(f"rallypoint: could not write error file {path}: {err}", flush=True)


def load_error_file(path: str) -> Any:
    """The JSON content of an error file, as written; None if absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as fp:
            return json.load(fp)
    except (OSError, ValueError):
        return None


def read_error_file(path: str) -> tuple[str, str, float] | None:
    """Read ``(message, traceback, time)`` from an error file; None if absent or unreadable.

    Accepts torch's layout and its older flat ``{"message": str, "timestamp": int}``.
    """
    data = load_error_file(path)
    if not isinstance(data, dict):
        return None
    message = data.get("message")
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        text = str(message.get("message", "<no message>"))
        stack = str(extra.get("py_callstack", text))
        raw_time = extra.get("time", extra.get("timestamp", 0))
    else:
        text = str(message)
        stack = text
        raw_time = data.get("timestamp", 0)
    try:
        when = float(raw_time)
    except (TypeError, ValueError):
        when = 0.0
    return text, stack, when


@dataclass(frozen=True)
class ProcessFailure:
    """One failed worker: who, how it ended, and why if it recorded an error."""

    role: str
    local_rank: int
    global_rank: int
    pid: int
    exitcode: int
    time: float
    host: str
    message: str
    traceback: str
    error_file: str

    @classmethod
    def from_exit(
        cls,
        *,
        role: str,
        local_rank: int,
        global_rank: int,
        pid: int,
        exitcode: int,
        exit_time: float,
        error_file: str,
    ) -> ProcessFailure:
        """Build the failure of a worker that exited with ``exitcode`` (negative: signal)."""
        recorded = read_error_file(error_file)
        if recorded is not None:
            message, stack, when = recorded
            when = when or exit_time
        else:
            message, stack, when = describe_exit(exitcode), "", exit_time
        return cls(
            role=role,
            local_rank=local_rank,
            global_rank=global_rank,
            pid=pid,
            exitcode=exitcode,
            time=when,
            host=socket.gethostname(),
            message=message,
            traceback=stack,
            error_file=error_file if recorded is not None else "",
        )

    @property
    def signal_name(self) -> str:
        """The signal that ended the worker, or '' when it exited on its own."""
        return _signal_name(-self.exitcode) if self.exitcode < 0 else ""


def describe_exit(exitcode: int) -> str:
    """'exit code 3' or 'killed by SIGKILL' for a worker without an error file."""
    if exitcode < 0:
        return f"killed by {_signal_name(-exitcode)}"
    return f"exit code {exitcode}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def format_failures(name: str, failures: Sequence[ProcessFailure], width: int = 120) -> str:
    """A readable report: a table of every failure, root cause first, and its traceback."""
    ordered = sorted(failures, key=lambda f: f.time)
    table = Table(title=f"{name} FAILED", title_justify="left", show_lines=False)
    for column in ("", "time", "rank (local)", "host", "pid", "exit", "error"):
        table.add_column(column, overflow="fold")
    for index, failure in enumerate(ordered):
        exit_text = failure.signal_name or str(failure.exitcode)
        table.add_row(
            "root cause" if index == 0 else "",
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(failure.time))
            + f".{int((failure.time % 1) * 1000):03d}",
            f"{failure.global_rank} ({failure.local_rank})",
            failure.host,
            str(failure.pid),
            exit_text,
            failure.message,
        )
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=False, color_system=None)
    console.print(table)
    if ordered and ordered[0].traceback:
        root = ordered[0]
        console.print(f"Root cause (rank {root.global_rank}) traceback:")
        console.print(root.traceback.rstrip(), markup=False, highlight=False)
    elif ordered:
        console.print(
            "Root cause has no traceback: decorate the worker's entry point with "
            "rallypoint.agent.record to capture one."
        )
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"
