"""The agent's log directory: a fresh, private directory per agent run.

Workers' output and error files go under ``<log_dir>/<run_id>_<random>/``. The
name is unpredictable and the directory is created (never reused) with mode 0700,
as ``tempfile.mkdtemp`` does: in a shared ``--log-dir`` such as ``/tmp``, nobody
else can create the path first (a symlink to a file of this user's, say) and so
make the workers' output land elsewhere, nor read it afterwards.
"""

from __future__ import annotations

import os
import re
import tempfile

from .config import ConfigError

__all__ = ["make_log_root"]

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
