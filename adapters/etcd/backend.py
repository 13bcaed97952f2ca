"""The etcd backend: the rendezvous state in etcd v3, CAS on the key's mod_revision.

Key layout under ``<prefix>/<run_id>/`` (default prefix ``/rallypoint``):

====================  =========================================================
key                   value
====================  =========================================================
``state``             ``rp1:`` + the state blob; its ``mod_revision`` is the
                      fencing token. The prefix lets the backend tell a value it
                      wrote from anything else (torch's contract: a stored state
                      it cannot read is a :class:`RendezvousStateError`).
                      A write is one txn: ``mod_revision(state) == token`` (or
                      ``version(state) == 0`` to create) then put, else get, so a
                      lost write returns the current state in the same round trip.
``phase``             the highest published phase (decimal), put in the same txn
                      as the state (with the same lease), only by a write that
                      carries a phase: a write that changes nothing a waiting node
                      cares about leaves it alone and wakes nobody (docs/design.md,
                      decision 8). Waiters watch this key, not ``state``.
``intents/<round>/``  the intent log of ``round``: one key per entry (a random
                      suffix, so duplicates are kept), value = the entry, read in
                      one prefix get sorted by create revision, i.e. commit order.
                      The winner of the next state write admits every intent
                      logged so far, in one batch.
``hb/<node>``         the node's heartbeat counter (decimal); each node writes only
                      its own key, so a put is a safe O(1) increment.
``kv/<key>``          the keys of :class:`EtcdStore`, the torch Store handed to
                      the agent (per-round namespaces, bootstrap addresses).
====================  =========================================================

Waiting for a phase reads ``phase`` and watches it from the read's revision + 1:
no put is missed between the read and the watch, a waiter wakes as soon as a
phase above the one waited on commits, and puts of a phase not above it are
ignored.

With ``ttl``, every state write attaches a fresh lease of ``ttl`` seconds (to
``phase`` too) and heartbeats refresh it: a run's state disappears ``ttl`` seconds
after its last node went silent (torch's etcd backend has the same option).

Every client call is retried through connection errors for ``retry_window``
seconds (``read_timeout`` when built by the factory): a member that is down,
restarting, stopped or in a leader election, pyetcd's "failed node" ban and a
forgotten auth token all look the same from here (:mod:`.client` classifies them),
and each failure moves to a new client on the next member of the endpoint list. A
retry never applies a write twice: the state txn compares the revision it read,
so a txn that did commit before the connection broke loses when it is sent again
and returns what is stored (a loss the caller decides again on); intents and
heartbeats are puts of fixed keys and values, the same when repeated.

The client is duck-typed on the python-etcd3 API (``get``, ``get_response``,
``put``, ``transaction``, ``transactions``, ``add_watch_callback``,
``cancel_watch``, ``get_prefix``, ``lease``, ``refresh_lease``); the default is
``pyetcd`` from etcd-sdk-python, one client per member through
:class:`~rallypoint.adapters.etcd.client.EtcdConnection`.
"""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

from ..backend import BackendBase, StateSizeLimit, Token, check_intent_entry
from ..errors import RendezvousConnectionError
from .client import FATAL, EtcdConnection, classify, error_text

