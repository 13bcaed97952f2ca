"""The backend contract (:mod:`rallypoint.adapters.contract`) on every backend
rallypoint ships: memory, c10d over a TCPStore, c10d over a FileStore, and etcd v3
on a real etcd server (started by the ``etcd_server`` fixture); then what is
particular to one of them.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import FileStore, TCPStore
from torch.distributed.elastic.rendezvous import api as torch_api

from rallypoint.adapters import MemoryBackend, RendezvousBackend
from rallypoint.adapters.c10d import C10dBackend
from rallypoint.adapters.contract import BackendContract, Connect, phase_wait_during_a_write
from rallypoint.adapters.etcd import EtcdBackend, EtcdServer

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

_run_ids = itertools.count()
#: the clients' default timeout: above BackendContract.wait_slack, so a wait that
#: fell back to it (instead of the timeout it was given) fails the contract
_TIMEOUT = timedelta(seconds=60)


@pytest.fixture(scope="module")
def tcp_server() -> TCPStore:
    # One for the module (each test has its own run id): starting a TCPStore server
    # now and then takes 5 s.
    return TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=_TIMEOUT)


class _Ours(BackendContract):
    # Catchable as torch's class too: torch's own agent runs on these backends.
    state_error = torch_api.RendezvousStateError


class TestMemory(_Ours):
    @pytest.fixture
    def connect(self) -> Connect:
        # One MemoryBackend is one run's storage: the clients of a run share it.
        runs: dict[str, MemoryBackend] = {}
        return lambda run_id: runs.setdefault(run_id, MemoryBackend(run_id))


class TestTCPStore(_Ours):
    def write_foreign_state(self, backend: Any) -> None:
        backend.store.set(backend.key("state"), b"not written by rallypoint")

    @pytest.fixture
    def connect(self, tcp_server: TCPStore) -> Connect:
        port = tcp_server.port

        def connect(run_id: str) -> RendezvousBackend:
            client = TCPStore("127.0.0.1", port, is_master=False, timeout=_TIMEOUT)
            waiter = TCPStore("127.0.0.1", port, is_master=False, timeout=_TIMEOUT)
            endpoint = f"127.0.0.1:{port}"
            return C10dBackend(client, run_id, endpoint=endpoint, wait_store=waiter)

        return connect


class TestFileStore(_Ours):
    # FileStore has no native append: announce reads and rewrites the log.
    announce_appends = False

    def write_foreign_state(self, backend: Any) -> None:
        backend.store.set(backend.key("state"), b"7")

    @pytest.fixture
    def connect(self, tmp_path: Path) -> Connect:
        path = str(tmp_path / "store")
        return lambda run_id: C10dBackend(
            FileStore(path, -1), run_id, endpoint=path, wait_store=FileStore(path, -1)
        )


class TestEtcd(_Ours):
    @pytest.fixture
    def connect(self, etcd_server: EtcdServer) -> Connect:
        import pyetcd

        def connect(run_id: str) -> RendezvousBackend:
            client = pyetcd.client("127.0.0.1", etcd_server.client_port, timeout=10)
            return EtcdBackend(client, run_id, endpoint=etcd_server.endpoint)

        return connect

    def write_foreign_state(self, backend: Any) -> None:
        # What torch's own etcd backend would store there: base64 text.
        backend.client.put(backend.key("state"), b"gASVAAAAAAAAAAB9lC4=")


# -- backend-specific ---------------------------------------------------------------


def test_etcd_writes_the_phase_in_the_state_txn(etcd_server: EtcdServer) -> None:
    import pyetcd

    client = pyetcd.client("127.0.0.1", etcd_server.client_port, timeout=10)
    try:
        backend = EtcdBackend(client, f"contract-{next(_run_ids)}", endpoint=etcd_server.endpoint)
        key = backend.key("phase")

        def stored() -> tuple[bytes | None, int | None]:
            value, meta = client.get(key)
            return value, None if meta is None else int(meta.mod_revision)

        assert stored() == (None, None)
        _, t1, _ = backend.set_state(b"one", None, phase=5)  # type: ignore[misc]
        # Same revision as the state: one txn.
        assert stored() == (b"5", t1)
        _, t2, won = backend.set_state(b"two", t1)  # type: ignore[misc]
        assert won and stored() == (b"5", t1)  # no phase: key untouched
        assert backend.set_state(b"three", t1, phase=6) == (b"two", t2, False)
        assert stored() == (b"5", t1)  # a lost write: key untouched
        _, t3, won = backend.set_state(b"four", t2, phase=6)  # type: ignore[misc]
        assert won and stored() == (b"6", t3)
    finally:
        client.close()


def test_c10d_next_phase_wakes_waiters_a_dead_writer_stranded() -> None:
    timeout = timedelta(seconds=10)
    server = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timeout)

    def make() -> C10dBackend:
        client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        waiter = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        return C10dBackend(client, "stranded", endpoint="", wait_store=waiter)

    a, b = make(), make()
    _, t0, _ = a.set_state(b"zero", None, phase=0)  # type: ignore[misc]
    # A writer moves the state to phase 1, then dies before setting p/1.
    dead = b"2:dead:one"
    assert a.store.compare_set("rallypoint/stranded/state", t0, dead) == dead  # type: ignore[arg-type]
    assert b.wait_for_phase(0, 0.05) is False
    assert phase_wait_during_a_write(b, a, dead, phase=2) == [True]
