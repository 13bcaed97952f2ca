"""The backend contract, one suite for every implementation.

memory, c10d over a TCPStore, c10d over a FileStore, and etcd v3 on a real etcd
server (started by the ``etcd_server`` fixture). Each ``make`` call of a
``Cluster`` returns a new client of the same storage, as a second node would hold.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import FileStore, TCPStore

from rallypoint.adapters import MemoryBackend, RendezvousBackend
from rallypoint.adapters.c10d import C10dBackend
from rallypoint.adapters.etcd import EtcdBackend, EtcdServer

_run_ids = itertools.count()
Make = Callable[[], RendezvousBackend]


def _memory(tmp_path: Path, request: pytest.FixtureRequest) -> Make:
    backend = MemoryBackend("contract")
    return lambda: backend


def _tcp(tmp_path: Path, request: pytest.FixtureRequest) -> Make:
    timeout = timedelta(seconds=10)
    server = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timeout)
    run_id = f"contract-{next(_run_ids)}"

    def make() -> RendezvousBackend:
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        waiter = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        return C10dBackend(client, run_id, endpoint=f"127.0.0.1:{server.port}", wait_store=waiter)

    # The server lives as long as the clients' factory (the test).
    make.server = server  # type: ignore[attr-defined]
    return make


def _file(tmp_path: Path, request: pytest.FixtureRequest) -> Make:
    path = str(tmp_path / "store")

    def make() -> RendezvousBackend:
        return C10dBackend(
            FileStore(path, -1), "contract", endpoint=path, wait_store=FileStore(path, -1)
        )

    return make


def _etcd(tmp_path: Path, request: pytest.FixtureRequest) -> Make:
    import pyetcd

    server: EtcdServer = request.getfixturevalue("etcd_server")
    run_id = f"contract-{next(_run_ids)}"
    clients: list[object] = []

    def make() -> RendezvousBackend:
        client = pyetcd.client("127.0.0.1", server.client_port, timeout=10)
        clients.append(client)
        return EtcdBackend(client, run_id, endpoint=server.endpoint)

    request.addfinalizer(lambda: [c.close() for c in clients])  # type: ignore[attr-defined]
    return make


@pytest.fixture(params=[_memory, _tcp, _file, _etcd], ids=["memory", "tcp", "file", "etcd"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    yield request.param(tmp_path, request)


def test_empty_backend_has_no_state(make: Make) -> None:
    assert make().get_state() is None


def test_first_write_creates_the_state(make: Make) -> None:
    a, b = make(), make()
    blob, token, won = a.set_state(b"one", None)  # type: ignore[misc]
    assert (blob, won) == (b"one", True)
    assert b.get_state() == (b"one", token)


def test_create_loses_when_state_exists(make: Make) -> None:
    a, b = make(), make()
    _, token, _ = a.set_state(b"one", None)  # type: ignore[misc]
    assert b.set_state(b"two", None) == (b"one", token, False)
    assert a.get_state() == (b"one", token)


def test_stale_token_loses_and_returns_the_current_state(make: Make) -> None:
    a, b = make(), make()
    _, t1, _ = a.set_state(b"one", None)  # type: ignore[misc]
    _, t2, won = b.set_state(b"two", t1)  # type: ignore[misc]
    assert won and t2 != t1
    assert a.set_state(b"three", t1) == (b"two", t2, False)
    assert a.get_state() == (b"two", t2)


def test_every_write_gets_a_new_token(make: Make) -> None:
    a = make()
    token = None
    seen = set()
    for _ in range(5):
        _, token, won = a.set_state(b"same", token)  # type: ignore[misc]
        assert won
        seen.add(token)
    assert len(seen) == 5


def test_concurrent_increments_lose_no_update(make: Make) -> None:
    make().set_state(b"0", None)
    wins_each = 5

    def worker(backend: RendezvousBackend) -> None:
        wins = 0
        current = backend.get_state()
        while wins < wins_each:
            assert current is not None
            blob, token = current
            result = backend.set_state(str(int(blob) + 1).encode(), token)
            assert result is not None
            blob, token, won = result
            wins += won
            current = (blob, token)

    threads = [threading.Thread(target=worker, args=(make(),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    state = make().get_state()
    assert state is not None and int(state[0]) == 4 * wins_each


def test_wait_times_out_without_a_change(make: Make) -> None:
    a = make()
    _, token, _ = a.set_state(b"one", None)  # type: ignore[misc]
    assert a.wait_for_change(token, 0.05) is False


def test_wait_returns_at_once_for_a_stale_token(make: Make) -> None:
    a = make()
    _, t1, _ = a.set_state(b"one", None)  # type: ignore[misc]
    a.set_state(b"two", t1)
    assert a.wait_for_change(t1, 30.0) is True


@pytest.mark.parametrize("created", [False, True])
def test_wait_wakes_on_another_clients_write(make: Make, created: bool) -> None:
    a, b = make(), make()
    token = a.set_state(b"one", None)[1] if created else None  # type: ignore[index]
    started = threading.Event()

    def write() -> None:
        started.wait(10)
        b.set_state(b"two", token)

    writer = threading.Thread(target=write)
    writer.start()
    started.set()
    try:
        # Generous timeout: the call returns as soon as the write lands; a False
        # here means the notification never came.
        assert a.wait_for_change(token, 30.0) is True
    finally:
        writer.join(timeout=30)
    assert a.get_state()[0] == b"two"  # type: ignore[index]


def test_heartbeats_count_per_node(make: Make) -> None:
    a, b = make(), make()
    assert a.get_heartbeats(["x", "y"]) == {"x": 0, "y": 0}
    assert a.beat("x") == 1
    assert b.beat("x") == 2
    assert b.beat("y") == 1
    assert a.get_heartbeats(["x", "y", "z"]) == {"x": 2, "y": 1, "z": 0}


def test_a_heartbeat_does_not_rewrite_the_state(make: Make) -> None:
    a = make()
    _, token, _ = a.set_state(b"x" * 10_000, None)  # type: ignore[misc]
    before = a.stats.heartbeat_bytes_written
    a.beat("node-1")
    per_beat = a.stats.heartbeat_bytes_written - before
    assert 0 < per_beat < 100
    # The state's token is untouched: a beat is not a state write.
    assert a.get_state() == (b"x" * 10_000, token)