__all__ = ["STATE_PREFIX", "EtcdBackend", "QuorumLostError"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: etcd's default ``--max-request-bytes`` (1.5 MiB): the server refuses larger requests.
DEFAULT_MAX_REQUEST_BYTES = 1536 * 1024
#: What a state write's txn carries besides the state value and the keys: the
#: compare, the phase value, a lease id, the protobuf framing of the raft entry.
_TXN_OVERHEAD_BYTES = 512
#: What every stored state value starts with; the state blob follows.
STATE_PREFIX = b"rp1:"
#: Pauses between retries of a failing call: 25-50 ms at first, doubling, at most
#: this (so a member that is back is used again within half a second).
_MAX_RETRY_PAUSE = 0.5
#: A watch whose stream broke returns early (the caller re-reads through the
#: retrying calls) after this pause, so a broken stream is not re-opened in a spin.
_BROKEN_WATCH_PAUSE = 0.05


class QuorumLostError(RendezvousConnectionError):
    """A call gave up and the backend's ``diagnose`` said why: the embedded etcd
    lost its quorum (the members' nodes are gone). The message is that reason and
    what to do; advice about a server to start or reach would contradict it."""


def _is_revision(token: object) -> bool:
    """Whether ``token`` can be one this backend handed out (a positive revision)."""
    return isinstance(token, int) and not isinstance(token, bool) and token > 0


class EtcdBackend(BackendBase):
    """A :class:`~rallypoint.adapters.backend.RendezvousBackend` on etcd v3.

    Args:
        client: an :class:`~rallypoint.adapters.etcd.client.EtcdConnection` (one
            client per cluster member, with failover), or a ready etcd3-style
            client (e.g. ``pyetcd.client(host, port)``).
        run_id: namespaces every key.
        endpoint: the member list (``host:port[,host:port...]``), for messages.
        key_prefix: the root of this library's keys.
        ttl: optional lifetime (seconds) of the state after the last write or beat.
        max_request_bytes: the server's ``--max-request-bytes``; a state write
            larger than it allows is refused with a message before it is sent.
        retry_window: how long (seconds) a call keeps retrying through connection
            errors before it raises :class:`RendezvousConnectionError` (0: at the
            first one; the next call still reconnects).
        diagnose: called when a call gives up, for what is wrong beyond this
            connection (the embedded etcd: which members lost the quorum); None
            when it knows nothing more.
        on_close: called in order by :meth:`close` (once): the embedded etcd
            says this agent is done, waits for the others, and stops its member.
    """

    STATE_CHECK = "that no other program uses the same etcd prefix and run id"

    def __init__(
        self,
        client: Any,
        run_id: str,
        *,
        endpoint: str,
        key_prefix: str = "/rallypoint",
        ttl: float | None = None,
        name: str = "rallypoint-etcd",
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        retry_window: float = 0.0,
        diagnose: Callable[[], str | None] | None = None,
        on_close: Sequence[Callable[[], None]] = (),
    ) -> None:
        root = f"{key_prefix.rstrip('/')}/{run_id}/"
        super().__init__(run_id, name=name, endpoint=endpoint, root=root)
        if isinstance(client, EtcdConnection):
            self._conn = client
        else:
            self._conn = EtcdConnection.around(client, endpoint)
        self._key = self.key("state")
        self._phase_key = self.key("phase")
        self._ttl = None if ttl is None else max(1, int(ttl))
        self._lease_id: int | None = None
        self._counters: dict[str, int] = {}
        self._lock = threading.Lock()
        self._max_request_bytes = max_request_bytes
        self._retry_window = max(0.0, float(retry_window))
        self._rng = random.Random()
        self._down_since: float | None = None
        self._outages = 0
        self._diagnose = diagnose
        self._on_close = list(on_close)

    @property
    def retry_window(self) -> float:
        """Seconds a call retries through connection errors before it raises."""
        return self._retry_window

    @property
    def outages(self) -> int:
        """Bumped when this backend's calls start failing and again when they work
        again: :class:`~rallypoint.adapters.sync.StateSync` then re-times its
        peers' heartbeats, so the time nobody could beat is not held against them."""
        return self._outages

    @property
    def state_size_limit(self) -> StateSizeLimit:
        """The largest state whose write txn fits in ``max_request_bytes``."""
        keys = 3 * len(self._key.encode()) + len(self._phase_key.encode())
        default = self._max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
        return StateSizeLimit(
            self._max_request_bytes - keys - len(STATE_PREFIX) - _TXN_OVERHEAD_BYTES,
            f"etcd refuses requests over --max-request-bytes "
            f"({self._max_request_bytes:,} bytes{', its default' if default else ''})",
            "fewer nodes per run (max_nodes) or shorter node addresses, or an etcd server "
            "started with a larger --max-request-bytes (and the same value given to "
            "rallypoint)",
        )

    @property
    def connection(self) -> EtcdConnection:
        """The connection (shared with :class:`EtcdStore`): the client in use and
        the member list it fails over along."""
        return self._conn

    @property
    def client(self) -> Any:
        """The etcd client in use now (it is replaced after a connection error)."""
        return self._conn.current()

    def failure(self, exc: BaseException, waited: float | None = None) -> RendezvousConnectionError:
        """The error to raise for a client exception (``waited``: seconds spent
        retrying before giving up)."""
        after = "" if waited is None else f", still after retrying for {waited:.1f} s"
        cause = None
        if self._diagnose is not None and classify(exc) != FATAL:
            with contextlib.suppress(Exception):
                cause = self._diagnose()
        if cause is not None:
            return QuorumLostError(
                f"{cause} (run id {self._run_id!r}, endpoint {self.endpoint!r}; etcd's last "
                f"error: {error_text(exc)}{after})"
            )
        return RendezvousConnectionError(
            self._describe(
                f"etcd failed ({error_text(exc)}{after})",
                "that the etcd server is running and reachable at this address "
                "(etcdctl --endpoints=<endpoint> endpoint health), and that read_timeout "
                "is longer than its outages",
            )
        )

    def call(
        self,
        op: Callable[[Any], _T],
        written: int = 0,
        read: int = 0,
        *,
        retry_window: float | None = None,
    ) -> _T:
        """Run ``op(client)``, count it, and retry it through connection errors for
        ``retry_window`` seconds (None: :attr:`retry_window`), each time on a new
        client (the next member).

        ``op`` must be safe to run again after a connection error (the request
        may or may not have been applied): a compare-and-set, or a put of a fixed
        key and value.

        Raises:
            RendezvousConnectionError: a client error that a retry cannot fix
                (bad credentials, no permission, ...), or connection errors for
                the whole retry window, or the backend was closed.
        """
        window = self._retry_window if retry_window is None else max(0.0, retry_window)
        started: float | None = None
        attempt = 0
        while True:
            client = None
            try:
                client = self._conn.current()
                result = op(client)
            except Exception as exc:
                kind = classify(exc)
                if kind is None:
                    raise
                if kind == FATAL or self._conn.closed:
                    raise self.failure(exc) from exc
                now = time.monotonic()
                if started is None:
                    started = now
                    self._going_down(exc, window)
                self._conn.failed(client, kind)
                waited = now - started
                left = window - waited
                if left <= 0:
                    raise self.failure(exc, waited if window > 0 else None) from exc
                pause = min(_MAX_RETRY_PAUSE, 0.05 * 2 ** min(attempt, 4))
                attempt += 1
                time.sleep(min(self._rng.uniform(pause / 2, pause), left))
                continue
            if self._down_since is not None:
                self._back_up()
            self._count(written=written, read=read)
            return result

    def _going_down(self, exc: BaseException, window: float) -> None:
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
            self._outages += 1
        if window > 0:
            log.warning(
                "etcd at %s failed (%s); retrying for up to %.0f s (endpoints %s)",
                self._conn.endpoint_in_use,
                error_text(exc),
                window,
                ",".join(self._conn.endpoints),
            )

    def _back_up(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            down = time.monotonic() - self._down_since
            self._down_since = None
            self._outages += 1
        log.warning("etcd answers again after %.2f s, at %s", down, self._conn.endpoint_in_use)

    def _read_bytes(self, n: int) -> None:
        self._count(ops=0, read=n)

    def _unframe(self, value: bytes) -> bytes:
        if not value.startswith(STATE_PREFIX):
            raise self._state_error(
                f"the rendezvous state key {self._key!r} holds a value rallypoint did not "
                f"write ({value[:40]!r})"
            )
        return value[len(STATE_PREFIX) :]

    def get_state(self) -> tuple[bytes, Token] | None:
        """The state blob and its token (the key's ``mod_revision``).

        Raises:
            RendezvousStateError: the state key holds a value this backend did not
                write.
            RendezvousConnectionError: etcd stayed unreachable.
        """
        value, meta = self.call(lambda c: c.get(self._key), written=len(self._key))
        if value is None:
            return None
        self._read_bytes(len(value))
        self._lease_id = getattr(meta, "lease_id", None) or None
        return self._unframe(bytes(value)), int(meta.mod_revision)

    def set_state(
        self, state: bytes, token: Token | None = None, phase: int | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """One txn: compare the token, then put the state (and, with ``phase``, the
        ``phase`` key: both or neither), else get the state.

        A ``token`` this backend never hands out (not a positive revision number)
        cannot match the stored one: the write loses and the stored state is
        returned, as torch's contract says for any token that does not match.

        Raises:
            RendezvousStateError: the state key holds a value this backend did not
                write.
            RendezvousConnectionError: etcd stayed unreachable.
        """
        self._check_phase(phase)
        if token is not None and not _is_revision(token):
            current = self.get_state()
            return None if current is None else (current[0], current[1], False)
        value = STATE_PREFIX + bytes(state)
        lease_id = None
        if self._ttl is not None:
            ttl = self._ttl
            lease_id = int(self.call(lambda c: c.lease(ttl), written=8).id)
        phase_value = None if phase is None else str(phase).encode()
        written = len(self._key) * 2 + len(value)
        if phase_value is not None:
            written += len(self._phase_key) + len(phase_value)

        def txn(c: Any) -> Any:
            # Sent again after a connection error, a txn that did commit loses its
            # compare (the revision moved on) and returns the stored state: never
            # applied twice.
            tx = c.transactions
            if token is None:
                compare = [tx.version(self._key) == 0]
            else:
                compare = [tx.mod(self._key) == token]
            success = [tx.put(self._key, value, lease_id)]
            if phase_value is not None:
                success.append(tx.put(self._phase_key, phase_value, lease_id))
            return c.transaction(compare=compare, success=success, failure=[tx.get(self._key)])

        ok, responses = self.call(txn, written=written)
        if ok:
            if lease_id is not None:
                self._lease_id = lease_id
            return bytes(state), int(responses[0].response_put.header.revision), True
        kvs = responses[0] if responses else []
        if not kvs:
            return None
        stored, meta = kvs[0]
        self._read_bytes(len(stored))
        return self._unframe(bytes(stored)), int(meta.mod_revision), False

    def _phase_of(self, value: bytes) -> int:
        text = bytes(value)
        if not text.isdigit():
            raise self._state_error(
                f"the rendezvous phase key {self._phase_key!r} holds {text[:40]!r}, "
                "a value rallypoint did not write"
            )
        return int(text)

    def wait_for_phase(self, phase: int, timeout: float) -> bool:
        response = self.call(
            lambda c: c.get_response(self._phase_key), written=len(self._phase_key)
        )
        if response.count > 0:
            value = bytes(response.kvs[0].value)
            self._read_bytes(len(value))
            if self._phase_of(value) > phase:
                return True
        start = int(response.header.revision) + 1

        def above(event: Any) -> bool:
            # A put of a phase not above ``phase`` (a writer repeating the current
            # phase) is not what we wait for; a delete (the lease expired: its value
            # is empty) or anything unexpected is a change the caller must see.
            value = getattr(event, "value", None)
            if not isinstance(value, bytes) or not value.isdigit():
                return True
            return int(value) > phase

        return self.watch(self._phase_key, start, timeout, accept=above)

    def watch(
        self,
        key: str,
        start_revision: int,
        timeout: float,
        accept: Callable[[Any], bool] | None = None,
    ) -> bool:
        """Block until ``key`` changes at or after ``start_revision`` (True) or
        ``timeout`` passes (False). With ``accept``, only a watch response with an
        event for which ``accept(event)`` is true counts as a change.

        A watch whose stream breaks (the member went away, or another call moved
        to a new client) returns True early: the caller re-reads, through the
        retrying calls, and watches again from the revision it read, so no change
        is missed. So does a watch from a revision etcd already compacted.

        Raises:
            RendezvousConnectionError: the watch could not be created within the
                retry window, or etcd refused it for good (e.g. no permission).
        """
        from pyetcd.exceptions import RevisionCompactedError

        fired = threading.Event()
        box: list[object] = []

        def callback(response: object) -> None:
            if accept is not None and not isinstance(response, (BaseException, type(None))):
                events = getattr(response, "events", None) or []
                if not any(accept(event) for event in events):
                    return
            box.append(response)
            fired.set()

        def add(c: Any) -> tuple[Any, Any]:
            try:
                return c, c.add_watch_callback(key, callback, start_revision=start_revision)
            except RevisionCompactedError:
                return c, None

        client, watch_id = self.call(add)
        if watch_id is None:
            return True
        try:
            if not fired.wait(max(timeout, 0.0)):
                return False
        finally:
            # The stream may already be gone with the member.
            with contextlib.suppress(Exception):
                client.cancel_watch(watch_id)
        response = box[0]
        if response is None or isinstance(response, BaseException):
            if (
                isinstance(response, BaseException)
                and not isinstance(response, RevisionCompactedError)
                and classify(response) == FATAL
            ):
                raise self.failure(response)
            time.sleep(_BROKEN_WATCH_PAUSE)
        return True

    def _intents_prefix(self, round: int) -> str:
        return self.key(f"intents/{round}/")

    def announce(self, round: int, entry: bytes) -> None:
        """Put ``intents/<round>/<random suffix>`` = ``entry``: one put,
        O(len(entry)) bytes; the suffix keeps repeated entries apart (and is chosen
        once, so a put repeated after a connection error adds no duplicate)."""
        entry = check_intent_entry(entry)
        key = self._intents_prefix(round) + secrets.token_hex(8)
        self.call(lambda c: c.put(key, entry), written=len(key) + len(entry))

    def intents(self, round: int) -> list[bytes]:
        """One prefix get sorted by create revision: every put creates its key in
        a revision of its own, so this is commit order."""
        prefix = self._intents_prefix(round)

        def read(c: Any) -> list[tuple[bytes, bytes]]:
            found = c.get_prefix(prefix, sort_order="ascend", sort_target="create")
            return [(bytes(value), bytes(meta.key)) for value, meta in found]

        entries = self.call(read, written=len(prefix))
        self._read_bytes(sum(len(value) + len(key) for value, key in entries))
        return [value for value, _ in entries]

    def _hbkey(self, node: str) -> str:
        return self.key(f"hb/{node}")

    def beat(self, node: str) -> int:
        key = self._hbkey(node)
        if node not in self._counters:
            value, _ = self.call(lambda c: c.get(key), written=len(key))
            self._counters[node] = self._counter(key, value) if value else 0
        counter = self._counters[node] + 1
        payload = str(counter).encode()
        self.call(lambda c: c.put(key, payload), written=len(key) + len(payload))
        self._counters[node] = counter
        self._count(ops=0, heartbeat_ops=1, heartbeat_written=len(key) + len(payload))
        lease_id = self._lease_id
        if lease_id is not None:
            # Keep the state alive while anyone beats; a lease that already expired
            # is simply gone (the next write attaches a new one).
            try:
                self.call(lambda c: list(c.refresh_lease(lease_id)), written=8)
            except RendezvousConnectionError:
                self._lease_id = None
        return counter

    def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]:
        prefix = self.key("hb/")

        def read(c: Any) -> list[tuple[bytes, bytes]]:
            return [(bytes(meta.key), bytes(value)) for value, meta in c.get_prefix(prefix)]

        entries = self.call(read, written=len(prefix))
        self._read_bytes(sum(len(key) + len(value) for key, value in entries))
        wanted = set(nodes)
        found: dict[str, int] = {}
        for raw_key, value in entries:
            name = raw_key.decode("utf-8", "replace")[len(prefix) :]
            if name in wanted:
                found[name] = self._counter(prefix + name, value)
        return {node: found.get(node, 0) for node in nodes}

    def close(self) -> None:
        """Run the ``on_close`` hooks (once, each even if one before failed), then
        close the connection."""
        hooks, self._on_close = self._on_close, []
        try:
            for hook in hooks:
                try:
                    hook()
                except Exception as exc:
                    log.warning("closing the etcd backend: %s: %s", type(exc).__name__, exc)
        finally:
            self._conn.close()
