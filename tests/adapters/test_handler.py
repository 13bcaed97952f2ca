"""RallypointHandler on the in-memory backend: many handlers, one process, threads.

Short liveness settings (0.1 s x 2) keep the waits small; every wait is bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.waiting import eventually, join_all
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import api as torch_api

from rallypoint.adapters import (
    MemoryBackend,
    RallypointHandler,
    RendezvousClosedError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from rallypoint.core import Settings
from rallypoint.core import errors as core_errors

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

Factory = Callable[..., RallypointHandler]


@pytest.fixture
def cluster() -> Iterator[tuple[MemoryBackend, Factory]]:
    backend = MemoryBackend("test")
    store = HashStore()
    handlers: list[RallypointHandler] = []

    def make(
        min_nodes: int, max_nodes: int, local_id: int | None = None, **kw: object
    ) -> RallypointHandler:
        options: dict[str, object] = {
            "keep_alive_interval": 0.1,
            "keep_alive_max_attempt": 2,
            "last_call_timeout": 0.2,
            "join_timeout": 20.0,
        }
        options.update(kw)
        settings = Settings("test", min_nodes, max_nodes, **options)  # type: ignore[arg-type]
        handler = RallypointHandler(
            backend,
            settings,
            local_addr="127.0.0.1",
            store=store,
            local_id=local_id,
        )
        handlers.append(handler)
        return handler

    yield backend, make
    for handler in handlers:
        handler._stop_heartbeats()


def _eventually(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    return eventually(condition, timeout)


def test_nodes_agree_on_round_ranks_and_world(cluster: tuple[MemoryBackend, Factory]) -> None:
    _, make = cluster
    handlers = [make(4, 4) for _ in range(4)]
    infos = join_all(handlers, 60)
    assert sorted(i.rank for i in infos) == [0, 1, 2, 3]
    assert {i.world_size for i in infos} == {4}
    assert {h.round for h in handlers} == {0}
    # Ranks follow node order without the stable-ranks option (torch's rule).
    by_node = sorted(zip(handlers, infos, strict=True), key=lambda p: p[0].node)
    assert [info.rank for _, info in by_node] == [0, 1, 2, 3]
    # Every node got the same bootstrap store, hosted by rank 0.
    assert (
        len(
            {
                (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                for i in infos
            }
        )
        == 1
    )


def test_store_is_namespaced_per_round(cluster: tuple[MemoryBackend, Factory]) -> None:
    _, make = cluster
    handlers = [make(2, 2) for _ in range(2)]
    first = join_all(handlers, 60)
    first[0].store.set("key", b"round0")
    assert first[1].store.get("key") == b"round0"
    second = join_all(handlers, 60)
    assert {h.round for h in handlers} == {1}
    assert second[0].store.check(["key"]) is False
    second[1].store.set("key", b"round1")
    assert first[0].store.get("key") == b"round0"


def test_min_nodes_complete_after_last_call_and_late_node_waits(
    cluster: tuple[MemoryBackend, Factory],
) -> None:
    _, make = cluster
    handlers = [make(2, 3) for _ in range(2)]
    infos = join_all(handlers, 60)
    assert {i.world_size for i in infos} == {2}
    late = make(2, 3)
    result: list[object] = []
    joiner = threading.Thread(target=lambda: result.append(late.next_rendezvous()))
    joiner.start()
    # The monitor sees the waiting node; wait_for_change wakes on its arrival.
    assert _eventually(
        lambda: (handlers[0].wait_for_change(1.0), handlers[0].num_nodes_waiting())[1] == 1
    )
    # The agents re-rendezvous (as torch's agent does on waiting nodes): 3 nodes.
    infos = join_all(handlers, 60)
    joiner.join(timeout=30)
    assert {i.world_size for i in infos} == {3}
    assert result and result[0].world_size == 3  # type: ignore[attr-defined]


def test_dead_participant_is_reported_and_survivors_regroup(
    cluster: tuple[MemoryBackend, Factory],
) -> None:
    _, make = cluster
    handlers = [make(2, 3) for _ in range(3)]
    join_all(handlers, 60)
    assert all(h.dead_participants() == frozenset() for h in handlers)
    victim = handlers[2]
    victim._stop_heartbeats()  # a crash, as far as its peers can tell
    assert _eventually(lambda: handlers[0].dead_participants() == {victim.node})
    assert _eventually(lambda: handlers[1].dead_participants() == {victim.node})
    infos = join_all(handlers[:2], 60)
    assert {i.world_size for i in infos} == {2}
    assert all(h.dead_participants() == frozenset() for h in handlers[:2])


def test_a_leaving_node_makes_its_peers_regroup_without_the_liveness_window(
    cluster: tuple[MemoryBackend, Factory],
) -> None:
    """leave() (an agent stopping on SIGTERM) takes the node out of the shared
    state at once; its peers see it gone long before a 60 s liveness window."""
    _, make = cluster
    slow = {"keep_alive_interval": 20.0, "keep_alive_max_attempt": 3}
    handlers = [make(2, 3, **slow) for _ in range(3)]
    join_all(handlers, 60)
    leaver = handlers[2]
    leaver.leave()
    assert leaver.node not in handlers[0].sync.refresh().participants
    assert _eventually(lambda: handlers[0].dead_participants() == {leaver.node}, timeout=5)
    assert _eventually(lambda: handlers[1].dead_participants() == {leaver.node}, timeout=5)
    infos = join_all(handlers[:2], 60)
    assert {i.world_size for i in infos} == {2}
    assert {h.round for h in handlers[:2]} == {1}
    assert not handlers[0].is_closed()


def test_a_node_that_left_joins_again_with_the_same_handler(
    cluster: tuple[MemoryBackend, Factory],
) -> None:
    """leave() without close() (a node out while its workers' replacements start):
    the others form a round without it, and the same handler joins the next one."""
    _, make = cluster
    handlers = [make(2, 3) for _ in range(3)]
    join_all(handlers, 60)
    out = handlers[2]
    out.leave()
    assert {i.world_size for i in join_all(handlers[:2], 60)} == {2}
    # As agents do: it waits to be taken in, the others see it waiting and rejoin.
    with ThreadPoolExecutor(1) as pool:
        back = pool.submit(out.next_rendezvous)
        assert _eventually(lambda: handlers[0].num_nodes_waiting() == 1)
        assert {i.world_size for i in join_all(handlers[:2], 60)} == {3}
        assert back.result(60).world_size == 3
    assert {h.round for h in handlers} == {2}


def test_a_fact_one_agent_records_is_known_to_the_others(
    cluster: tuple[MemoryBackend, Factory],
) -> None:
    _, make = cluster
    first, second = make(1, 2), make(1, 2)
    assert not second.knows("live-api")
    first.tell("live-api")
    assert second.knows("live-api") and not second.knows("something else")


def test_leave_before_any_round_is_harmless(cluster: tuple[MemoryBackend, Factory]) -> None:
    _, make = cluster
    handler = make(1, 2)
    handler.leave()
    assert handler.dead_participants() == frozenset()
    assert handler.next_rendezvous().world_size == 1


@pytest.mark.parametrize("stable", [False, True])
def test_stable_ranks_keep_survivors_in_place(
    cluster: tuple[MemoryBackend, Factory], stable: bool
) -> None:
    _, make = cluster
    a, b, c = (make(3, 3, local_id=i, stable_ranks=stable) for i in (1, 2, 3))
    first = dict(zip((a, b, c), join_all([a, b, c], 60), strict=True))
    assert [first[h].rank for h in (a, b, c)] == [0, 1, 2]
    a._stop_heartbeats()  # node 1 dies; node 4 (sorting last) replaces it
    d = make(3, 3, local_id=4, stable_ranks=stable)
    second = dict(zip((b, c, d), join_all([b, c, d], 60), strict=True))
    ranks = [second[h].rank for h in (b, c, d)]
    assert ranks == ([1, 2, 0] if stable else [0, 1, 2])


def test_closed_rendezvous_refuses_joins(cluster: tuple[MemoryBackend, Factory]) -> None:
    _, make = cluster
    handlers = [make(2, 2) for _ in range(2)]
    join_all(handlers, 60)
    handlers[0].set_closed()
    assert handlers[0].is_closed()
    assert _eventually(handlers[1].is_closed)
    with pytest.raises(RendezvousClosedError) as caught:
        handlers[1].next_rendezvous()
    assert isinstance(caught.value, torch_api.RendezvousClosedError)
    assert isinstance(caught.value, core_errors.RendezvousClosedError)
    assert "'test'" in str(caught.value) and "memory" in str(caught.value)


def test_shutdown_closes_the_rendezvous(cluster: tuple[MemoryBackend, Factory]) -> None:
    _, make = cluster
    handlers = [make(1, 2) for _ in range(2)]
    handlers[0].next_rendezvous()
    assert handlers[0].shutdown() is True
    assert handlers[1].is_closed()


def test_join_times_out_with_an_actionable_message(cluster: tuple[MemoryBackend, Factory]) -> None:
    _, make = cluster
    lonely = make(2, 2, join_timeout=0.3)
    with pytest.raises(RendezvousTimeoutError) as caught:
        lonely.next_rendezvous()
    assert isinstance(caught.value, torch_api.RendezvousTimeoutError)
    assert "min_nodes=2" in str(caught.value) and "'test'" in str(caught.value)


def test_corrupt_state_raises_state_error(cluster: tuple[MemoryBackend, Factory]) -> None:
    backend, make = cluster
    backend.set_state(b'{"v": 1, "round": "nonsense"}', None)
    with pytest.raises(RendezvousStateError) as caught:
        make(1, 1).next_rendezvous()
    assert isinstance(caught.value, torch_api.RendezvousStateError)
    assert "'test'" in str(caught.value) and "corrupt" in str(caught.value)


def test_heartbeat_thread_stops_cleanly(cluster: tuple[MemoryBackend, Factory]) -> None:
    _, make = cluster
    handler = make(1, 1)
    handler.next_rendezvous()
    thread = handler._hb_thread
    assert thread is not None and thread.is_alive()
    handler.close()
    assert not thread.is_alive()


def test_handler_reports_torch_interface(cluster: tuple[MemoryBackend, Factory]) -> None:
    _, make = cluster
    handler = make(1, 1)
    assert isinstance(handler, torch_api.RendezvousHandler)
    assert handler.get_run_id() == "test"
    assert handler.get_backend() == "memory"
    assert handler.use_agent_store is True
    assert handler.round == -1
    assert handler.endpoint == "memory"
