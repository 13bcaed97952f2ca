"""The worker of tests/e2e/test_torchrun_parity.py, run by torchrun and by rallypoint run.

It writes its environment to ``$PARITY_OUT/env.<RANK>.json`` and a few lines to each
stream, then does what ``$PARITY_MODE`` says:

* ``ok``: exit 0;
* ``exit3``: rank 1 exits 3 (the others exit 0);
* ``kill``: rank 1 SIGKILLs itself;

(rank 1 fails only once every rank has written its lines, so that the launcher's
stopping the others never races with what the test compares);
* ``pg``: join a gloo process group through MASTER_ADDR/MASTER_PORT (as torch's
  ``env://`` does with TORCHELASTIC_USE_AGENT_STORE) and all-reduce one number;
* ``sleep``: note each signal it gets (``signal.<RANK>.<NAME>``), and on SIGTERM or
  SIGUSR1 wait 2 s before writing ``survived.<RANK>``; otherwise sleep until killed.

No torch import except in ``pg`` mode, so it starts fast.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

out = os.environ["PARITY_OUT"]
mode = os.environ.get("PARITY_MODE", "ok")
rank = os.environ["RANK"]


def _write(name: str, text: str) -> None:
    tmp = os.path.join(out, f".{name}.{os.getpid()}")
    with open(tmp, "w") as fp:
        fp.write(text)
    os.replace(tmp, os.path.join(out, name))


_write(f"env.{rank}.json", json.dumps(dict(os.environ), sort_keys=True))
print(f"hello,world from {rank}", flush=True)
print(f"hello only {rank}", flush=True)
print(f"oops on stderr {rank}", file=sys.stderr, flush=True)
_write(f"printed.{rank}", "")


def _wait_for_every_rank() -> None:
    deadline = time.monotonic() + 60
    world = int(os.environ["WORLD_SIZE"])
    while time.monotonic() < deadline:
        if len([n for n in os.listdir(out) if n.startswith("printed.")]) >= world:
            return
        time.sleep(0.02)


if mode in ("exit3", "kill") and rank == "1":
    _wait_for_every_rank()
    if mode == "exit3":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "pg":
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    _write(f"sum.{rank}", str(int(value.item())))
    dist.destroy_process_group()
if mode == "sleep":

    def on_signal(signum: int, frame: object) -> None:
        _write(f"signal.{rank}.{signal.Signals(signum).name}", "")
        if signum in (signal.SIGTERM, signal.SIGUSR1):  # a stop, forwarded or not
            time.sleep(2.0)
            _write(f"survived.{rank}", "")
            sys.exit(0)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, on_signal)
    _write(f"ready.{rank}", "")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(7)
