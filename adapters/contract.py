"""The backend contract as a test suite: run it against your own store.

Every backend rallypoint ships (memory, c10d over a TCPStore or a FileStore, etcd)
passes this suite, and so must a store you write for the sync engine
(docs/backends.md lists what it must provide). Subclass :class:`BackendContract`
in a pytest module and override its ``connect`` fixture::

    import pytest
    from rallypoint.adapters.contract import BackendContract, Connect

    class TestMyStore(BackendContract):
        @pytest.fixture
        def connect(self, my_server) -> Connect:
            return lambda run_id: MyStoreBackend(my_server.address, run_id)

``connect(run_id)`` returns a new client of the storage for run ``run_id``: two
calls with one run id are two nodes of one run and must see each other's writes;
clients of different run ids must not see each other's keys. Each test draws a
fresh run id and closes every client it made when it ends. Override the class
attributes and :meth:`BackendContract.write_foreign_state` where your store
differs from the default in a way the contract allows.

Nothing here imports torch: the suite needs pytest and the core only.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import pytest

from ..core.errors import RendezvousStateError

if TYPE_CHECKING:
    from .backend import RendezvousBackend, Token

__all__ = ["FOREIGN_TOKENS", "BackendContract", "Connect", "Make", "phase_wait_during_a_write"]

#: ``connect(run_id)``: a new client of the storage under test, for run ``run_id``.
Connect = Callable[[str], "RendezvousBackend"]


class Make(Protocol):
    """What the tests call: a new client of the test's run (``make()``), or of
    another run on the same storage (``make(suffix)``: run id + ``suffix``)."""

    def __call__(self, suffix: str = "") -> RendezvousBackend: ...


#: Tokens no backend hands out (rallypoint's tokens are ints, memory's versions or
#: etcd's revisions, or c10d's stored bytes): each must simply lose, as torch's
#: ``RendezvousBackend`` documents for a token that does not match.
FOREIGN_TOKENS: list[object] = [
    "a string",
    b"junk bytes",
    b"1:ab:blob",  # c10d's format, but never stored
    object(),
    2**62,
    -1,
    0,
    3.5,
    True,
    (1, 2),
]


def _token_id(token: object) -> str:
    """A test id for ``token``: its repr, but for a bare ``object()``, whose repr
    holds its address (ids must be the same in every process that collects them,
    as when the suite is spread over several)."""
    return "object()" if type(token) is object else repr(token)


def _join(thread: threading.Thread) -> None:
    # Generous bound: every wait in this suite returns as soon as the write it
    # waits for lands; a thread still alive after it is a wait that never woke.
    thread.join(timeout=30)


def phase_wait_during_a_write(
    waiting: RendezvousBackend, writing: RendezvousBackend, token: Token | None, phase: int
) -> list[bool]:
    """What ``waiting.wait_for_phase(0)`` returns while ``writing`` wins a write of
    ``phase`` over ``token`` (``[]``: the wait was still blocked 30 s later)."""
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(waiting.wait_for_phase(0, 30.0)))
    waiter.start()
    try:
        written = writing.set_state(b"two", token, phase=phase)
        assert written is not None and written[2], "the write over the current token lost"
    finally:
        _join(waiter)
    return result


def _won(result: tuple[bytes, Token, bool] | None) -> tuple[bytes, Token]:
    """The blob and token of a write that must have won."""
    assert result is not None and result[2], f"the write lost: {result!r}"
    return result[0], result[1]


class BackendContract:
    """The contract of :class:`rallypoint.adapters.RendezvousBackend`, one test per
    promise (compare-and-set with a token, side counters, the phase key and its
    wait, the per-round intent log). Subclass it and override :meth:`connect`."""

    #: How much longer than asked a wait that times out may block. Generous on
    #: purpose: it tells "honours its timeout" from "blocks for the store's default
    #: timeout or forever", not fast from slow (c10d's FileStore rounds timeouts up
    #: to whole seconds; a TCPStore client that times out also cancels its wait on
    #: the server and logs the socket, seconds on a loaded or DNS-less host). Give
    #: the clients under test a default timeout well above it.
    wait_slack: float = 20.0
    #: False for a store with no append operation (c10d's FileStore), whose
    #: ``announce`` reads and rewrites the log: its bytes then grow with the log.
    announce_appends: bool = True
    #: What a stored value the backend cannot read raises, besides the core's
    #: :class:`~rallypoint.core.errors.RendezvousStateError` (rallypoint's own
    #: backends: torch's class of the same name too, which torch's agent catches).
    state_error: type[Exception] = RendezvousStateError

    @pytest.fixture
    def connect(self) -> Connect:
        """Override: ``connect(run_id)`` returns a new client of your storage."""
        raise NotImplementedError("override the connect fixture in your subclass")

    def write_foreign_state(self, backend: RendezvousBackend) -> None:
        """Override: store in ``backend``'s state key a value it did not write
        (what another program would leave there). By default the test that needs
        it is skipped, for a store nothing else can write to."""
        pytest.skip("nothing but the backend itself can write its state")

    @pytest.fixture
    def make(self, connect: Connect) -> Iterator[Make]:
        run_id = f"contract-{uuid.uuid4().hex[:12]}"
        made: list[RendezvousBackend] = []

        def make(suffix: str = "") -> RendezvousBackend:
            made.append(connect(run_id + suffix))
            return made[-1]

        yield make
        for backend in made:
            backend.close()

    # -- compare-and-set with a token -----------------------------------------------

    def test_empty_backend_has_no_state(self, make: Make) -> None:
        assert make().get_state() is None

    def test_first_write_creates_the_state(self, make: Make) -> None:
        a, b = make(), make()
        blob, token = _won(a.set_state(b"one", None))
        assert blob == b"one"
        assert b.get_state() == (b"one", token)

    def test_the_token_of_set_state_defaults_to_none(self, make: Make) -> None:
        backend = make()
        assert _won(backend.set_state(b"first"))[0] == b"first"
        # Only if no state exists: the existing one comes back, with its token.
        lost = backend.set_state(b"second")
        assert lost is not None
        stored, token, won = lost
        assert (stored, won) == (b"first", False)
        assert backend.get_state() == (b"first", token)

    def test_create_loses_when_state_exists(self, make: Make) -> None:
        a, b = make(), make()
        _, token = _won(a.set_state(b"one", None))
        assert b.set_state(b"two", None) == (b"one", token, False)
        assert a.get_state() == (b"one", token)

    def test_stale_token_loses_and_returns_the_current_state(self, make: Make) -> None:
        a, b = make(), make()
        _, t1 = _won(a.set_state(b"one", None))
        _, t2 = _won(b.set_state(b"two", t1))
        assert t2 != t1
        assert a.set_state(b"three", t1) == (b"two", t2, False)
        assert a.get_state() == (b"two", t2)

    def test_every_write_gets_a_new_token(self, make: Make) -> None:
        a = make()
        token = None
        seen = set()
        for _ in range(5):
            _, token = _won(a.set_state(b"same", token))
            seen.add(token)
        assert len(seen) == 5

    @pytest.mark.parametrize("foreign", FOREIGN_TOKENS, ids=_token_id)
    def test_a_token_the_backend_never_handed_out_loses(self, make: Make, foreign: object) -> None:
        backend = make()
        # Nothing stored yet: the write loses and there is nothing to return.
        assert backend.set_state(b"never", foreign) is None
        assert backend.get_state() is None
        _, token = _won(backend.set_state(b"real"))
        assert backend.set_state(b"never", foreign) == (b"real", token, False)
        assert backend.get_state() == (b"real", token)
        # The token it did hand out still wins.
        _won(backend.set_state(b"next", token))

    def test_a_stored_value_the_backend_cannot_read_is_a_state_error(self, make: Make) -> None:
        backend = make()
        _, token = _won(backend.set_state(b"state"))
        self.write_foreign_state(backend)
        for call in (backend.get_state, lambda: backend.set_state(b"x", token)):
            with pytest.raises(RendezvousStateError) as caught:
                call()
            assert isinstance(caught.value, self.state_error)
            key = getattr(backend, "key", None)
            if key is not None:  # optional: the message names the key to inspect
                assert key("state") in str(caught.value)

    def test_concurrent_increments_lose_no_update(self, make: Make) -> None:
        _won(make().set_state(b"0", None))
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

    # -- side counters (heartbeats) -------------------------------------------------

    def test_heartbeats_count_per_node(self, make: Make) -> None:
        a, b = make(), make()
        assert a.get_heartbeats(["x", "y"]) == {"x": 0, "y": 0}
        assert a.beat("x") == 1
        assert b.beat("x") == 2
        assert b.beat("y") == 1
        assert a.get_heartbeats(["x", "y", "z"]) == {"x": 2, "y": 1, "z": 0}

    def test_a_heartbeat_does_not_rewrite_the_state(self, make: Make) -> None:
        a = make()
        _, token = _won(a.set_state(b"x" * 10_000, None))
        before = a.stats.heartbeat_bytes_written
        a.beat("node-1")
        per_beat = a.stats.heartbeat_bytes_written - before
        assert 0 < per_beat < 100
        # The state's token is untouched: a beat is not a state write.
        assert a.get_state() == (b"x" * 10_000, token)

    # -- the phase key: waiters wake on a phase change, not on every write ----------

    @pytest.mark.parametrize("created", [False, True])
    def test_a_won_write_with_a_phase_wakes_a_phase_waiter(self, make: Make, created: bool) -> None:
        a, b = make(), make()
        token = _won(a.set_state(b"one", None, phase=0))[1] if created else None
        assert phase_wait_during_a_write(b, a, token, phase=1) == [True]

    def test_a_write_that_keeps_the_phase_wakes_no_phase_waiter(self, make: Make) -> None:
        a, b = make(), make()
        _, token = _won(a.set_state(b"one", None, phase=3))
        done = threading.Event()

        def write() -> None:
            nonlocal token
            _, token = _won(a.set_state(b"two", token))
            _, token = _won(a.set_state(b"three", token, phase=3))
            done.set()

        writer = threading.Thread(target=write)
        writer.start()
        try:
            assert b.wait_for_phase(3, 0.3) is False
        finally:
            _join(writer)
        assert done.is_set()
        assert b.get_state() == (b"three", token)
        assert b.wait_for_phase(2, 30.0) is True

    def test_a_lost_write_publishes_no_phase(self, make: Make) -> None:
        a, b = make(), make()
        _, t1 = _won(a.set_state(b"one", None, phase=0))
        _, t2 = _won(b.set_state(b"two", t1))
        assert a.set_state(b"three", t1, phase=1) == (b"two", t2, False)
        assert a.set_state(b"four", None, phase=1) == (b"two", t2, False)
        started = time.monotonic()
        assert b.wait_for_phase(0, 0.05) is False
        assert time.monotonic() - started < 0.05 + self.wait_slack

    def test_a_lost_first_write_publishes_no_phase(self, make: Make) -> None:
        written = make().set_state(b"x", None)
        assert written is not None
        fresh = make("-fresh")
        # A token of another run: nothing is stored here, so the write loses (None).
        assert fresh.set_state(b"one", written[1], phase=1) is None
        assert fresh.wait_for_phase(0, 0.05) is False

    def test_wait_for_phase_returns_at_once_for_a_passed_phase(self, make: Make) -> None:
        a, b = make(), make()
        token = None
        for phase in range(3):
            _, token = _won(a.set_state(b"s%d" % phase, token, phase=phase))
        started = time.monotonic()
        assert b.wait_for_phase(0, 3 * self.wait_slack) is True
        assert b.wait_for_phase(1, 3 * self.wait_slack) is True
        assert time.monotonic() - started < self.wait_slack

    def test_wait_for_phase_times_out(self, make: Make) -> None:
        a = make()
        started = time.monotonic()
        assert a.wait_for_phase(0, 0.0) is False  # nothing ever written
        assert time.monotonic() - started < self.wait_slack
        _won(a.set_state(b"one", None, phase=2))
        started = time.monotonic()
        assert a.wait_for_phase(2, 0.05) is False
        assert time.monotonic() - started < 0.05 + self.wait_slack

    # -- the intent log: one append per joiner, the log read in one operation ------

    def test_intents_keep_append_order_and_duplicates_per_round(self, make: Make) -> None:
        a, b = make(), make()
        a.announce(1, b"node-a")
        b.announce(1, b"node-b")
        a.announce(10, b"node-c")
        a.announce(1, b"node-a")
        b.announce(2, b"")
        assert a.intents(1) == [b"node-a", b"node-b", b"node-a"]
        assert b.intents(1) == [b"node-a", b"node-b", b"node-a"]
        assert b.intents(10) == [b"node-c"]
        assert a.intents(2) == [b""]

    def test_an_entry_equal_to_the_whole_log_is_still_appended(self, make: Make) -> None:
        # torch's fallback Store.append (FileStore) drops exactly this append.
        a, b = make(), make()
        a.announce(4, b"same")
        b.announce(4, b"same")
        a.announce(4, b"same")
        assert a.intents(4) == [b"same", b"same", b"same"]

    def test_an_announced_entry_is_visible_to_every_client_at_once(self, make: Make) -> None:
        # TCPStore's append returns before the server applied it; announce must not.
        a, b = make(), make()
        for round in range(100):
            a.announce(round, b"a%d" % round)
            assert b.intents(round) == [b"a%d" % round]

    def test_intents_of_a_round_nobody_announced_in_are_empty(self, make: Make) -> None:
        a = make()
        assert a.intents(7) == []
        assert a.intents(7) == []  # the read created nothing
        a.announce(7, b"x")
        assert a.intents(7) == [b"x"]
        assert a.intents(0) == []

    def test_intents_are_isolated_between_run_ids(self, make: Make) -> None:
        a, other = make(), make("-other")
        a.announce(1, b"mine")
        other.announce(1, b"theirs")
        assert a.intents(1) == [b"mine"]
        assert other.intents(1) == [b"theirs"]
        assert make().intents(1) == [b"mine"]

    def test_an_intent_with_a_newline_is_rejected(self, make: Make) -> None:
        a = make()
        with pytest.raises(ValueError, match="newline"):
            a.announce(1, b"half\nhalf")
        with pytest.raises(ValueError, match="newline"):
            a.announce(1, b"\n")
        assert a.intents(1) == []

    def test_concurrent_announces_lose_no_entry(self, make: Make) -> None:
        per_client = 10

        def worker(backend: RendezvousBackend, name: str) -> None:
            for i in range(per_client):
                backend.announce(3, b"%s-%d" % (name.encode(), i))

        names = ["a", "b", "c", "d"]
        threads = [threading.Thread(target=worker, args=(make(), n)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        log = make().intents(3)
        expected = [b"%s-%d" % (n.encode(), i) for n in names for i in range(per_client)]
        assert sorted(log) == sorted(expected)
        for n in names:  # each client's entries in its own order
            mine = [e for e in log if e.startswith(n.encode() + b"-")]
            assert mine == [b"%s-%d" % (n.encode(), i) for i in range(per_client)]

    def test_new_operations_are_counted(self, make: Make) -> None:
        a = make()
        entry = b"e" * 30
        a.announce(1, b"f" * 1000)
        ops, written = a.stats.ops, a.stats.bytes_written
        a.announce(1, entry)
        # At most two operations (TCPStore: the append and a check that it landed;
        # FileStore, without native append: a read and a compare-and-set).
        assert ops < a.stats.ops <= ops + 2
        if self.announce_appends:
            # O(len(entry)): the entry and a key, never the state or the log.
            assert len(entry) <= a.stats.bytes_written - written < len(entry) + 200
        a.announce(1, entry)
        ops, read = a.stats.ops, a.stats.bytes_read
        assert a.intents(1) == [b"f" * 1000, entry, entry]
        assert a.stats.ops == ops + 1
        assert a.stats.bytes_read - read >= 1000 + 2 * len(entry)
        ops = a.stats.ops
        a.wait_for_phase(0, 0.0)
        assert a.stats.ops > ops
