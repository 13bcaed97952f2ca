"""The sync engine: drive one node's operator against a backend until FINISH.

This is where the pure core meets clocks, threads, sleeps and randomness::

    read (blob + heartbeat counters) -> observe -> sanitize -> decide
      terminal  -> return the action
      SYNC      -> publish a sanitized state if peers were found dead; otherwise
                   wait for a change notification or until wake_at(), then re-read
      KEEP_ALIVE -> bump this node's heartbeat key (O(1) bytes), no state write
      otherwise -> apply, compare-and-set; a lost CAS re-decides on the state the
                   CAS returned after a short jittered backoff

Heartbeat layout. The state blob keeps, per member, the core's counter as of the
last blob write (bumped by the core's join actions); the backend keeps a second
counter per node (``beat``), bumped by keep-alives without rewriting the blob.
The core sees one counter per node, ``blob << 32 | side``: it moves whenever
either moves, so the core's liveness rules apply unchanged, and a keep-alive costs
one small key write instead of an O(n) blob write. Writing a state back maps each
merged counter to its blob part: unchanged members keep theirs, a member whose
counter the action changed gets its blob counter + 1.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from immutables import Map

from rallypoint.core import (
    Action,
    Context,
    NodeDesc,
    Observations,
    Operator,
    RendezvousState,
    Settings,
    apply,
    decode_state,
    encode_state,
    observe,
    sanitize,
    wake_at,
)
from rallypoint.core import errors as core_errors

from .backend import RendezvousBackend, Token
from .errors import RendezvousConnectionError, RendezvousStateError, describe

__all__ = ["SIDE_BITS", "StateSync", "merge_heartbeats", "split_heartbeats"]

log = logging.getLogger(__name__)

#: Bits of the merged counter that hold the backend (side) counter.
SIDE_BITS = 32
_SIDE_MASK = (1 << SIDE_BITS) - 1
#: A decision flips strictly after wake_at(); wake just past it.
_WAKE_EPSILON = 0.002


def merge_heartbeats(blob: RendezvousState, side: dict[NodeDesc, int]) -> RendezvousState:
    """The state the core sees: each member's counter is ``blob << 32 | side``."""
    merged = {
        node: (counter << SIDE_BITS) | (side.get(node, 0) & _SIDE_MASK)
        for node, counter in blob.heartbeats.items()
    }
    return blob.evolve(heartbeats=Map(merged))


def split_heartbeats(
    new: RendezvousState, base_merged: RendezvousState, base_blob: RendezvousState
) -> RendezvousState:
    """The blob to store for ``new``, a state the core derived from ``base_merged``."""
    counters = {}
    for node, counter in new.heartbeats.items():
        if base_merged.heartbeats.get(node) == counter:
            counters[node] = base_blob.heartbeats[node]
        else:
            counters[node] = base_blob.heartbeats.get(node, 0) + 1
    return new.evolve(heartbeats=Map(counters))


