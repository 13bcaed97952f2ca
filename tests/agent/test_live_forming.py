"""A worker whose round is superseded while its process group forms leaves the
forming at once instead of waiting out the group's timeout for a peer that may
never come."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
import torch.distributed as dist
from helpers.cluster import free_port

from rallypoint.agent.worker.live_channel import (
    FD_ENV,
    STATUS_ENV,
    LiveMessage,
    StatusFile,
    encode_message,
)

#: rank 1 of 2 forms its group (a 120 s timeout); rank 0 never comes. Once the
#: forming is under way, a newer round reaches the worker.
_SCRIPT = """
import threading, time
from rallypoint.agent.worker import live
from rallypoint.agent.worker.live_channel import LiveMessage

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


#: rank 1 of 2 of round 0, whose store (rank 0's) never opens; a 120 s timeout.
_NO_STORE_SCRIPT = """
import time
from rallypoint.agent.worker import live

job = live.Job(backend="gloo", timeout=120)
started = time.monotonic()
try:
    job._open_round()
except live.LiveError as exc:
    print(f"left after {time.monotonic() - started:.1f} s: {exc}")
else:
    print("formed")
"""


def _live_worker(
    tmp_path: Path, name: str, script: str, env: dict[str, str]
) -> tuple[subprocess.Popen[str], int, StatusFile]:
    """A live worker running ``script`` with its agent's pipe and status file, as
    ``name``: (its process, the agent's end of the pipe, its status file)."""
    status = StatusFile(str(tmp_path / f"status-{name}"), create=True)
    read_fd, write_fd = os.pipe()
    full = {**os.environ, FD_ENV: str(read_fd), STATUS_ENV: status.path, "LOCAL_RANK": "0", **env}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=full, pass_fds=(read_fd,),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(read_fd)
    return proc, write_fd, status


def test_a_newer_round_ends_the_wait_for_a_store_that_never_opens(tmp_path: Path) -> None:
    """The round is superseded before its store's host opened it: torch would retry
    the connection until the group's timeout; the worker leaves for the newer one."""
    env = {"RALLYPOINT_ROUND": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RANK": "1", "WORLD_SIZE": "2"}  # fmt: skip
    proc, write_fd, status = _live_worker(tmp_path, "worker", _NO_STORE_SCRIPT, env)
    try:
        time.sleep(1.0)  # into the wait
        os.write(write_fd, encode_message(LiveMessage(1, {}, lost=False)))
        out, err = proc.communicate(timeout=100)
    finally:
        os.close(write_fd)
        proc.kill()
        proc.wait()
        status.close()
    # Within the 100 s bound, short of the 120 s the connection would be retried.
    assert out.startswith("left after") and "superseded" in out, out + err[-2000:]


#: a live worker that trains one step in each round it gets and says which rounds
#: formed; the group's timeout is 90 s.
_ROUNDS_SCRIPT = """
import torch.distributed as dist
from rallypoint.agent.worker import live

job = live.Job(backend="gloo", timeout=90)
for rnd in job.rounds():
    print(f"round {rnd.number} formed", flush=True)
    with rnd:
        for _ in rnd.steps(job.step + 1):
            pass
# As every training script should: a gloo group left to the interpreter's exit may
# abort the process there (SIGABRT, "terminate called without an active exception").
dist.destroy_process_group()
"""


def test_a_host_whose_first_round_was_superseded_forms_the_next(tmp_path: Path) -> None:
    """Rank 0 of round 0 hosts the round's store and waits in it for rank 1, which
    never comes; round 1 comes meanwhile and breaks the forming. Round 1 (rank 0:
    this worker, rank 1: a fresh one) must form: torch names a default group after
    a count the failed forming left at 1, and a group named "1" here and "0" in the
    fresh peer never meets (each waits for the other's keys until the timeout)."""
    round0 = {"RALLYPOINT_ROUND": "0", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "2"}  # fmt: skip
    round1 = {**round0, "RALLYPOINT_ROUND": "1", "MASTER_PORT": str(free_port())}
    host, host_pipe, host_status = _live_worker(tmp_path, "host", _ROUNDS_SCRIPT, round0)
    peer: subprocess.Popen[str] | None = None
    try:
        # Into the forming: its client is connected to the store it hosts (and stays
        # there: rank 1 never comes). Bounded by the group's 90 s timeout.
        me = psutil.Process(host.pid)
        store_port = int(round0["MASTER_PORT"])
        deadline = time.monotonic() + 90
        while not any(
            c.raddr and c.raddr.port == store_port and c.status == psutil.CONN_ESTABLISHED
            for c in me.net_connections("tcp")
        ):
            assert host.poll() is None and time.monotonic() < deadline, "the host never formed"
            time.sleep(0.05)
        os.write(host_pipe, encode_message(LiveMessage(1, round1, lost=False)))
        peer, peer_pipe, peer_status = _live_worker(
            tmp_path, "peer", _ROUNDS_SCRIPT, {**round1, "RANK": "1"}
        )
        # Within 75 s, short of the group's 90 s timeout: the group formed, not timed out.
        deadline = time.monotonic() + 75
        while (host.poll() is None or peer.poll() is None) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for proc in (host, peer):
            if proc is not None:
                proc.kill()
                proc.wait()
        os.close(host_pipe)
        host_status.close()
        if peer is not None:
            os.close(peer_pipe)
            peer_status.close()
    assert peer is not None
    for name, proc in (("host", host), ("peer", peer)):
        out, err = proc.communicate()
        assert out.splitlines() == ["round 1 formed"] and proc.returncode == 0, (
            f"{name} (exit {proc.returncode}): {out}{err[-3000:]}"
        )
