"""The worker side of :func:`rallypoint.agent.elastic_launch` for Python functions.

Run as ``python -m rallypoint.agent.worker.function``: imports the function named
by ``RALLYPOINT_FUNCTION`` (``module:qualname``, or ``/path/file.py:qualname`` for
a script's function), calls it with the JSON arguments in ``RALLYPOINT_ARGS``, and
writes its JSON-encoded return value to ``RALLYPOINT_RETURN_FILE``. Arguments and
results travel as JSON, never pickle.

:func:`run_path` is ``--run-path``'s worker: the script run as ``__main__`` with
``runpy`` in the same kind of interpreter.

Both end the way torch's function workers end: once the function (or script)
returns or raises, the worker records its outcome (return value, error file),
waits for its non-daemon threads, runs the ``atexit`` handlers, flushes its
streams and leaves with ``os._exit``. Interpreter finalization and C++ static
destructors never run, so a process group the code left undestroyed cannot abort
the finished worker at exit (gloo's teardown race: "terminate called without an
active exception", SIGABRT) and turn a finished job into a failed one.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import json
import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ..errors import record

FUNCTION_ENV = "RALLYPOINT_FUNCTION"
ARGS_ENV = "RALLYPOINT_ARGS"
RETURN_ENV = "RALLYPOINT_RETURN_FILE"


def load_function(spec: str) -> Callable[..., Any]:
    """Import ``module:qualname`` or ``path.py:qualname``.

    Raises:
        ImportError: the module or file cannot be loaded, or lacks the name.
    """
    location, _, qualname = spec.rpartition(":")
    if location.endswith(".py"):
        # Loaded under its own name, not __main__, so the script's main guard
        # does not run again in every worker.
        name = f"_rallypoint_entry_{os.path.splitext(os.path.basename(location))[0]}"
        file_spec = importlib.util.spec_from_file_location(name, location)
        if file_spec is None or file_spec.loader is None:
            raise ImportError(f"cannot load {location}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[name] = module
        file_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(location)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ImportError(f"{location} has no attribute {qualname!r}")
    if not callable(target):
        raise ImportError(f"{spec} is not callable")
    return target  # type: ignore[no-any-return]


def main() -> NoReturn:
    """Call the function named in the environment, write its return value, exit."""
    run_and_exit(_call_function)


def run_path(script: str, args: Sequence[str]) -> NoReturn:
    """Run ``script`` as ``__main__`` with ``args`` as its arguments, then exit as
    :func:`main` does (``--run-path``)."""

    def run_script() -> None:
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")

    run_and_exit(run_script)


def _call_function() -> None:
    fn = load_function(os.environ[FUNCTION_ENV])
    payload = json.loads(os.environ.get(ARGS_ENV, '{"args": [], "kwargs": {}}'))
    result = fn(*payload["args"], **payload["kwargs"])
    path = os.environ.get(RETURN_ENV)
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fp:
            json.dump(result, fp)
        os.replace(tmp, path)


def run_and_exit(body: Callable[[], None]) -> NoReturn:
    """Run ``body`` (an exception lands in the error file, see :func:`record`), then
    end the process as the interpreter would, with the same exit status and
    output, but without finalizing it (see the module docstring)."""
    status = _outcome(record(body))
    _leave(status)


def _outcome(body: Callable[[], None]) -> int | signal.Signals:
    """The exit status ``body`` earns, as the interpreter decides it: a signal when
    Python would kill itself with it (an uncaught ``KeyboardInterrupt``)."""
    try:
        body()
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _leave(status: int | signal.Signals) -> NoReturn:
    # What the interpreter does before finalizing, in its order: wait for the
    # non-daemon threads, run the atexit handlers, flush the standard streams.
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed or broken: nothing left to save
            if stream is not None:
                stream.flush()
    if isinstance(status, signal.Signals):
        signal.signal(status, signal.SIG_DFL)
        os.kill(os.getpid(), status)
        status = 128 + status  # the signal did not end the process
    os._exit(status & 0xFF)


if __name__ == "__main__":
    main()
