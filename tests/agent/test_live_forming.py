"""A worker whose round is superseded while its process group forms leaves the
forming at once instead of waiting out the group's timeout for a peer that may
never come."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist
from helpers.cluster import free_port

#: rank 1 of 2 forms its group (a 120 s timeout); rank 0 never comes. Once the
#: forming is under way, a newer round reaches the worker.
_SCRIPT = """
import threading, time
from rallypoint.agent import live
from rallypoint.agent.live_channel import LiveMessage

job = live.Job(backend="gloo", timeout=120)

def newer_round():
    while job._forming is None:
        time.sleep(0.01)
    time.sleep(0.5)
    job._on_message(LiveMessage(job.round + 1, {}, lost=False))

threading.Thread(target=newer_round, daemon=True).start()
started = time.monotonic()
try:
    job._open_round()
except Exception as exc:
    print(f"left after {time.monotonic() - started:.1f} s: {type(exc).__name__}")
else:
    print("formed")
"""


def test_a_newer_round_breaks_a_forming_group() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))  # fmt: skip
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}  # fmt: skip
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
            timeout=100, check=False,
        )  # fmt: skip
    finally:
        del store
    # Within the 100 s bound, well short of the group's 120 s timeout: the forming
    # was broken, not timed out.
    assert proc.stdout.startswith("left after"), proc.stdout + proc.stderr[-2000:]
