"""Run a Python function on every worker of an elastic job: ``elastic_launch``.

Like torch's ``torch.distributed.launcher.api.elastic_launch``::

    results = elastic_launch(config, train)(epochs, lr=0.1)  # {global rank: return value}

Each worker is a fresh interpreter (``python -m rallypoint.agent.worker.function``)
that imports the function by name and calls it. Arguments and return values must
be JSON-serialisable: they travel as JSON, never pickle. The function must be
importable: defined at module top level, in a module or in a script file.
A failure beyond ``max_restarts`` raises :class:`WorkerFailedError`, which is also
torch's ``ChildFailedError``: code written for torch's ``elastic_launch`` catches it
unchanged.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure as TorchFailure
from torch.distributed.elastic.rendezvous import RendezvousHandler

from .agent import AgentState, ElasticAgent, RunResult
from .config import ConfigError, LaunchConfig
from .errors import AgentError, ProcessFailure
from .logs import EventStatus
from .rendezvous import build_handler
from .worker.function import ARGS_ENV, FUNCTION_ENV

__all__ = ["WorkerFailedError", "elastic_launch", "function_spec", "record_end"]


class WorkerFailedError(AgentError, ChildFailedError):
    """The workers failed more often than ``max_restarts`` allows.

    Also torch's ``ChildFailedError``, so code written for torch's ``elastic_launch``
    catches it unchanged: ``failures`` maps each failed worker's global rank to
    torch's ``ProcessFailure`` (read from the same error file), and
    ``get_first_failure()`` and ``format_msg()`` work as in torch; torch's ``@record``
    copies the root cause's error file up, as it does for torch's launcher.
    ``worker_failures`` holds rallypoint's view of the same failures, root cause
    first (the failure table of :func:`rallypoint.agent.errors.format_failures`).
    """

    def __init__(self, name: str, failures: Sequence[ProcessFailure]) -> None:
        self.name = name
        self.worker_failures = sorted(failures, key=lambda f: f.time)
        self.failures: dict[int, TorchFailure] = {}
        for failure in self.worker_failures:
            torch_view = TorchFailure(
                local_rank=failure.local_rank,
                pid=failure.pid,
                exitcode=failure.exitcode,
                error_file=failure.error_file,
            )
            # The same root cause as rallypoint's table (torch keeps whole seconds).
            torch_view.timestamp = int(failure.time)
            self.failures.setdefault(failure.global_rank, torch_view)
        first = self.worker_failures[0] if self.worker_failures else None
        summary = f"{name} failed"
        if first is not None:
            summary += f": rank {first.global_rank} ({first.message})"
        # torch's constructor would replace this one-line summary with its report.
        AgentError.__init__(self, summary)


def function_spec(fn: Callable[..., Any]) -> str:
    """``module:qualname`` (or ``file.py:qualname`` for a script) naming ``fn``.

    Raises:
        ConfigError: ``fn`` is a lambda, a nested function, or has no importable home.
    """
    qualname = getattr(fn, "__qualname__", "")
    module_name = getattr(fn, "__module__", None)
    if not qualname or "<" in qualname or module_name is None:
        raise ConfigError(
            f"{fn!r} cannot be launched: use a function defined at the top level of a module"
        )
    if module_name == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        # Workers load the function from this file. Code read from stdin has none
        # (its __file__ is "<stdin>"), nor has -c's or an interactive session's.
        if not path or not os.path.isfile(path):
            raise ConfigError(
                f"{qualname} cannot be launched: workers import the function from its file, "
                "so define it in a module or a script file, not in code read from stdin, "
                "-c or an interactive session"
            )
        return f"{os.path.abspath(path)}:{qualname}"
    return f"{module_name}:{qualname}"


def elastic_launch(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    *,
    handler: RendezvousHandler | None = None,
) -> Callable[..., dict[int, Any]]:
    """Return a callable that runs ``entrypoint`` on this node's workers and waits.

    Args:
        config: the launch configuration.
        entrypoint: a top-level Python function, or a program path (then the
            arguments are its command-line arguments and results are None).
        handler: a rendezvous handler; by default built from ``config``.

    The returned callable takes the function's arguments and returns
    ``{global rank: return value}`` for this node's workers.

    Raises:
        WorkerFailedError: the workers failed more than ``config.max_restarts`` times
            (also torch's ``ChildFailedError``).
        AgentError: the rendezvous closed, or the agent was interrupted.
    """

    def launch(*args: Any, **kwargs: Any) -> dict[int, Any]:
        is_function = callable(entrypoint)
        if is_function:
            assert callable(entrypoint)
            try:
                payload = json.dumps({"args": list(args), "kwargs": kwargs})
            except TypeError as exc:
                raise ConfigError(f"arguments must be JSON-serialisable: {exc}") from None
            config.env[FUNCTION_ENV] = function_spec(entrypoint)
            config.env[ARGS_ENV] = payload
            argv = [sys.executable, "-u", "-m", "rallypoint.agent.worker.function"]
        else:
            if kwargs:
                raise ConfigError("a program entry point takes positional arguments only")
            argv = [str(entrypoint), *map(str, args)]
        agent = ElasticAgent(
            config, argv, handler or build_handler(config), return_values=is_function
        )
        try:
            result = agent.run()
        except Exception:
            record_end(agent, None)
            raise
        record_end(agent, result)
        return _results(result, entrypoint)

    return launch


def record_end(agent: ElasticAgent, result: RunResult | None) -> None:
    """Record torch's end-of-run events (``--event-log-handler``) for ``agent``'s run
    (``result`` None: the run raised)."""
    if not agent.events.enabled:
        return
    state = _EVENT_STATES.get(result.state) if result is not None else None
    failed = result.failures if state is EventStatus.FAILED and result is not None else []
    failures = {f.global_rank: (f.exitcode, f.pid, f.error_file) for f in failed}
    agent.events.finished(state, failures, restarts=agent.restarts_spent)


#: The runs that completed, as torch's events name them; the others were cut short.
_EVENT_STATES = {AgentState.SUCCEEDED: EventStatus.SUCCEEDED, AgentState.FAILED: EventStatus.FAILED}


def _results(result: RunResult, entrypoint: Callable[..., Any] | str) -> dict[int, Any]:
    name = entrypoint if isinstance(entrypoint, str) else function_spec(entrypoint)
    if result.state is AgentState.FAILED:
        raise WorkerFailedError(name, result.failures)
    if result.state is not AgentState.SUCCEEDED:
        raise AgentError(f"{name}: {result.message}")
    values: dict[int, Any] = {}
    for rank, path in result.return_files.items():
        try:
            with open(path, encoding="utf-8") as fp:
                values[rank] = json.load(fp)
        except FileNotFoundError:
            values[rank] = None
    return values
