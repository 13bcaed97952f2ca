"""The etcd backend: the rendezvous state in etcd v3, CAS on the key's mod_revision.

Key layout under ``<prefix>/<run_id>/`` (default prefix ``/rallypoint``):

====================  =========================================================
key                   value
====================  =========================================================
``state``             the state blob; its ``mod_revision`` is the fencing token.
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

Waiting is an etcd watch on ``state`` starting at ``token + 1``: no event is
missed between the read and the watch, and a waiter wakes as soon as the next
write commits. Waiting for a phase reads ``phase`` and watches it from the read's
revision + 1, ignoring puts of a phase not above the one waited on.

With ``ttl``, every state write attaches a fresh lease of ``ttl`` seconds (to
``phase`` too) and heartbeats refresh it: a run's state disappears ``ttl`` seconds
after its last node went silent (torch's etcd backend has the same option).

The client is duck-typed on the python-etcd3 API (``get``, ``get_response``,
``put``, ``transaction``, ``transactions``, ``add_watch_callback``,
``cancel_watch``, ``get_prefix``, ``lease``, ``refresh_lease``); the default is
``pyetcd`` from etcd-sdk-python.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from ..backend import BackendStats, StateSizeLimit, Token, check_intent_entry, parse_counter
from ..errors import RendezvousConnectionError, RendezvousStateError, describe

__all__ = ["EtcdBackend"]

_T = TypeVar("_T")

#: etcd's default ``--max-request-bytes`` (1.5 MiB): the server refuses larger requests.
DEFAULT_MAX_REQUEST_BYTES = 1536 * 1024
#: What a state write's txn carries besides the state value and the keys: the
#: compare, the phase value, a lease id, the protobuf framing of the raft entry.
_TXN_OVERHEAD_BYTES = 512


def _client_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from pyetcd.exceptions import Etcd3Exception

        errors.append(Etcd3Exception)
    except ImportError:  # pragma: no cover - another etcd3-style client
        pass
    try:
        import grpc

        errors.append(grpc.RpcError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


class EtcdBackend:
    """A :class:`~rallypoint.adapters.backend.RendezvousBackend` on etcd v3.

    Args:
        client: an etcd3-style client (e.g. ``pyetcd.client(host, port)``).
        run_id: namespaces every key.
        endpoint: ``host:port``, for messages.
        key_prefix: the root of this library's keys.
        ttl: optional lifetime (seconds) of the state after the last write or beat.
        max_request_bytes: the server's ``--max-request-bytes``; a state write
            larger than it allows is refused with a message before it is sent.
    """

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
    ) -> None:
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        self._client = client
        self._run_id = run_id
        self._endpoint = endpoint
        self._name = name
        self._root = f"{key_prefix.rstrip('/')}/{run_id}/"
        self._key = self._root + "state"
        self._phase_key = self._root + "phase"
        self._ttl = None if ttl is None else max(1, int(ttl))
        self._lease_id: int | None = None
        self._counters: dict[str, int] = {}
        self._stats = BackendStats()
        self._lock = threading.Lock()
        self._errors = _client_errors()
        self._max_request_bytes = max_request_bytes

    @property
    def name(self) -> str:
        return self._name

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def stats(self) -> BackendStats:
        return self._stats

    @property
    def state_size_limit(self) -> StateSizeLimit:
        """The largest state whose write txn fits in ``max_request_bytes``."""
        keys = 3 * len(self._key.encode()) + len(self._phase_key.encode())
        default = self._max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
        return StateSizeLimit(
            self._max_request_bytes - keys - _TXN_OVERHEAD_BYTES,
            f"etcd refuses requests over --max-request-bytes "
            f"({self._max_request_bytes:,} bytes{', its default' if default else ''})",
            "fewer nodes per run (max_nodes) or shorter node addresses, or an etcd server "
            "started with a larger --max-request-bytes (and the same value given to "
            "rallypoint)",
        )

    def _state_error(self, what: str) -> RendezvousStateError:
        return RendezvousStateError(
            describe(
                what,
                run_id=self._run_id,
                endpoint=self._endpoint,
                check="that no other program uses the same etcd prefix and run id",
            )
        )

    def _counter(self, key: str, value: bytes) -> int:
        return parse_counter(key, value, self._state_error)

    @property
    def client(self) -> Any:
        """The etcd client (shared with :class:`EtcdStore`)."""
        return self._client

    def key(self, suffix: str) -> str:
        """The full etcd key of ``suffix`` in this run's namespace."""
        return self._root + suffix

    def failure(self, exc: BaseException) -> RendezvousConnectionError:
        """The error to raise for a client exception."""
        return RendezvousConnectionError(
            describe(
                f"etcd failed ({exc.__class__.__name__}: {str(exc)[:200]})",
                run_id=self._run_id,
                endpoint=self._endpoint,
                check="that the etcd server is running and reachable at this address "
                "(etcdctl --endpoints=<endpoint> endpoint health)",
            )
        )

    def call(self, op: Callable[[], _T], written: int = 0, read: int = 0) -> _T:
        """Run one client operation: count it, and turn client errors into
        :class:`RendezvousConnectionError`."""
        try:
            result = op()
        except self._errors as exc:
            raise self.failure(exc) from exc
        with self._lock:
            self._stats.ops += 1
            self._stats.bytes_written += written
            self._stats.bytes_read += read
        return result

    def _read_bytes(self, n: int) -> None:
        with self._lock:
            self._stats.bytes_read += n

    def get_state(self) -> tuple[bytes, Token] | None:
        value, meta = self.call(lambda: self._client.get(self._key), written=len(self._key))
        if value is None:
            return None
        self._read_bytes(len(value))
        self._lease_id = getattr(meta, "lease_id", None) or None
        return bytes(value), int(meta.mod_revision)

    def set_state(
        self, state: bytes, token: Token | None, phase: int | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """One txn: compare the token, then put the state (and, with ``phase``, the
        ``phase`` key: both or neither), else get the state."""
        if phase is not None and phase < 0:
            raise ValueError(f"phase must be a non-negative integer, got {phase}")
        tx = self._client.transactions
        if token is None:
            compare = [tx.version(self._key) == 0]
        else:
            compare = [tx.mod(self._key) == int(token)]
        lease = None
        if self._ttl is not None:
            lease = self.call(lambda: self._client.lease(self._ttl), written=8)
        success = [tx.put(self._key, bytes(state), lease)]
        written = len(self._key) * 2 + len(state)
        if phase is not None:
            value = str(phase).encode()
            success.append(tx.put(self._phase_key, value, lease))
            written += len(self._phase_key) + len(value)
        ok, responses = self.call(
            lambda: self._client.transaction(
                compare=compare, success=success, failure=[tx.get(self._key)]
            ),
            written=written,
        )
        if ok:
            if lease is not None:
                self._lease_id = int(lease.id)
            return bytes(state), int(responses[0].response_put.header.revision), True
        kvs = responses[0] if responses else []
        if not kvs:
            return None
        value, meta = kvs[0]
        self._read_bytes(len(value))
        return bytes(value), int(meta.mod_revision), False

    def wait_for_change(self, token: Token | None, timeout: float) -> bool:
        if token is None:
            response = self.call(lambda: self._client.get_response(self._key))
            if response.count > 0:
                return True
            start = int(response.header.revision) + 1
        else:
            start = int(token) + 1
        return self.watch(self._key, start, timeout)

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
            lambda: self._client.get_response(self._phase_key), written=len(self._phase_key)
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

        A callback watch rather than ``watch_once``: when the server goes away, the
        client hands the stream error to the callback, which is reported as a
        :class:`RendezvousConnectionError` instead of crashing the caller.
        """
        fired = threading.Event()
        box: list[object] = []

        def callback(response: object) -> None:
            if accept is not None and not isinstance(response, BaseException):
                events = getattr(response, "events", None) or []
                if not any(accept(event) for event in events):
                    return
            box.append(response)
            fired.set()

        watch_id = self.call(
            lambda: self._client.add_watch_callback(key, callback, start_revision=start_revision)
        )
        try:
            if not fired.wait(max(timeout, 0.0)):
                return False
        finally:
            # The stream may already be gone with the server.
            with contextlib.suppress(*self._errors):
                self._client.cancel_watch(watch_id)
        if isinstance(box[0], BaseException):
            raise self.failure(box[0])
        return True

    def _intents_prefix(self, round: int) -> str:
        return f"{self._root}intents/{round}/"

    def announce(self, round: int, entry: bytes) -> None:
        """Put ``intents/<round>/<random suffix>`` = ``entry``: one put,
        O(len(entry)) bytes; the suffix keeps repeated entries apart."""
        entry = check_intent_entry(entry)
        key = self._intents_prefix(round) + secrets.token_hex(8)
        self.call(lambda: self._client.put(key, entry), written=len(key) + len(entry))

    def intents(self, round: int) -> list[bytes]:
        """One prefix get sorted by create revision: every put creates its key in
        a revision of its own, so this is commit order."""
        prefix = self._intents_prefix(round)
        log: list[bytes] = []

        def read() -> None:
            for value, meta in self._client.get_prefix(
                prefix, sort_order="ascend", sort_target="create"
            ):
                self._read_bytes(len(value) + len(meta.key))
                log.append(bytes(value))

        self.call(read, written=len(prefix))
        return log

    def _hbkey(self, node: str) -> str:
        return f"{self._root}hb/{node}"

    def beat(self, node: str) -> int:
        key = self._hbkey(node)
        if node not in self._counters:
            value, _ = self.call(lambda: self._client.get(key), written=len(key))
            self._counters[node] = self._counter(key, value) if value else 0
        counter = self._counters[node] + 1
        payload = str(counter).encode()
        self.call(lambda: self._client.put(key, payload), written=len(key) + len(payload))
        self._counters[node] = counter
        with self._lock:
            self._stats.heartbeat_ops += 1
            self._stats.heartbeat_bytes_written += len(key) + len(payload)
        lease_id = self._lease_id
        if lease_id is not None:
            # Keep the state alive while anyone beats; a lease that already expired
            # is simply gone (the next write attaches a new one).
            try:
                self.call(lambda: list(self._client.refresh_lease(lease_id)), written=8)
            except RendezvousConnectionError:
                self._lease_id = None
        return counter

    def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]:
        prefix = f"{self._root}hb/"
        wanted = set(nodes)
        found: dict[str, int] = {}

        def read() -> None:
            for value, meta in self._client.get_prefix(prefix):
                name = bytes(meta.key).decode()[len(prefix) :]
                self._read_bytes(len(value) + len(meta.key))
                if name in wanted:
                    found[name] = self._counter(prefix + name, value)

        self.call(read, written=len(prefix))
        return {node: found.get(node, 0) for node in nodes}

    def close(self) -> None:
        close = getattr(self._client, "close", None)
        if close is not None:
            close()
