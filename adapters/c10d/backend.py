"""The c10d backend: the rendezvous state in a ``torch.distributed.Store``.

Key layout under ``rallypoint/<run_id>/`` (documented in docs/adapters.md):

====================  ==========================================================
key                   value
====================  ==========================================================
``state``             ``b"<version>:<nonce>:" + blob``; version 0 with an empty
                      blob means "no state yet". The whole value is the fencing
                      token, so ``compare_set`` is the CAS (as torch's
                      C10dRendezvousBackend); the writer's random nonce makes two
                      writes of the same blob distinguishable, so a writer knows it
                      won only if its own value is stored.
``p/<phase>``         set (empty) right after a won write that moved the
                      rendezvous to ``phase``: a waiter that read phase q blocks
                      in ``store.wait(["p/<q+1>"])``. The core bumps the phase by
                      exactly 1 whenever something a waiting node cares about
                      changes, so a write that changes nothing a waiter cares
                      about wakes nobody (docs/design.md, decision 8).
``intents/<round>``   the intent log of ``round``: ``entry + b"\\n"`` appended per
                      joiner with ``store.append`` (TCPStore: O(len(entry))
                      bytes, appended by the server, then a ``check`` so the
                      entry is visible when ``announce`` returns; FileStore: a
                      compare-and-set loop, see ``announce``). The winner of
                      the next state write admits every intent logged so far,
                      in one batch. Read with ``compare_set(key, S, S)`` for a
                      sentinel S that no log can equal: it returns S for a
                      missing key without creating it (``get`` would block),
                      the log otherwise.
``hb/<node>``         the node's heartbeat counter, bumped with ``store.add``: a
                      heartbeat sends a key and an integer, never the state.
====================  ==========================================================

The store's ``wait`` blocks the connection it runs on, so waits use their own
client connection (``wait_store``), and a heartbeat thread is never stuck behind a
waiting rendezvous.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Protocol, TypeVar, cast

from torch.distributed import PrefixStore, Store, TCPStore

from ..backend import BackendBase, StateSizeLimit, Token, check_intent_entry
from ..errors import RendezvousConnectionError

__all__ = ["C10dBackend"]

_T = TypeVar("_T")
_EMPTY = b"0::"
#: ``compare_set(key, _MISSING, _MISSING)`` returns ``_MISSING`` for a missing key
#: without creating it, and the stored value otherwise: a read that never blocks
#: (``get`` blocks on a missing key). Every intent log ends with a newline, so no
#: log can equal it.
_MISSING = "\x00rallypoint:missing\x00"
#: A TCPStore server drops the connection of a client that sends a value over 8 MiB.
_TCPSTORE_MAX_VALUE = 8 * 1024 * 1024
#: The ``<version>:<nonce>:`` head of the state value: a version of up to 20 digits,
#: 12 hex digits of nonce, two colons.
_STATE_HEAD_BYTES = 34


class _ExtendedStore(Protocol):
    """``Store.append`` and ``Store.multi_set``, which torch's type stubs lack
    (TCPStore, FileStore and HashStore have them at runtime)."""

    def append(self, key: str, value: bytes) -> None: ...

    def multi_set(self, keys: list[str], values: list[bytes]) -> None: ...


def _version(value: bytes) -> tuple[int, bytes] | None:
    """``<version>:<nonce>:<blob>`` -> (version, blob); None if rallypoint did not
    write ``value``."""
    head, sep, rest = bytes(value).partition(b":")
    _, sep2, blob = rest.partition(b":")
    # Version 0 is only ever the empty marker: any other version-0 value would read
    # as "no state yet" while every create loses against it (a spin, not an error).
    if not sep or not sep2 or not head.isdigit() or (int(head) == 0 and value != _EMPTY):
        return None
    return int(head), blob


def _tcp_store_of(store: Store) -> TCPStore | None:
    """The TCPStore under ``store`` (through PrefixStores), if it is one."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, TCPStore) else None


