"""The backend contract: where the shared rendezvous state lives, and how to CAS it.

A backend stores one opaque blob per run (the :func:`rallypoint.core.encode_state`
bytes) under a *fencing token*, and a small counter per node (its heartbeat).

Contract (docs/backends.md is the checklist; the suite
:mod:`rallypoint.adapters.contract` checks it on every implementation, and on yours):

* ``get_state()`` returns ``(blob, token)``, or None when no state was ever written.
* ``set_state(blob, token=None)`` writes ``blob`` only if the stored token still
  equals ``token`` (None, the default: only if no state exists yet), and returns
  ``(current_blob, current_token, won)``: after a win, the written blob and its new
  token; after a loss, what is stored now, so the caller can decide again without
  another read. A token is opaque to callers; two different writes never yield
  equal tokens; a token the backend never handed out (of another type, garbage)
  simply loses, as torch's ``RendezvousBackend`` documents for a token that does not
  match. ``get_state`` and ``set_state`` raise ``RendezvousStateError`` for a stored
  value the backend cannot read (c10d, etcd: a value it did not write) and
  ``RendezvousConnectionError`` when the backend cannot be reached.
* ``set_state(blob, token, phase=p)`` also moves the rendezvous to *phase* ``p`` (a
  non-negative number that only grows, chosen by the caller; the core bumps it by
  exactly 1 whenever something a waiting node cares about changes). After a won
  write the backend publishes ``p``; a lost write publishes nothing.
  ``wait_for_phase(q, timeout)`` blocks until a phase greater than ``q`` was
  published, or ``timeout`` seconds pass; True if one was. It may return early
  (spuriously); callers re-read either way. Waiters wait for the phase instead of
  any write, so a write that changes nothing they care about wakes nobody
  (docs/design.md, decision 8: cost per node flat in n).
* ``announce(round, entry)`` appends ``entry`` (opaque bytes without ``b"\\n"``)
  to the intent log of ``round``: one operation, O(len(entry)) bytes, the state is
  not rewritten; when it returns, every later ``intents(round)`` (by any client)
  includes the entry. ``intents(round)`` returns the log in append order (every
  entry, duplicates included; ``[]`` for a round nobody announced in), in one
  operation that never blocks. A joiner announces itself, and whoever wins the next state
  write admits every intent logged so far: admissions come in batches.
* ``beat(node)`` bumps ``node``'s heartbeat counter and returns the new value:
  O(1) bytes, independent of the number of nodes (the blob is not rewritten).
  ``get_heartbeats(nodes)`` reads the counters (0 for a node that never beat).
* ``close()`` releases connections; the backend is unusable afterwards.

Optional, for messages and limits (the sync engine looks them up with ``getattr``,
so a backend without them still works):

* ``key(suffix)``: the full name of this run's key ``suffix`` (``state``,
  ``hb/<node>``, ``intents/<round>``) as the backend's own tools show it, so that
  an error about a bad value names the key to inspect.
* ``state_size_limit``: a :class:`StateSizeLimit`, the largest state blob the
  backend stores (None: no limit of its own), so that a state that outgrew it is
  refused with a message saying so, before the write fails in the backend.

Implementations: :class:`MemoryBackend` (tests, simulation, one process),
:class:`rallypoint.adapters.c10d.C10dBackend` (torch TCPStore/FileStore) and
:class:`rallypoint.adapters.etcd.EtcdBackend` (etcd v3). Each keeps its name,
endpoint, key namespace and counters the same way, in :class:`BackendBase`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from ..core.errors import describe

if TYPE_CHECKING:
    from .errors import RendezvousStateError

__all__ = [
    "BackendBase",
    "BackendStats",
    "MemoryBackend",
    "RendezvousBackend",
    "StateSizeLimit",
    "Token",
    "check_intent_entry",
]

#: An opaque fencing token: a version, a revision, or the stored bytes themselves.
Token = Any


@dataclass
class BackendStats:
    """Operation and byte counts of one backend instance (for benchmarks).

    ``bytes_written`` counts payload bytes sent (keys and values), ``bytes_read``
    payload bytes received; the ``heartbeat_*`` figures count :meth:`beat` alone.
    """

    ops: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    heartbeat_ops: int = 0
    heartbeat_bytes_written: int = 0

    def as_dict(self) -> dict[str, int]:
        """A plain copy of the figures."""
        return asdict(self)


class StateSizeLimit(NamedTuple):
    """The largest state blob a backend stores, why, and what a user can do."""

    max_bytes: int
    #: e.g. "a c10d TCPStore holds values of at most 8 MiB"
    reason: str
    #: e.g. "start etcd with a larger --max-request-bytes"
    remedy: str


def check_intent_entry(entry: bytes) -> bytes:
    """``entry`` as bytes, or ValueError if it cannot go in an intent log (shared by
    the backends: the logs are newline-separated on c10d)."""
    entry = bytes(entry)
    if b"\n" in entry:
        raise ValueError(f"an intent entry must not contain a newline byte: {entry[:60]!r}")
    return entry


def state_error(message: str) -> RendezvousStateError:
    """The adapters' :class:`~rallypoint.adapters.errors.RendezvousStateError` (torch's
    class too, where torch is installed), with ``message``."""
    # Imported when an error is made, not with this module: the memory backends and
    # the asyncio executor serve embedders who never load torch, and that module
    # imports it (seconds).
    from .errors import RendezvousStateError

    return RendezvousStateError(message)


def parse_counter(key: str, raw: bytes, error: Callable[[str], Exception]) -> int:
    """The heartbeat counter under ``key`` (decimal digits, as the backends write
    it); anything else raises ``error(message)``, the message naming the key."""
    text = bytes(raw)
    if not text.isdigit():
        raise error(
            f"the heartbeat key {key!r} holds {text[:40]!r}, not a counter rallypoint wrote"
        )
    return int(text)


@runtime_checkable
class RendezvousBackend(Protocol):
    """What the sync engine needs from a store of the shared rendezvous state."""

    @property
    def name(self) -> str:
        """The backend's name as torch reports it (``get_backend()``)."""
        ...

    @property
    def endpoint(self) -> str:
        """Where the backend lives (``host:port`` or a path), for messages."""
        ...

    @property
    def stats(self) -> BackendStats:
        """Operation and byte counts so far."""
        ...

    def get_state(self) -> tuple[bytes, Token] | None:
        """The stored blob and its token, or None if none was written."""
        ...

    def set_state(
        self, state: bytes, token: Token | None = None, phase: int | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Compare-and-set; see the module docstring. None: nothing is stored and
        the write lost (the caller re-reads). With ``phase``, a won write publishes
        that phase number (see :meth:`wait_for_phase`). A token the backend did not
        hand out loses (as any token that does not match)."""
        ...

    def wait_for_phase(self, phase: int, timeout: float) -> bool:
        """Block until a phase greater than ``phase`` was published (True) or
        ``timeout`` seconds pass (False). May return early; callers re-read."""
        ...

    def announce(self, round: int, entry: bytes) -> None:
        """Append ``entry`` to the intent log of ``round`` (ValueError if it
        contains a newline)."""
        ...

    def intents(self, round: int) -> list[bytes]:
        """The intent log of ``round`` in append order (``[]`` if empty)."""
        ...

    def beat(self, node: str) -> int:
        """Bump ``node``'s heartbeat counter; return the new value."""
        ...

    def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]:
        """The heartbeat counters of ``nodes`` (0 where a node never beat)."""
        ...

    def close(self) -> None:
        """Release connections and threads."""
        ...