class StateSync:
    """One node's cached view of the shared state, and its operator loop.

    Args:
        backend: where the state lives.
        node: this node.
        settings: the rendezvous settings.
        clock: the node's monotonic clock (injectable for tests).
        rng: randomness for backoff jitter (seedable for tests).
        poll_interval: the longest a SYNC waits without a change notification:
            only a fallback for a notification lost with a crashed writer.
        retry_window: how long (seconds) :meth:`run` keeps retrying while the
            backend is unreachable before it raises (an etcd server restarting);
            0 raises at once (a TCPStore client has already waited read_timeout).

    Thread-safe: the cached view is guarded by a lock that is never held while
    waiting on the backend.
    """

    def __init__(
        self,
        backend: RendezvousBackend,
        node: NodeDesc,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        poll_interval: float = 1.0,
        retry_window: float = 0.0,
    ) -> None:
        self.backend = backend
        self.node = node
        self.settings = settings
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._poll_interval = poll_interval
        self._retry_window = retry_window
        self._lock = threading.Lock()
        self._blob = RendezvousState()
        self._merged = RendezvousState()
        self._side: dict[NodeDesc, int] = {}
        self._token: Token | None = None
        self._obs = Observations()
        self._read_at: float | None = None
        self._side_read_at: float | None = None
        self._side_max_age = settings.keep_alive_interval / 4
        self._registered = False
        #: Nodes whose heartbeat keys are read even when the blob no longer lists
        #: them (the handler's current round, for dead_participants()).
        self.watched: frozenset[NodeDesc] = frozenset()
        #: Counters of CAS attempts and losses, for benchmarks.
        self.cas_attempts = 0
        self.cas_losses = 0

    # -- the cached view -------------------------------------------------------

    @property
    def state(self) -> RendezvousState:
        """The last read or written state, heartbeats merged (what the core sees)."""
        with self._lock:
            return self._merged

    @property
    def token(self) -> Token | None:
        with self._lock:
            return self._token

    @property
    def observations(self) -> Observations:
        with self._lock:
            return self._obs

    def side_counters(self) -> dict[NodeDesc, int]:
        """The backend heartbeat counters last read (members and watched nodes)."""
        with self._lock:
            return dict(self._side)

    def now(self) -> float:
        return self._clock()

    def _decode(self, blob: bytes) -> RendezvousState:
        try:
            return decode_state(blob)
        except core_errors.RendezvousStateError as exc:
            raise RendezvousStateError(
                describe(
                    str(exc),
                    run_id=self.settings.run_id,
                    endpoint=self.backend.endpoint,
                    check="that every node runs the same rallypoint version and that nothing "
                    "else writes to this run id; start a fresh run id to recover",
                )
            ) from exc

    def _adopt(
        self, result: tuple[bytes, Token] | None, heartbeats: bool = False
    ) -> RendezvousState:
        blob = RendezvousState() if result is None else self._decode(result[0])
        token = None if result is None else result[1]
        nodes = set(blob.heartbeats) | set(self.watched)
        now = self._clock()
        with self._lock:
            side_age = None if self._side_read_at is None else now - self._side_read_at
            known = nodes <= self._side.keys()
        # The counters only feed liveness, which acts on windows of whole keep-alive
        # intervals: re-read them at most every interval/4 unless asked, so that the
        # hot path (a waiter woken by a write) costs one read, not three.
        stale = side_age is None or side_age > self._side_max_age
        side: dict[NodeDesc, int] | None = None
        if nodes and (heartbeats or stale or not known):
            raw = self.backend.get_heartbeats([str(n) for n in nodes])
            side = {n: raw.get(str(n), 0) for n in nodes}
        with self._lock:
            self._blob = blob
            self._token = token
            if side is not None:
                self._side = side
                self._side_read_at = now
            self._merged = merge_heartbeats(blob, self._side)
            self._obs = observe(self._obs, self._merged, now)
            self._read_at = now
            return self._merged

    def refresh(self, max_age: float = 0.0, heartbeats: bool = False) -> RendezvousState:
        """Re-read the state unless the cached copy is at most ``max_age`` seconds old.

        Heartbeat counters are re-read with it when ``heartbeats`` is true or when
        the cached counters are older than a quarter keep-alive interval.
        """
        with self._lock:
            fresh = self._read_at is not None and self._clock() - self._read_at <= max_age
            if fresh and (not heartbeats or self._side_read_at == self._read_at):
                return self._merged
        return self._adopt(self.backend.get_state(), heartbeats)

    def heartbeats_fresh(self) -> bool:
        """True when the counters were read together with the cached state."""
        with self._lock:
            return self._side_read_at is not None and self._side_read_at == self._read_at

    def wait_for_change(self, timeout: float) -> bool:
        """Block until the state moves past the cached token (or ``timeout``)."""
        return self.backend.wait_for_change(self.token, timeout)

    # -- writing ----------------------------------------------------------------

    def beat(self) -> None:
        """Bump this node's heartbeat counter (O(1) bytes) and record it."""
        value = self.backend.beat(str(self.node))
        now = self._clock()
        with self._lock:
            self._registered = True
            self._side[self.node] = value
            self._merged = merge_heartbeats(self._blob, self._side)
            self._obs = observe(self._obs, self._merged, now)

    def _write(self, new: RendezvousState, base: RendezvousState) -> bool:
        with self._lock:
            if self._merged is not base:
                return False  # another thread changed the view: decide again
            blob = split_heartbeats(new, base, self._blob)
            token = self._token
        self.cas_attempts += 1
        result = self.backend.set_state(encode_state(blob), token)
        if result is None:
            self.cas_losses += 1
            self._adopt(None)
            return False
        data, new_token, won = result
        self._adopt((data, new_token))
        if not won:
            self.cas_losses += 1
        return won

    # -- the loop ---------------------------------------------------------------

    def run(
        self,
        op: Operator,
        deadline: float,
        reset_deadline: Callable[[], float] | None = None,
        *,
        fresh: bool = False,
    ) -> Action:
        """Run ``op`` until it answers a terminal action, and return that action.

        Args:
            op: the operator (JoinOp, ExitOp, CloseOp, KeepAliveOp, ...).
            deadline: local monotonic time after which the operator times out.
            reset_deadline: gives a fresh deadline after an action whose
                ``resets_deadline`` is true (a redundant node becoming a joiner).
            fresh: the cached state was just read or written (by the previous
                operator): decide on it without reading again.

        Raises:
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        losses = 0
        down_since: float | None = None
        while True:
            try:
                if not self._registered:
                    # Create this node's heartbeat key before the blob can name it,
                    # so readers find every member's key in one round trip.
                    self.beat()
                if not fresh:
                    self.refresh()
                    fresh = True
                action, deadline, losses = self._step(op, deadline, reset_deadline, losses)
                down_since = None
                if action is not None:
                    return action
                if losses:
                    # Jittered exponential backoff: spreads out a herd of simultaneous
                    # joiners without adding a fixed delay to the first retry.
                    time.sleep(self._rng.uniform(0, min(0.05, 0.001 * (2**losses))))
            except RendezvousConnectionError as exc:
                now = self._clock()
                down_since = now if down_since is None else down_since
                if now - down_since >= self._retry_window or now > deadline:
                    raise
                log.warning("%s: backend unreachable, retrying: %s", self.node, exc)
                fresh = False
                time.sleep(min(0.5, 0.05 + self._rng.uniform(0, 0.1)))

    def _step(
        self,
        op: Operator,
        deadline: float,
        reset_deadline: Callable[[], float] | None,
        losses: int,
    ) -> tuple[Action | None, float, int]:
        """One decision: returns (terminal action or None, deadline, CAS losses)."""
        with self._lock:
            base = self._merged
            obs = self._obs
        now = self._clock()
        state, dead = sanitize(base, obs, self.settings, now)
        ctx = Context(self.node, state, self.settings, now, obs)
        action = op(ctx, deadline)
        if action.is_terminal:
            return action, deadline, 0
        if dead and not self.heartbeats_fresh():
            # Never declare a peer dead on cached counters: read them, decide again.
            self.refresh(heartbeats=True)
            return None, deadline, 0
        if action is Action.SYNC:
            if dead:
                # Publish the removal so that peers converge on it at once.
                self._write(state, base)
                return None, deadline, 0
            wake = wake_at(ctx, deadline)
            timeout = self._poll_interval
            if wake is not None:
                timeout = min(timeout, max(0.0, wake - now) + _WAKE_EPSILON)
            self.backend.wait_for_change(self.token, timeout)
            self.refresh()
            return None, deadline, 0
        if action is Action.KEEP_ALIVE and not dead and self.node in self._blob.heartbeats:
            self.beat()
            return None, deadline, 0
        new = apply(state, action, ctx)
        if not self._write(new, base):
            return None, deadline, losses + 1
        if action.resets_deadline and reset_deadline is not None:
            deadline = reset_deadline()
        return None, deadline, 0
