"""The c10d backend: the rendezvous state in a ``torch.distributed.Store``.

Key layout under ``rallypoint/<run_id>/`` (documented in docs/adapters.md):

==================  ==========================================================
key                 value
==================  ==========================================================
``state``           ``b"<version>:<nonce>:" + blob``; version 0 with an empty
                    blob means "no state yet". The whole value is the fencing
                    token, so ``compare_set`` is the CAS (as torch's
                    C10dRendezvousBackend); the writer's random nonce makes two
                    writes of the same blob distinguishable, so a writer knows it
                    won only if its own value is stored.
``v/<version>``     set (empty) right after the write that produced ``version``
                    won: a waiter that read version n blocks in
                    ``store.wait(["v/<n+1>"])`` and wakes the moment it exists.
``hb/<node>``       the node's heartbeat counter, bumped with ``store.add``: a
                    heartbeat sends a key and an integer, never the state.
==================  ==========================================================

The store's ``wait`` blocks the connection it runs on, so waits use their own
client connection (``wait_store``), and a heartbeat thread is never stuck behind a
waiting rendezvous.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import TypeVar

from torch.distributed import Store

from ..backend import BackendStats, Token
from ..errors import RendezvousConnectionError, RendezvousStateError, describe

__all__ = ["C10dBackend"]

_T = TypeVar("_T")
_EMPTY = b"0::"


def _version(value: bytes, *, run_id: str, endpoint: str) -> tuple[int, bytes]:
    head, sep, rest = bytes(value).partition(b":")
    _, sep2, blob = rest.partition(b":")
    if not sep or not sep2 or not head.isdigit():
        raise RendezvousStateError(
            describe(
                "the rendezvous state key holds a value rallypoint did not write",
                run_id=run_id,
                endpoint=endpoint,
                check="that no other program (or another rendezvous backend) uses the same "
                "store and run id",
            )
        )
    return int(head), blob


class C10dBackend:
    """A :class:`~rallypoint.adapters.backend.RendezvousBackend` on a c10d store.

    Args:
        store: a TCPStore or FileStore client (anything with ``compare_set``).
        run_id: namespaces every key.
        endpoint: ``host:port`` or the file path, for messages.
        wait_store: a second client of the same store used only for blocking waits
            (defaults to ``store``; pass one for TCPStore, see the module doc).
        on_close: called by :meth:`close` (e.g. to drop the hosting server).
    """

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
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        self._store = store
        self._wait_store = wait_store if wait_store is not None else store
        self._run_id = run_id
        self._endpoint = endpoint
        self._name = name
        self._prefix = f"rallypoint/{run_id}/"
        self._key = self._prefix + "state"
        self._stats = BackendStats()
        self._stats_lock = threading.Lock()
        self._on_close = on_close
        # The store's get() blocks on a missing key; an initial version-0 value makes
        # every later get() return at once.
        self._call(lambda: store.compare_set(self._key, "", _EMPTY), written=len(_EMPTY))

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
    def store(self) -> Store:
        """The underlying store (the handler hands a per-round prefix of it to workers)."""
        return self._store

    def _count(self, written: int = 0, read: int = 0, heartbeat: bool = False) -> None:
        with self._stats_lock:
            self._stats.ops += 1
            self._stats.bytes_written += written
            self._stats.bytes_read += read
            if heartbeat:
                self._stats.heartbeat_ops += 1
                self._stats.heartbeat_bytes_written += written

    def _failure(self, exc: BaseException) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            describe(
                f"the c10d store failed ({exc.__class__.__name__}: {str(exc)[:200]})",
                run_id=self._run_id,
                endpoint=self._endpoint,
                check="that the node hosting the store (is_host) is running and reachable "
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
        return _version(value, run_id=self._run_id, endpoint=self._endpoint)

    def get_state(self) -> tuple[bytes, Token] | None:
        value = bytes(self._call(lambda: self._store.get(self._key), written=len(self._key)))
        version, blob = self._decode(value)
        if version == 0:
            return None
        return blob, value

    def set_state(self, state: bytes, token: Token | None) -> tuple[bytes, Token, bool] | None:
        expected = _EMPTY if token is None else bytes(token)
        version, _ = self._decode(expected)
        desired = b"%d:%s:" % (version + 1, secrets.token_hex(6).encode()) + bytes(state)
        current = bytes(
            self._call(
                lambda: self._store.compare_set(self._key, expected, desired),
                written=len(expected) + len(desired),
            )
        )
        current_version, blob = self._decode(current)
        won = current == desired
        if won:
            self._call(lambda: self._store.set(self._vkey(current_version), b""), written=8)
        if current_version == 0:
            return None
        return blob, current, won

    def _vkey(self, version: int) -> str:
        return f"{self._prefix}v/{version}"

    def wait_for_change(self, token: Token | None, timeout: float) -> bool:
        version = 0 if token is None else self._decode(bytes(token))[0]
        key = self._vkey(version + 1)
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

    def _hbkey(self, node: str) -> str:
        return f"{self._prefix}hb/{node}"

    def beat(self, node: str) -> int:
        key = self._hbkey(node)
        try:
            value = int(self._store.add(key, 1))
        except (RuntimeError, ValueError) as exc:
            raise self._failure(exc) from exc
        self._count(written=len(key) + 8, heartbeat=True)
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
            values = [self._call(lambda k=k: self._store.add(k, 0)) for k in keys]  # type: ignore[misc]
            return {n: int(v) for n, v in zip(names, values, strict=True)}
        raw = self._call(lambda: self._store.multi_get(keys), written=sum(map(len, keys)))
        with self._stats_lock:
            self._stats.bytes_read += sum(len(v) for v in raw)
        return {n: int(bytes(v)) for n, v in zip(names, raw, strict=True)}

    def close(self) -> None:
        if self._on_close is not None:
            callback, self._on_close = self._on_close, None
            callback()