class C10dBackend(BackendBase):
    """A :class:`~rallypoint.adapters.backend.RendezvousBackend` on a c10d store.

    Args:
        store: a TCPStore or FileStore client (anything with ``compare_set``,
            ``multi_set`` and ``append``).
        run_id: namespaces every key.
        endpoint: ``host:port`` or the file path, for messages.
        wait_store: a second client of the same store used only for blocking waits
            (defaults to ``store``; pass one for TCPStore, see the module doc).
        on_close: called by :meth:`close` (e.g. to drop the hosting server).
    """

    STATE_CHECK = (
        "that no other program (or another rendezvous backend) uses the same store and run id"
    )

    def __init__(
        self,
        store: Store,
        run_id: str,
        *,
        endpoint: str,
        wait_store: Store | None = None,
        name: str = "rallypoint-c10d",
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(run_id, name=name, endpoint=endpoint, root=f"rallypoint/{run_id}/")
        self._store = store
        self._wait_store = wait_store if wait_store is not None else store
        self._key = self.key("state")
        self._on_close = on_close
        has_extended_api = getattr(store, "has_extended_api", None)
        self._native_append = bool(has_extended_api()) if callable(has_extended_api) else False
        # The store's get() blocks on a missing key; an initial version-0 value makes
        # every later get() return at once.
        # torch's Store stub says str; the binding takes bytes.
        self._call(
            lambda: store.compare_set(self._key, "", _EMPTY),  # type: ignore[arg-type]
            written=len(_EMPTY),
        )

    @property
    def state_size_limit(self) -> StateSizeLimit | None:
        """A TCPStore's value limit (less the version head); none for a FileStore."""
        if _tcp_store_of(self._store) is None:
            return None
        return StateSizeLimit(
            _TCPSTORE_MAX_VALUE - _STATE_HEAD_BYTES,
            "a c10d TCPStore holds values of at most 8 MiB",
            "fewer nodes per run (max_nodes) or shorter node addresses",
        )

    @property
    def store(self) -> Store:
        """The underlying store (the handler hands a per-round prefix of it to workers)."""
        return self._store

    def _failure(self, exc: BaseException) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            self._describe(
                f"the c10d store failed ({exc.__class__.__name__}: {str(exc)[:200]})",
                "that the node hosting the store (is_host) is running and reachable "
                "at this address, and that read_timeout is long enough",
            )
        )

    def _call(self, op: Callable[[], _T], written: int = 0) -> _T:
        try:
            result = op()
        except (RuntimeError, ValueError, TimeoutError) as exc:
            raise self._failure(exc) from exc
        read = len(result) if isinstance(result, (bytes, bytearray)) else 0
        self._count(written=written, read=read)
        return result

    def _decode(self, value: bytes) -> tuple[int, bytes]:
        decoded = _version(value)
        if decoded is None:
            raise self._state_error(
                f"the rendezvous state key {self._key!r} holds a value rallypoint did not "
                f"write ({bytes(value)[:40]!r})"
            )
        return decoded

    def get_state(self) -> tuple[bytes, Token] | None:
        value = bytes(self._call(lambda: self._store.get(self._key), written=len(self._key)))
        version, blob = self._decode(value)
        if version == 0:
            return None
        return blob, value

    def set_state(
        self, state: bytes, token: Token | None = None, phase: int | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Compare-and-set the state; after a won write with ``phase``, set
        ``p/<phase>``, which wakes the waiters.

        That key is set after the CAS, not atomically with it: a writer that dies
        in between leaves the waiters to their poll fallback (the state itself is
        written; the next reader sees it) or to the next phase-changing write,
        which sets ``p/<phase - 1>`` again.

        A ``token`` this backend never hands out (not the bytes of a stored
        value) cannot match the stored one: the write loses and the stored state
        is returned, as torch's contract says for any token that does not match.

        Raises:
            RendezvousStateError: the state key holds a value rallypoint did not
                write.
            RendezvousConnectionError: the store failed.
        """
        self._check_phase(phase)
        expected = _EMPTY if token is None else self._own_token(token)
        if expected is None:
            stored = self.get_state()
            return None if stored is None else (stored[0], stored[1], False)
        version, _ = self._decode(expected)
        desired = b"%d:%s:" % (version + 1, secrets.token_hex(6).encode()) + bytes(state)
        current = bytes(
            self._call(
                # torch's Store stub says str; the binding takes bytes.
                lambda: self._store.compare_set(self._key, expected, desired),  # type: ignore[arg-type]
                written=len(expected) + len(desired),
            )
        )
        current_version, blob = self._decode(current)
        won = current == desired
        if won:
            self._notify(phase)
        if current_version == 0:
            return None
        return blob, current, won

    def _notify(self, phase: int | None) -> None:
        if phase is None:
            return
        # ``p/<phase - 1>`` again, too, in the same round trip: it exists already
        # unless the writer of that phase died between its CAS and its
        # notification, and then setting it wakes the waiters it stranded.
        keys = [self._pkey(phase)]
        if phase > 0:
            keys.append(self._pkey(phase - 1))
        store = cast(_ExtendedStore, self._store)
        self._call(lambda: store.multi_set(keys, [b""] * len(keys)), written=sum(map(len, keys)))

    def _pkey(self, phase: int) -> str:
        return self.key(f"p/{phase}")

    def _own_token(self, token: Token) -> bytes | None:
        """``token`` as the stored value it names, or None if it cannot be one."""
        if not isinstance(token, (bytes, bytearray, memoryview)):
            return None
        expected = bytes(token)
        return None if _version(expected) is None else expected

    def wait_for_phase(self, phase: int, timeout: float) -> bool:
        """Block in ``store.wait(["p/<phase+1>"])``: phases grow by exactly 1 per
        phase-changing write, so the next one is the only key to wait for."""
        return self._wait_for_key(self._pkey(phase + 1), timeout)

    def _wait_for_key(self, key: str, timeout: float) -> bool:
        try:
            # wait() rejects a zero timeout as "no timeout": keep at least 1 ms.
            self._wait_store.wait([key], timedelta(seconds=max(timeout, 0.001)))
        except RuntimeError as exc:
            # A timed-out wait raises (DistStoreError on TCPStore, RuntimeError on
            # FileStore); only an unreachable store is an error.
            if "timeout" in str(exc).lower() and "connect" not in str(exc).lower():
                self._count()
                return False
            raise self._failure(exc) from exc
        self._count(written=len(key))
        return True

    def _ikey(self, round: int) -> str:
        return self.key(f"intents/{round}")

    def announce(self, round: int, entry: bytes) -> None:
        """``store.append`` of ``entry + b"\\n"`` on a store that appends natively
        (TCPStore: the server appends, O(len(entry)) bytes), then
        ``store.check([key])`` on the same connection.

        TCPStore's ``append`` (like ``set``) is fire-and-forget: it returns once
        the request is sent, and another client reading the log right after may
        not see the entry yet (measured: 375 of 3,000 immediate reads missed it).
        The server handles one connection's requests in order, so when the
        ``check`` returns the entry is in the log for every reader: one round
        trip, a key's worth of bytes more.

        A store without native append (FileStore; ``has_extended_api()`` is
        false) gets a compare-and-set loop of our own, O(log) bytes per attempt:
        torch's fallback ``Store.append`` starts with ``compare_set(key, "",
        value)`` and stops when that returns ``value``, so it silently drops an
        append whose bytes equal the whole stored log (the same entry announced
        twice into an otherwise empty round). Ours has one blind spot of its own:
        two clients appending the very same entry onto the very same log at once
        may leave one copy (the core de-duplicates entries anyway).
        """
        line = check_intent_entry(entry) + b"\n"
        key = self._ikey(round)
        if self._native_append:
            store = cast(_ExtendedStore, self._store)
            self._call(lambda: store.append(key, line), written=len(key) + len(line))
            self._call(lambda: self._store.check([key]), written=len(key))
            return
        current = self._read_log(key) or b""
        while True:
            desired = current + line
            result = self._compare_set(key, current, desired)
            if result == desired:
                return
            # A CAS on a missing key returns the expected value (nothing deletes
            # the log, but a loop must not spin on that).
            current = b"" if result == current else result

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        written = len(key) + len(expected) + len(desired)
        # torch's stubs say str; the bindings take bytes (as set_state relies on).
        cas = cast(Callable[[str, bytes, bytes], bytes], self._store.compare_set)
        return bytes(self._call(lambda: cas(key, expected, desired), written=written))

    def intents(self, round: int) -> list[bytes]:
        log = self._read_log(self._ikey(round))
        return [] if log is None else log.split(b"\n")[:-1]

    def _read_log(self, key: str) -> bytes | None:
        """The value of ``key``, None if it is missing: one operation that never
        blocks and never creates the key (see ``_MISSING``)."""
        try:
            value = bytes(self._store.compare_set(key, _MISSING, _MISSING))
        except (RuntimeError, ValueError, TimeoutError) as exc:
            raise self._failure(exc) from exc
        missing = value == _MISSING.encode()
        self._count(written=len(key) + 2 * len(_MISSING), read=0 if missing else len(value))
        return None if missing else value

    def _hbkey(self, node: str) -> str:
        return self.key(f"hb/{node}")

    def beat(self, node: str) -> int:
        key = self._hbkey(node)
        try:
            value = int(self._store.add(key, 1))
        except ValueError as exc:
            # FileStore and HashStore: the stored value is not an integer. (A
            # TCPStore server drops the connection instead: a connection error.)
            raise self._state_error(
                f"the heartbeat key {key!r} holds a value that is not a counter ({exc})"
            ) from exc
        except RuntimeError as exc:
            raise self._failure(exc) from exc
        self._count(written=len(key) + 8, heartbeat_ops=1, heartbeat_written=len(key) + 8)
        return value

    def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]:
        names = list(nodes)
        if not names:
            return {}
        keys = [self._hbkey(n) for n in names]
        # add(key, 0) creates a missing key instead of blocking like get() does;
        # a node registers its key (beat) before it ever appears in the state, so
        # multi_get normally finds every key in one round trip.
        check = self._call(lambda: self._store.check(keys), written=sum(map(len, keys)))
        if not check:
            return {n: self._counter_or_zero(k) for n, k in zip(names, keys, strict=True)}
        raw = self._call(lambda: self._store.multi_get(keys), written=sum(map(len, keys)))
        self._count(ops=0, read=sum(len(v) for v in raw))
        return {n: self._counter(k, v) for n, k, v in zip(names, keys, raw, strict=True)}

    def _counter_or_zero(self, key: str) -> int:
        """The counter under ``key``; a missing key is created as 0 (``add(key, 0)``),
        so that later reads find every key and take the one-round-trip path."""
        raw = self._read_log(key)
        if raw is not None:
            # Read first: a TCPStore server drops the connection that adds to a
            # value that is not an integer, so only a missing key gets the add.
            return self._counter(key, raw)
        return int(self._call(lambda: self._store.add(key, 0)))

    def close(self) -> None:
        if self._on_close is not None:
            callback, self._on_close = self._on_close, None
            callback()
