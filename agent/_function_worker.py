"""The worker side of :func:`rallypoint.agent.elastic_launch` for Python functions.

Run as ``python -m rallypoint.agent._function_worker``: imports the function named
by ``RALLYPOINT_FUNCTION`` (``module:qualname``, or ``/path/file.py:qualname`` for
a script's function), calls it with the JSON arguments in ``RALLYPOINT_ARGS``, and
writes its JSON-encoded return value to ``RALLYPOINT_RETURN_FILE``. Arguments and
results travel as JSON, never pickle.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from .errors import record

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


@record
def main() -> None:
    fn = load_function(os.environ[FUNCTION_ENV])
    payload = json.loads(os.environ.get(ARGS_ENV, '{"args": [], "kwargs": {}}'))
    result = fn(*payload["args"], **payload["kwargs"])
    path = os.environ.get(RETURN_ENV)
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fp:
            json.dump(result, fp)
        os.replace(tmp, path)


if __name__ == "__main__":
    main()