class BackendBase:
    """The bookkeeping every backend here shares: its name (torch's
    ``get_backend()``), where it lives and which run it serves (for messages), the
    run's key namespace, and the operation counters.

    Args:
        run_id: the run whose keys this backend reads and writes (non-empty).
        name: the backend's name.
        endpoint: ``host:port``, a member list or a path, for messages.
        root: the prefix of every key of the run (``key(suffix)`` is ``root + suffix``).

    Attributes:
        name: the backend's name as torch reports it (``get_backend()``).
        endpoint: where the backend lives, as given.
        stats: operation and byte counts so far.
    """

    #: What a :class:`RendezvousStateError` tells the user to check.
    STATE_CHECK = "that no other program uses the same storage and run id"

    def __init__(self, run_id: str, *, name: str, endpoint: str, root: str) -> None:
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        self.name = name
        self.endpoint = endpoint
        self.stats = BackendStats()
        self._run_id = run_id
        self._root = root
        self._stats_lock = threading.Lock()

    def key(self, suffix: str) -> str:
        """The full name of this run's key ``suffix`` (``state``, ``hb/<node>``), as
        the backend's own tools show it."""
        return self._root + suffix

    def _count(
        self,
        *,
        ops: int = 1,
        written: int = 0,
        read: int = 0,
        heartbeat_ops: int = 0,
        heartbeat_written: int = 0,
    ) -> None:
        with self._stats_lock:
            stats = self.stats
            stats.ops += ops
            stats.bytes_written += written
            stats.bytes_read += read
            stats.heartbeat_ops += heartbeat_ops
            stats.heartbeat_bytes_written += heartbeat_written

    def _describe(self, what: str, check: str) -> str:
        """An error message: ``what``, this run and endpoint, and what to ``check``."""
        return describe(what, run_id=self._run_id, endpoint=self.endpoint, check=check)

    def _state_error(self, what: str) -> RendezvousStateError:
        """The error for a stored value this backend did not write: ``what``, and
        :attr:`STATE_CHECK`."""
        return state_error(self._describe(what, self.STATE_CHECK))

    def _counter(self, key: str, raw: bytes) -> int:
        """The heartbeat counter stored under ``key`` (see :func:`parse_counter`)."""
        return parse_counter(key, raw, self._state_error)

    @staticmethod
    def _check_phase(phase: int | None) -> None:
        if phase is not None and phase < 0:
            raise ValueError(f"phase must be a non-negative integer, got {phase}")


