"""create_handler(params): backends by name, endpoints, options, connection errors,
and an etcd server killed and restarted mid-rendezvous."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.waiting import join_all
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from rallypoint.adapters import (
    RallypointHandler,
    RendezvousConnectionError,
    create_handler,
    parse_endpoint,
)
from rallypoint.adapters.etcd import EtcdServer
from rallypoint.core import errors as core_errors

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

FAST = {
    "keep_alive_interval": "0.2",
    "keep_alive_max_attempt": "2",
    "last_call_timeout": "0.3",
    "join_timeout": "60",
    "local_addr": "127.0.0.1",
}


def _params(backend: str, endpoint: str, run_id: str, n: int, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(backend, endpoint, run_id, n, n, **{**FAST, **conf})


def test_unknown_backend_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match="rallypoint-c10d") as caught:
        create_handler(_params("zookeeper", "127.0.0.1:1", "x", 1))
    assert "rallypoint-etcd" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ("localhost", 7)),
        ("host", ("host", 7)),
        ("host:12", ("host", 12)),
        ("[::1]:13", ("::1", 13)),
        ("[::1]", ("::1", 7)),
    ],
)
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text, 7) == expected


def test_bad_option_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="is_host"):
        create_handler(_params("c10d", "127.0.0.1:0", "x", 1, is_host="maybe"))


def test_c10d_port_zero_host_binds_a_free_port(handlers: list[RallypointHandler]) -> None:
    host = create_handler(_params("c10d", "127.0.0.1:0", "zero", 2, is_host="true"))
    handlers.append(host)
    port = int(host.endpoint.rsplit(":", 1)[1])
    assert port > 0
    guest = create_handler(_params("c10d", host.endpoint, "zero", 2, is_host="false"))
    handlers.append(guest)
    infos = join_all([host, guest], 120)
    assert sorted(i.rank for i in infos) == [0, 1]


def test_torchrun_registry_finds_the_entry_points(handlers: list[RallypointHandler]) -> None:
    handler = get_rendezvous_handler(
        _params("rallypoint-c10d", "127.0.0.1:0", "registry", 1, is_host="true")
    )
    assert isinstance(handler, RallypointHandler)
    handlers.append(handler)
    assert handler.get_backend() == "rallypoint-c10d"


def test_file_store_backend(tmp_path: Path, handlers: list[RallypointHandler]) -> None:
    path = str(tmp_path / "rdzv")
    made = [create_handler(_params("c10d", path, "file", 2, store_type="file")) for _ in range(2)]
    handlers.extend(made)
    infos = join_all(made, 120)
    assert sorted(i.rank for i in infos) == [0, 1]


def test_unreachable_c10d_store_raises_connection_error(free_port: Callable[[], int]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(RendezvousConnectionError) as caught:
        create_handler(_params("c10d", endpoint, "gone", 1, is_host="false", read_timeout="1"))
    error = caught.value
    assert isinstance(error, torch_api.RendezvousConnectionError)
    assert isinstance(error, core_errors.RendezvousConnectionError)
    assert "'gone'" in str(error) and endpoint in str(error) and "Check:" in str(error)


def test_unreachable_etcd_raises_connection_error(free_port: Callable[[], int]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(RendezvousConnectionError) as caught:
        create_handler(_params("etcd", endpoint, "gone", 1, read_timeout="1"))
    assert "'gone'" in str(caught.value) and endpoint in str(caught.value)


def test_etcd_rendezvous_and_round_store(
    etcd_server: EtcdServer, handlers: list[RallypointHandler]
) -> None:
    made = [
        create_handler(_params("rallypoint-etcd", etcd_server.endpoint, "etcd-basic", 3))
        for _ in range(3)
    ]
    handlers.extend(made)
    infos = join_all(made, 120)
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    by_rank = {i.rank: i for i in infos}
    by_rank[0].store.set("hello", b"from rank 0")
    assert by_rank[2].store.get("hello") == b"from rank 0"
    assert made[0].get_backend() == "rallypoint-etcd"


def test_etcd_restart_mid_rendezvous_loses_nothing(
    etcd_server_factory: Callable[[], EtcdServer], handlers: list[RallypointHandler]
) -> None:
    server = etcd_server_factory()
    made = [
        create_handler(_params("etcd", server.endpoint, "restart", 3, read_timeout="30"))
        for _ in range(3)
    ]
    handlers.extend(made)
    results: dict[int, torch_api.RendezvousInfo] = {}
    errors: list[BaseException] = []

    def join(index: int) -> None:
        try:
            results[index] = made[index].next_rendezvous()
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    early = [threading.Thread(target=join, args=(i,)) for i in (0, 1)]
    for thread in early:
        thread.start()
    # Both early nodes are in the state before etcd goes down.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(made[0].sync.refresh().participants) < 2:
        time.sleep(0.05)
    assert len(made[0].sync.state.participants) == 2
    server.restart(kill=True)  # SIGKILL, same data dir and ports
    late = threading.Thread(target=join, args=(2,))
    late.start()
    for thread in [*early, late]:
        thread.join(timeout=120)
    assert not errors, errors
    assert sorted(info.rank for info in results.values()) == [0, 1, 2]
    assert len({h.round for h in made}) == 1


def test_etcd_store_implements_the_torch_store_interface(etcd_server: EtcdServer) -> None:
    from datetime import timedelta

    import pyetcd
    from torch.distributed import DistStoreError, PrefixStore

    from rallypoint.adapters.etcd import EtcdBackend, EtcdStore

    client = pyetcd.client("127.0.0.1", etcd_server.client_port, timeout=10)
    try:
        base = EtcdStore(EtcdBackend(client, "store-test", endpoint=etcd_server.endpoint))
        store = PrefixStore("round/0", base)
        store.set("a", b"1")
        assert store.get("a") == b"1"
        assert store.add("n", 2) == 2 and store.add("n", 3) == 5
        assert store.compare_set("c", "", "x") == b"x"
        assert store.compare_set("c", "y", "z") == b"x"
        assert store.compare_set("c", "x", "z") == b"z"
        store.multi_set(["m1", "m2"], [b"p", b"q"])
        assert store.multi_get(["m1", "m2"]) == [b"p", b"q"]
        assert store.check(["a", "m1"]) and not store.check(["missing"])
        later = threading.Timer(0.1, lambda: store.set("late", b"v"))
        later.start()
        store.wait(["late"], timedelta(seconds=30))
        later.join()
        with pytest.raises(DistStoreError):
            store.wait(["never"], timedelta(seconds=0.2))
    finally:
        client.close()
