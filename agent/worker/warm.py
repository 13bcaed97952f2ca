"""A warm spare worker (``--live``): pay for the imports before a worker is needed.

Starting a worker costs an interpreter and ``import torch``: seconds, most of what a
live regroup around a crashed worker would otherwise take. The agent keeps one of
these processes ready: it imports torch and the live API, says so in its status
file (``argv[2]``: :attr:`Phase.READY`), then blocks on its pipe (descriptor
``argv[1]``) until the agent adopts it in place of a lost worker (or as a worker of
its first round: an agent starts one per local rank while it joins). The
first line on the pipe is the adoption: the worker's whole environment, its command
line (``python -u SCRIPT ...``, ``-m MODULE ...`` or ``-c CODE ...``, as the agent
would have started it) and where its output goes. The process then becomes that
worker: same pid, its streams routed, the script run as ``__main__``. The rest of
the pipe is the worker's live channel (:mod:`rallypoint.agent.worker.live_channel`), read
by its :class:`rallypoint.agent.worker.live.Job`.

Started with ``python -u -m rallypoint.agent.worker.warm FD STATUS``, so ``sys.path[0]``
is the agent's working directory, as for the worker it replaces.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time


def _read_line(fd: int) -> bytes:
    """One line from ``fd``, byte by byte: nothing after it may be consumed, it is
    the live channel's."""
    line = bytearray()
    while True:
        byte = os.read(fd, 1)
        if not byte:
            sys.exit(0)  # the agent is gone before it needed this spare
        if byte == b"\n":
            return bytes(line)
        line += byte


def _route(fd: int, target: str | None) -> None:
    """Point standard stream ``fd`` at ``target`` (a file to write, or /dev/null;
    None: leave it on the agent's console)."""
    if target is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    opened = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(opened, fd)
    os.close(opened)


def main() -> None:
    fd = int(sys.argv[1])
    import torch
    import torch.distributed  # noqa: F401

    from . import live  # noqa: F401
    from .live_channel import StatusFile

    status = StatusFile(sys.argv[2])
    status.write_ready(time.monotonic())
    doc = json.loads(_read_line(fd))
    status.write_adopted()
    status.close()
    os.environ.clear()
    os.environ.update(doc["env"])
    _route(1, doc.get("stdout"))
    _route(2, doc.get("stderr"))
    argv: list[str] = doc["argv"]  # the command line after "python -u"
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