class MemoryBackend(BackendBase):
    """An in-process backend: a dict behind a condition variable.

    Share one instance between the handlers of a test or simulation (threads). The
    token is a version number that every successful write increments; the phase
    and the intent logs live beside the blob, under the same condition variable.
    """

    def __init__(self, run_id: str = "memory", endpoint: str = "memory") -> None:
        super().__init__(run_id, name="memory", endpoint=endpoint, root=f"{run_id}/")
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # Phase waiters sleep on a condition of their own (same lock), which only
        # a write that raises the phase (or close) notifies.
        self._phase_cond = threading.Condition(lock)
        self._blob: bytes | None = None
        self._version = 0
        self._heartbeats: dict[str, int] = {}
        self._phase = -1  # the highest published phase; -1: none yet
        self._intents: dict[int, list[bytes]] = {}
        self._closed = False

    def get_state(self) -> tuple[bytes, Token] | None:
        with self._cond:
            blob = self._blob
            self._count(read=0 if blob is None else len(blob))
            return None if blob is None else (blob, self._version)

    def set_state(
        self, state: bytes, token: Token | None = None, phase: int | None = None
    ) -> tuple[bytes, Token, bool] | None:
        self._check_phase(phase)
        with self._cond:
            if token is None:
                matches = self._version == 0
            else:
                # Only a version this backend handed out matches (not True == 1,
                # 1.0 == 1, or 0, which stands for "nothing written").
                matches = type(token) is int and token >= 1 and token == self._version
            if not matches:
                blob = self._blob
                self._count(read=0 if blob is None else len(blob))
                return None if blob is None else (blob, self._version, False)
            self._blob = bytes(state)
            self._version += 1
            # With a phase, what a networked store would send for the phase key too.
            self._count(written=len(state) + (0 if phase is None else 8))
            if phase is not None and phase > self._phase:
                self._phase = phase
                self._phase_cond.notify_all()
            return self._blob, self._version, True

    def wait_for_phase(self, phase: int, timeout: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._count()
            while self._phase <= phase and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._phase_cond.wait(left)
            return self._phase > phase

    def announce(self, round: int, entry: bytes) -> None:
        entry = check_intent_entry(entry)
        with self._cond:
            self._count(written=len(entry) + 8)
            self._intents.setdefault(round, []).append(entry)

    def intents(self, round: int) -> list[bytes]:
        with self._cond:
            log = list(self._intents.get(round, ()))
            self._count(read=sum(len(e) + 1 for e in log))
            return log

    def beat(self, node: str) -> int:
        with self._cond:
            # The key and an 8-byte counter: what a networked store would send.
            size = len(node) + 8
            self._count(written=size, heartbeat_ops=1, heartbeat_written=size)
            value = self._heartbeats.get(node, 0) + 1
            self._heartbeats[node] = value
            return value

    def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]:
        with self._cond:
            self._count(read=8 * len(nodes))
            return {node: self._heartbeats.get(node, 0) for node in nodes}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._phase_cond.notify_all()
