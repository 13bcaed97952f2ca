"""Every backend keeps torch's ``RendezvousBackend`` contract.

Written from the docstrings of ``RendezvousBackend`` in
``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``:

* ``set_state(state, token=None)``: the token is optional; with None the state is
  set only if none exists, else the existing state and its token come back;
* "If the specified token does not match the fencing token stored in the backend,
  the state won't be updated; instead the existing state along with its fencing
  token will be returned": so a token the backend never handed out (garbage, of
  another type, another backend's) simply loses, and raises nothing;
* ``get_state``/``set_state`` raise ``RendezvousStateError`` when "the rendezvous
  state is corrupt" (here: a stored value the backend did not write), and
  ``RendezvousConnectionError`` when "the connection to the backend has failed",
  both catchable as torch's classes;
* and torch's own ``DynamicRendezvousHandler`` runs a rendezvous on rallypoint's
  backends, which is what the contract is for.

Runs on memory, c10d (TCPStore, FileStore) and a real etcd server on 127.0.0.1.
The promises every backend keeps (the token defaults to None, a foreign token
loses, an unreadable value is a state error catchable as torch's class) are part of
the backend contract suite, run on the same backends in test_contract.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import FileStore, HashStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from rallypoint.adapters import MemoryBackend, RendezvousBackend
from rallypoint.adapters.c10d import C10dBackend
from rallypoint.adapters.etcd import EtcdBackend, EtcdServer, EtcdStore

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

_run_ids = itertools.count()

#: A backend of one kind, for one run id.
Make = Callable[[], RendezvousBackend]


class Kind:
    """How to make a backend of one kind, and a store for torch's handler."""

    def __init__(self, make: Make, store: Callable[[], Store]) -> None:
        self.make = make
        self.store = store


def _memory(tmp_path: Path, request: pytest.FixtureRequest) -> Kind:
    shared, store = MemoryBackend(), HashStore()
    return Kind(lambda: shared, lambda: store)


@pytest.fixture(scope="module")
def tcp_server() -> TCPStore:
    # One for the module: starting a TCPStore server now and then takes 5 s.
    return TCPStore(
        "127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=10)
    )


def _tcp(tmp_path: Path, request: pytest.FixtureRequest) -> Kind:
    timeout = timedelta(seconds=10)
    server: TCPStore = request.getfixturevalue("tcp_server")
    run_id = f"torch-contract-{next(_run_ids)}"

    def client() -> TCPStore:
        return TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)

    def make() -> RendezvousBackend:
        return C10dBackend(
            client(), run_id, endpoint=f"127.0.0.1:{server.port}", wait_store=client()
        )

    return Kind(make, client)


def _file(tmp_path: Path, request: pytest.FixtureRequest) -> Kind:
    path = str(tmp_path / "store")
    run_id = f"torch-contract-{next(_run_ids)}"

    def make() -> RendezvousBackend:
        return C10dBackend(
            FileStore(path, -1), run_id, endpoint=path, wait_store=FileStore(path, -1)
        )

    return Kind(make, lambda: FileStore(path, -1))


def _etcd(tmp_path: Path, request: pytest.FixtureRequest) -> Kind:
    import pyetcd

    server: EtcdServer = request.getfixturevalue("etcd_server")
    run_id = f"torch-contract-{next(_run_ids)}"
    made: list[EtcdBackend] = []

    def make() -> RendezvousBackend:
        client = pyetcd.client("127.0.0.1", server.client_port, timeout=10)
        made.append(EtcdBackend(client, run_id, endpoint=server.endpoint))
        return made[-1]

    def store() -> Store:
        return EtcdStore(made[-1] if made else make())  # type: ignore[arg-type]

    request.addfinalizer(lambda: [b.close() for b in made])  # type: ignore[func-returns-value]
    return Kind(make, store)


@pytest.fixture(params=[_memory, _tcp, _file, _etcd], ids=["memory", "tcp", "file", "etcd"])
def kind(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Kind]:
    yield request.param(tmp_path, request)


def test_an_unreachable_etcd_is_a_connection_error(
    etcd_server_factory: Callable[[], EtcdServer],
) -> None:
    import pyetcd

    server = etcd_server_factory()
    backend = EtcdBackend(
        pyetcd.client("127.0.0.1", server.client_port, timeout=2), "gone", endpoint=server.endpoint
    )
    try:
        backend.set_state(b"state")
        server.stop(kill=True)
        for call in (backend.get_state, lambda: backend.set_state(b"x", None)):
            with pytest.raises(torch_api.RendezvousConnectionError):
                call()
    finally:
        backend.close()


def test_torchs_dynamic_rendezvous_runs_on_rallypoints_backends(kind: Kind) -> None:
    run_id = f"torch-handler-{next(_run_ids)}"
    params = RendezvousParameters(
        "rallypoint", "unused", run_id, 2, 2, join_timeout="60", last_call_timeout="1"
    )
    handlers = [create_handler(kind.store(), kind.make(), params) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers, timeout=90))
        assert sorted(info.rank for info in infos) == [0, 1]
        assert {info.world_size for info in infos} == {2}
    finally:
        for handler in handlers:
            handler.shutdown()
