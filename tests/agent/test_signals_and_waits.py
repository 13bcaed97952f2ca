"""Signals while the launcher is blocked in a store call, and waits bounded by what
the user set: a port held by a server that never answers, an unreachable store, a
--local-addr that is not this host's.

The launcher runs as a subprocess (``python -m rallypoint.run``); every process and
socket a test starts is stopped in a fixture finalizer.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rallypoint.adapters import RendezvousConnectionError, create_handler

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

FAST = {
    "keep_alive_interval": "0.2",
    "keep_alive_max_attempt": "2",
    "last_call_timeout": "0.3",
    "local_addr": "127.0.0.1",
}


@dataclass
class SilentServer:
    """Accepts connections on 127.0.0.1 and never sends a byte (a port held by
    some other service); ``accepted`` is set once a client is connected."""

    port: int
    accepted: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    server = SilentServer(int(listener.getsockname()[1]))
    stop = threading.Event()
    connections: list[socket.socket] = []

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connections.append(connection)
            server.accepted.set()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(timeout=5)
        for connection in connections:
            connection.close()
        listener.close()


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``rallypoint run ARGS script`` (a script that prints and exits)."""
    script = tmp_path / "train.py"
    script.write_text("print('trained', flush=True)\n")
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "rallypoint.run", "--log-dir", str(tmp_path / "logs")]
        proc = subprocess.Popen(
            [*argv, *args, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)


def _finish(proc: subprocess.Popen[str], within: float) -> tuple[int, str, float]:
    """(exit status, stderr, seconds it took) once ``proc`` exits; fails after ``within``."""
    started = time.monotonic()
    try:
        _, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {within} s later")
    return proc.returncode, err, time.monotonic() - started


# --- signals while blocked in a store call -----------------------------------------


def test_sigint_while_connecting_to_a_c10d_store_exits_130_at_once(
    silent_server: SilentServer, launch: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = launch(
        "--nnodes", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{silent_server.port}", "--rdzv-id", "sigint",
        "--rdzv-conf", "is_host=false,read_timeout=300,join_timeout=300",
    )  # fmt: skip
    assert silent_server.accepted.wait(60), "the launcher never connected"
    time.sleep(0.5)  # inside the store client's handshake now
    proc.send_signal(signal.SIGINT)
    status, err, took = _finish(proc, within=15)
    assert status == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "stopped by SIGINT" in err
    assert took < 10


def test_sigterm_while_the_static_backend_connects_exits_143_at_once(
    silent_server: SilentServer, launch: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = launch(
        "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static",
        "--master-addr", "127.0.0.1", "--master-port", str(silent_server.port),
    )  # fmt: skip
    assert silent_server.accepted.wait(60), "the launcher never connected"
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    status, err, took = _finish(proc, within=15)
    assert status == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    assert took < 10


def test_an_unknown_master_addr_exits_2_at_once_before_the_store_is_opened(
    launch: Callable[..., subprocess.Popen[str]], tmp_path: Path
) -> None:
    # The store client would retry the name for the whole store timeout (600 s).
    proc = launch(
        "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static",
        "--master-addr", "no-such-host.invalid", "--master-port", "29400",
    )  # fmt: skip
    status, err, _ = _finish(proc, within=30)
    assert status == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("rallypoint run: error: --master-addr 'no-such-host.invalid' does not")
    assert not any((tmp_path / "logs").glob("*"))  # nothing was started


# --- waits bounded by what the user set --------------------------------------------


def test_a_port_held_by_a_silent_server_fails_within_read_timeout(
    silent_server: SilentServer,
) -> None:
    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{silent_server.port}", "silent", 1, 1,
        **FAST, is_host="false", read_timeout="3",
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="did not answer as a c10d store"):
        create_handler(params)
    assert silent_server.accepted.is_set()
    assert time.monotonic() - started < 3 + 20  # read_timeout, not join_timeout (60 s)


def test_an_unreachable_store_fails_within_join_timeout_in_one_line(
    free_port: Callable[[], int], launch: Callable[..., subprocess.Popen[str]]
) -> None:
    # Nothing listens on the port (it was free a moment ago): connections are refused.
    proc = launch(
        "--nnodes", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "refused",
        "--rdzv-conf", "is_host=false,join_timeout=3",
    )  # fmt: skip
    status, err, took = _finish(proc, within=120)
    assert status == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # no C++ stack trace
    assert "nothing accepted a connection" in lines[0] and "within 3 s" in lines[0]
    # The 3 s join_timeout ended it, not the default 600 s. The launcher's own
    # start counts too (importing torch took 20 s on a host with a load of 9).
    assert took < 60


@pytest.mark.parametrize("backend", ["c10d", "torch-c10d"])
def test_a_local_addr_not_of_this_host_is_a_usage_error(
    launch: Callable[..., subprocess.Popen[str]], backend: str
) -> None:
    # 192.0.2.1 is TEST-NET-1: never a local address.
    proc = launch(
        "--nnodes", "1", "--rdzv-backend", backend, "--rdzv-endpoint", "127.0.0.1:0",
        "--rdzv-id", "foreign", "--rdzv-conf", "is_host=true", "--local-addr", "192.0.2.1",
    )  # fmt: skip
    status, err, _ = _finish(proc, within=60)
    assert status == 2
    assert err.strip().splitlines() == [
        "rallypoint run: error: local address '192.0.2.1' (192.0.2.1) is not an address of "
        "this host; give one of its addresses or host names (local_addr, --local-addr)"
    ]
