"""The sync engine: carry out the driver's instructions against a backend.

Every decision is the core's (:mod:`rallypoint.core.driver`); this module only
executes them, with IO, clocks, threads and backoff::

    Read(counters, intents) -> get_state() (+ get_heartbeats() of every member)
                      (+ intents(round)) -> after_read
    Write(state)   -> set_state(encode(state), token, phase) -> after_write; a lost
                      CAS decides again after a short jittered backoff
    Beat()         -> beat(node) (one small key, the state is not rewritten) -> after_beat
    Announce(round) -> announce(round, node) (one small append) -> after_announce
    Wait(until, phase) -> wait_for_phase(phase, until - now, at most poll_interval)
                      -> after_wait
    Done / Verdict -> returned to the caller

The backend keeps, per member, the state's heartbeat counter and a side counter
under the node's own key; the driver watches both (see
:mod:`rallypoint.core.liveness`).

A backend that rides out outages itself (etcd: every call retries for
``read_timeout``) counts them in an ``outages`` attribute. When it moves, this
node could not read its peers' counters for a while, and they could not write
them: the sightings of its peers are dropped, so each is timed afresh from the
first read after the outage instead of being declared dead for the time nobody
could reach the backend. Its own sighting is kept, so it beats at once.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from ..core import (
    MAX_STATE_BYTES,
    Announce,
    Beat,
    Done,
    Instruction,
    Membership,
    NodeDesc,
    NodeView,
    Operator,
    Read,
    RendezvousState,
    Settings,
    Verdict,
    Wait,
    Write,
    decode_state,
    driver,
    encode_state,
)
from ..core import errors as core_errors
from .backend import RendezvousBackend, StateSizeLimit, Token
from .errors import RendezvousConnectionError, RendezvousStateError, describe

__all__ = ["StateSync"]

log = logging.getLogger(__name__)

#: A decision flips strictly after Wait.until; wake just past it (timer resolution).
_WAKE_EPSILON = 0.002
#: The largest backoff after lost compare-and-sets, in seconds.
_MAX_BACKOFF = 0.05
#: Beyond this many losses in a row the backoff is at its cap anyway; the exponent
#: stops growing there (2.0 ** 1024 overflows a float).
_MAX_BACKOFF_EXPONENT = 16
#: What every backend is held to: a larger state could be written but not read back.
_DECODER_LIMIT = StateSizeLimit(
    MAX_STATE_BYTES,
    f"rallypoint reads states of at most {MAX_STATE_BYTES // (1024 * 1024)} MiB",
    "fewer nodes per run (max_nodes) or shorter node addresses",
)


class StateSync:
    """One node's view of the shared state, and the executor of its driver.

    Args:
        backend: where the state lives.
        node: this node.
        settings: the rendezvous settings.
        clock: the node's monotonic clock (injectable for tests).
        rng: randomness for backoff jitter (seedable for tests).
        poll_interval: the longest a Wait lasts without a change notification:
            only a fallback for a notification lost with a crashed writer.
        retry_window: how long (seconds) :meth:`run` keeps retrying while the
            backend is unreachable before it raises (an etcd server restarting);
            0 raises at once (a TCPStore client has already waited read_timeout).
        on_instruction: called with every instruction before it is carried out
            (tracing, and the conformance tests).

    Thread-safe: the view is replaced under a lock that is never held while
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
        on_instruction: Callable[[Instruction], None] | None = None,
    ) -> None:
        self.backend = backend
        self.node = node
        self.settings = settings
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._poll_interval = poll_interval
        self._retry_window = retry_window
        self._on_instruction = on_instruction
        # The view changes in place (see NodeView): every change, and every
        # decision on it, is made under this lock, and each change bumps _version.
        self._lock = threading.Lock()
        self._view = NodeView()
        self._version = 0
        self._token: Token | None = None
        self._read_at: float | None = None
        self._registered = False
        self._outages_seen = getattr(backend, "outages", None)
        #: Counters of CAS attempts and losses, for benchmarks.
        self.cas_attempts = 0
        self.cas_losses = 0
        limit = getattr(backend, "state_size_limit", None)
        self._size_limit: StateSizeLimit = (
            limit if limit is not None and limit.max_bytes < MAX_STATE_BYTES else _DECODER_LIMIT
        )

    # -- the view ----------------------------------------------------------------

    @property
    def view(self) -> NodeView:
        """What this node knows (blob, counters, sightings), as a copy: the view
        itself changes with every read and write."""
        with self._lock:
            return self._view.copy()

    @property
    def state(self) -> RendezvousState:
        """The last read or written state."""
        with self._lock:
            return self._view.state

    @property
    def token(self) -> Token | None:
        with self._lock:
            return self._token

    def now(self) -> float:
        return self._clock()

    def key(self, suffix: str) -> str:
        """The backend's full name of this run's key ``suffix``, for messages."""
        name = getattr(self.backend, "key", None)
        return str(name(suffix)) if callable(name) else suffix

    def _state_error(self, what: str, check: str) -> RendezvousStateError:
        return RendezvousStateError(
            describe(what, run_id=self.settings.run_id, endpoint=self.backend.endpoint, check=check)
        )

    def _decode(self, blob: bytes) -> RendezvousState:
        try:
            # With this node's settings: a state that is valid only for other node
            # counts is an error here, not a join that fails later.
            return decode_state(blob, self.settings)
        except core_errors.RendezvousStateError as exc:
            raise self._state_error(
                f"{exc}, read from key {self.key('state')!r}",
                "that every node runs the same rallypoint version with the same settings "
                "and that nothing else writes to this run id; start a fresh run id to recover",
            ) from exc

    # -- carrying out instructions ----------------------------------------------------

    def _read(self, counters: bool, intents: bool = False, state: bool = True) -> None:
        if state:
            result = self.backend.get_state()
            blob = None if result is None else self._decode(result[0])
        else:
            with self._lock:
                token, blob = self._token, self._view.state
            result = None if token is None else (b"", token)
        side = None
        if counters and blob is not None and blob.heartbeats:
            raw = self.backend.get_heartbeats([str(n) for n in blob.heartbeats])
            side = {n: raw.get(str(n), 0) for n in blob.heartbeats}
        elif counters:
            side = {}
        log = None
        if intents:
            log = self._intents(0 if blob is None else blob.round)
        self._after_outage()  # before these counters are observed
        now = self._clock()
        with self._lock:
            self._token = None if result is None else result[1]
            self._read_at = now
            self._view = driver.after_read(self._view, self.node, blob, side, now, log)
            self._version += 1

    def _intents(self, round_: int) -> list[NodeDesc]:
        entries = []
        for raw in self.backend.intents(round_):
            try:
                entries.append(NodeDesc.parse(bytes(raw).decode("ascii")))
            except (UnicodeDecodeError, ValueError) as exc:
                raise self._state_error(
                    f"the intent log of round {round_} (key {self.key(f'intents/{round_}')!r}) "
                    f"holds an entry that is not a node ({exc})",
                    "that nothing else writes to this run id",
                ) from exc
        return entries

    def _write(self, write: Write, version: int) -> bool:
        with self._lock:
            if self._version != version:
                return False  # another thread changed the view: decide again
            token = self._token
        blob = encode_state(write.state)
        self._check_size(blob, write.state)
        self.cas_attempts += 1
        started = self._clock()  # a won write renews this node's lease from here
        result = self.backend.set_state(blob, token, phase=write.phase)
        won = result is not None and result[2]
        stored = None if result is None else self._decode(result[0])
        self._after_outage()
        now = self._clock()
        with self._lock:
            self._token = None if result is None else result[1]
            self._read_at = now
            self._view = driver.after_write(self._view, self.node, won, stored, now, started)
            self._version += 1
        if not won:
            self.cas_losses += 1
        return won

    def _check_size(self, blob: bytes, state: RendezvousState) -> None:
        """Refuse a state the backend would not store (or nobody could read back),
        with a message that says whose limit it is, before the write fails there
        (a TCPStore drops the connection, etcd answers "request is too large")."""
        limit = self._size_limit
        if len(blob) <= limit.max_bytes:
            return
        raise self._state_error(
            f"the rendezvous state would grow to {len(blob):,} bytes "
            f"({len(state.members())} nodes), over the limit of {limit.max_bytes:,} bytes "
            f"of the {self.backend.name} backend: {limit.reason}",
            limit.remedy,
        )

    def beat(self) -> None:
        """Bump this node's heartbeat counter (O(1) bytes) and record it."""
        started = self._clock()  # the beat renews this node's lease from here
        value = self.backend.beat(str(self.node))
        self._after_outage()
        now = self._clock()
        with self._lock:
            self._registered = True
            self._view = driver.after_beat(self._view, self.node, value, now, started)
            self._version += 1

    def _announce(self, round_: int) -> None:
        self.backend.announce(round_, str(self.node).encode("ascii"))
        with self._lock:
            self._view = driver.after_announce(self._view, round_)
            self._version += 1

    def _wait(self, until: float | None, phase: int) -> None:
        timeout = self._poll_interval
        if until is not None:
            timeout = min(timeout, max(0.0, until - self._clock()) + _WAKE_EPSILON)
        self.backend.wait_for_phase(phase, timeout)
        self.invalidate()

    def _after_outage(self) -> None:
        """Drop the sightings of the peers if the backend was unreachable since the
        last decision (see the module docstring)."""
        outages = getattr(self.backend, "outages", None)
        if outages == self._outages_seen:
            return
        with self._lock:
            if outages == self._outages_seen:
                return
            self._outages_seen = outages
            self._view = driver.after_outage(self._view, self.node)
            self._version += 1
        log.info("%s: the backend was unreachable; timing the peers' heartbeats afresh", self.node)

    def must_fence(self) -> bool:
        """Whether this node must stop its workers now: its lease ran out (see
        :func:`rallypoint.core.driver.must_fence`). Reads nothing."""
        with self._lock:
            return driver.must_fence(self._view, self.node, self.settings, self._clock())

    def _execute(
        self, decide: Callable[[NodeView, float], Instruction]
    ) -> tuple[Instruction, bool]:
        """Decide on the current view and carry the instruction out.

        Returns the instruction and whether it took effect (False: a Write lost its
        compare-and-set). Done and Verdict are returned, nothing carried out.
        """
        self._after_outage()
        with self._lock:
            instruction = decide(self._view, self._clock())
            version = self._version
        if self._on_instruction is not None:
            self._on_instruction(instruction)
        if isinstance(instruction, Read):
            self._read(instruction.counters, instruction.intents, instruction.state)
        elif isinstance(instruction, Write):
            return instruction, self._write(instruction, version)
        elif isinstance(instruction, Beat):
            self.beat()
        elif isinstance(instruction, Announce):
            self._announce(instruction.round)
        elif isinstance(instruction, Wait):
            self._wait(instruction.until, instruction.phase)
        return instruction, True

    def _drive(
        self, decide: Callable[[NodeView, float], Instruction], deadline: list[float] | None
    ) -> Instruction:
        """Carry out instructions until one is Done or a Verdict; return it.

        Lost compare-and-sets back off (jittered, exponential, capped); an
        unreachable backend is retried for ``retry_window`` seconds (never past
        ``deadline[0]``) before the connection error is raised; a won Write that
        moves the operation's deadline updates ``deadline[0]``.
        """
        losses = 0
        down_since: float | None = None
        while True:
            try:
                if not self._registered:
                    # Create this node's heartbeat key before the blob can name it,
                    # so that readers find every member's key in one round trip.
                    self.beat()
                instruction, took = self._execute(decide)
                down_since = None
            except RendezvousConnectionError as exc:
                now = self._clock()
                down_since = now if down_since is None else down_since
                if now - down_since >= self._retry_window or (
                    deadline is not None and now > deadline[0]
                ):
                    raise
                log.warning("%s: backend unreachable, retrying: %s", self.node, exc)
                self.invalidate()
                time.sleep(min(0.5, 0.05 + self._rng.uniform(0, 0.1)))
                continue
            if isinstance(instruction, (Done, Verdict)):
                return instruction
            if not took:
                losses += 1
                # Spreads out a herd of simultaneous joiners without adding a fixed
                # delay to the first retry; the exponent is capped (no overflow).
                exponent = min(losses, _MAX_BACKOFF_EXPONENT)
                time.sleep(self._rng.uniform(0, min(_MAX_BACKOFF, 0.001 * 2**exponent)))
            elif isinstance(instruction, Write):
                losses = 0
                if instruction.deadline is not None and deadline is not None:
                    deadline[0] = instruction.deadline

    # -- the loops ---------------------------------------------------------------------

    def run(self, op: Operator, deadline: float, *, fresh: bool = False) -> Done:
        """Run ``op`` until the driver says Done, and return it.

        Args:
            op: the operator (JoinOp, ExitOp, CloseOp, KeepAliveOp, ...).
            deadline: local monotonic time after which the operator times out (a
                Write may move it: a redundant node that becomes a joiner).
            fresh: decide on the current view without reading first (it was just
                read or written, e.g. by the previous operator).

        Raises:
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        if not fresh:
            self.invalidate()
        node, settings = self.node, self.settings
        current = [deadline]

        def decide(view: NodeView, now: float) -> Instruction:
            return driver.decide(view, node, settings, op, current[0], now)

        done = self._drive(decide, current)
        assert isinstance(done, Done)
        return done

    def monitor(self, joined: Membership | None, max_age: float = 0.0) -> Verdict:
        """What a node whose workers run in ``joined`` must act on (see
        :func:`rallypoint.core.driver.monitor`), on a view at most ``max_age``
        seconds old.

        Raises:
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        # Reading is the driver's call (it asks for the counters when they are due,
        # and always before it declares a participant dead): only mark the view
        # stale when it is older than max_age.
        with self._lock:
            read_at = self._read_at
        if read_at is None or self._clock() - read_at >= max_age:
            self.invalidate()
        node, settings = self.node, self.settings

        def decide(view: NodeView, now: float) -> Instruction:
            return driver.monitor(view, node, settings, joined, now)

        verdict = self._drive(decide, None)
        assert isinstance(verdict, Verdict)
        return verdict

    def invalidate(self) -> None:
        """Make the next decision read the state first."""
        with self._lock:
            self._view = driver.after_wait(self._view)
            self._version += 1

    def refresh(self, max_age: float = 0.0, counters: bool = False) -> RendezvousState:
        """Re-read the state unless the view is at most ``max_age`` seconds old
        (and, with ``counters``, its counters were read with it); return it merged."""
        now = self._clock()
        with self._lock:
            read_at, stale, counters_at = self._read_at, self._view.stale, self._view.counters_at
        fresh = not stale and read_at is not None and now - read_at <= max_age
        counters_fresh = counters_at is not None and now - counters_at <= max_age
        if not fresh or (counters and not counters_fresh):
            self._read(counters)
        return self.state

    def wait_for_change(self, timeout: float) -> bool:
        """Block until a phase above the view's is published (anything a waiting or
        monitoring node decides on changed) or ``timeout`` passes; the next
        decision reads afresh."""
        changed = self.backend.wait_for_phase(self.state.phase, timeout)
        self.invalidate()
        return changed
