"""The sync engine: carry out a node's instructions against a backend, with threads.

Every decision is the core's (:class:`rallypoint.core.RendezvousNode`, which holds
the view and the compare-and-set token); this module only executes its
instructions, with IO, clocks, threads and backoff, and steps the node with what
they did. What each instruction asks of the store is written once, in
:mod:`rallypoint.core.dispatch` (the executors here and in
:mod:`rallypoint.adapters.aio`, and the simulator, all drive it); here each of
its operations is a blocking call::

    Read(counters, intents) -> get_state() (+ get_heartbeats() of every member)
                      (+ intents(round)) -> ReadResult
    Write(state)   -> set_state(encode(state), the node's token, phase) ->
                      WriteResult; a lost CAS steps again after a short jittered
                      backoff
    Beat()         -> beat(node) (one small key, the state is not rewritten) -> BeatResult
    Announce(round) -> announce(round, node) (one small append) -> AnnounceResult
    Wait(until, phase) -> wait_for_phase(phase, until - now, at most poll_interval)
                      -> WaitResult
    Done / Verdict -> returned to the caller

:mod:`rallypoint.adapters.aio` executes the same instructions under asyncio.

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
import math
import random
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..core import (
    MAX_STATE_BYTES,
    Beat,
    Done,
    Membership,
    NodeDesc,
    NodeInstruction,
    NodeView,
    Operator,
    Outage,
    Read,
    RendezvousNode,
    RendezvousState,
    Result,
    Settings,
    Unreachable,
    Verdict,
    WaitResult,
    Write,
    WriteResult,
    decode_state,
    encode_state,
)
from ..core import errors as core_errors
from ..core.deprecation import renamed_method
from ..core.dispatch import (
    AppendIntent,
    BumpHeartbeat,
    GetHeartbeats,
    GetIntents,
    GetState,
    Operation,
    Retry,
    SetState,
    WaitForPhase,
    backoff_delay,
    carry_out,
    run_steps,
    wait_timeout,
)
from ..core.errors import describe
from .backend import RendezvousBackend, StateSizeLimit, Token, state_error

if TYPE_CHECKING:
    from .errors import RendezvousStateError

__all__ = ["StateSync", "backoff_delay", "size_limit_of"]

log = logging.getLogger(__name__)

#: What every backend is held to: a larger state could be written but not read back.
_DECODER_LIMIT = StateSizeLimit(
    MAX_STATE_BYTES,
    f"rallypoint reads states of at most {MAX_STATE_BYTES // (1024 * 1024)} MiB",
    "fewer nodes per run (max_nodes) or shorter node addresses",
)


def size_limit_of(backend: object) -> StateSizeLimit:
    """The largest state ``backend`` stores, or the decoder's limit if that is lower."""
    limit = getattr(backend, "state_size_limit", None)
    if isinstance(limit, StateSizeLimit) and limit.max_bytes < MAX_STATE_BYTES:
        return limit
    return _DECODER_LIMIT


class Codec:
    """Decoding and encoding of one node's backend values, with errors that name
    the key and say what to check (shared by the threaded and asyncio executors)."""

    def __init__(self, backend: object, settings: Settings) -> None:
        self.backend = backend
        self.settings = settings
        self.size_limit = size_limit_of(backend)

    def key(self, suffix: str) -> str:
        """The backend's full name of this run's key ``suffix``, for messages."""
        name = getattr(self.backend, "key", None)
        return str(name(suffix)) if callable(name) else suffix

    def state_error(self, what: str, check: str) -> RendezvousStateError:
        endpoint = str(getattr(self.backend, "endpoint", "?"))
        return state_error(
            describe(what, run_id=self.settings.run_id, endpoint=endpoint, check=check)
        )

    def decode(self, blob: bytes) -> RendezvousState:
        try:
            # With this node's settings: a state that is valid only for other node
            # counts is an error here, not a join that fails later.
            return decode_state(blob, self.settings)
        except core_errors.RendezvousStateError as exc:
            raise self.state_error(
                f"{exc}, read from key {self.key('state')!r}",
                "that every node runs the same rallypoint version with the same settings "
                "and that nothing else writes to this run id; start a fresh run id to recover",
            ) from exc

    def encode(self, state: RendezvousState) -> bytes:
        """The blob of ``state``; refuses a state the backend would not store (or
        nobody could read back), with a message that says whose limit it is, before
        the write fails there (a TCPStore drops the connection, etcd answers
        "request is too large")."""
        blob = encode_state(state)
        limit = self.size_limit
        if len(blob) > limit.max_bytes:
            raise self.state_error(
                f"the rendezvous state would grow to {len(blob):,} bytes "
                f"({len(state.members())} nodes), over the limit of {limit.max_bytes:,} bytes "
                f"of the {getattr(self.backend, 'name', '?')} backend: {limit.reason}",
                limit.remedy,
            )
        return blob

    def intents(self, round_: int, raw_entries: Iterable[bytes]) -> list[NodeDesc]:
        entries = []
        for raw in raw_entries:
            try:
                entries.append(NodeDesc.parse(bytes(raw).decode("ascii")))
            except (UnicodeDecodeError, ValueError) as exc:
                raise self.state_error(
                    f"the intent log of round {round_} (key {self.key(f'intents/{round_}')!r}) "
                    f"holds an entry that is not a node ({exc})",
                    "that nothing else writes to this run id",
                ) from exc
        return entries

    def counter_keys(self, nodes: Collection[NodeDesc]) -> list[str]:
        """The backend's keys of the side counters of ``nodes`` (``str(desc)``)."""
        return [str(n) for n in nodes]

    def counters(self, nodes: Collection[NodeDesc], raw: Mapping[str, int]) -> dict[NodeDesc, int]:
        """Each of ``nodes``' side counter, from :meth:`counter_keys`' answer."""
        return {n: raw.get(str(n), 0) for n in nodes}

    def heartbeat_key(self, node: NodeDesc) -> str:
        return str(node)

    def intent_entry(self, node: NodeDesc) -> bytes:
        return str(node).encode("ascii")


def call(backend: Any, op: Operation) -> Any:
    """The backend call that performs ``op`` (an operation of
    :mod:`rallypoint.core.dispatch` other than a WaitForPhase, whose timeout is the
    executor's), and its answer: a :class:`RendezvousBackend`'s answer, an
    :class:`~rallypoint.adapters.aio.AsyncBackend`'s awaitable of it."""
    match op:
        case GetState():
            return backend.get_state()
        case SetState(state, token, phase):
            return backend.set_state(state, token, phase=phase)
        case GetHeartbeats(keys):
            return backend.get_heartbeats(keys)
        case GetIntents(round_):
            return backend.intents(round_)
        case AppendIntent(round_, entry):
            return backend.announce(round_, entry)
        case BumpHeartbeat(key):
            return backend.beat(key)
    raise TypeError(f"not an operation a backend call performs: {op!r}")


class StateSync:
    """One node's :class:`RendezvousNode`, and the executor of its instructions.

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

    Thread-safe: one operation (or watch pass) drives the node at a time; the
    node is stepped under a lock that is never held while waiting on the backend,
    so queries (:meth:`must_fence`, :attr:`view`) answer meanwhile.
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
        on_instruction: Callable[[NodeInstruction], None] | None = None,
    ) -> None:
        self.backend = backend
        self.node = node
        self.settings = settings
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._poll_interval = poll_interval
        self._retry = Retry(window=retry_window)
        self._on_instruction = on_instruction
        # The node (view, token) changes in place: every step of it is made under
        # this lock; _driving lets one operation drive it at a time.
        self._lock = threading.Lock()
        self._driving = threading.RLock()
        self._core = RendezvousNode(node, settings)
        self._outages_seen = getattr(backend, "outages", None)
        self._codec = Codec(backend, settings)
        #: Counters of CAS attempts and losses, for benchmarks.
        self.cas_attempts = 0
        self.cas_losses = 0

    # -- the view ----------------------------------------------------------------

    @property
    def view(self) -> NodeView:
        """What this node knows (blob, counters, sightings), as a copy: the view
        itself changes with every read and write."""
        with self._lock:
            return self._core.view.copy()

    @property
    def state(self) -> RendezvousState:
        """The last read or written state."""
        with self._lock:
            return self._core.view.state

    @property
    def token(self) -> Token | None:
        with self._lock:
            return self._core.token

    def now(self) -> float:
        return self._clock()

    def key(self, suffix: str) -> str:
        """The backend's full name of this run's key ``suffix``, for messages."""
        return self._codec.key(suffix)

    # -- carrying out instructions ----------------------------------------------------

    def _carry_out(
        self, instruction: NodeInstruction, state: RendezvousState, token: Token | None
    ) -> Result:
        """Carry ``instruction`` out (:func:`rallypoint.core.dispatch.carry_out`,
        each operation a blocking call) for the node that held ``state`` and
        ``token`` when it returned it; the result to step the node with."""
        steps = carry_out(instruction, self._codec, node=self.node, state=state, token=token)
        return run_steps(steps, self._perform)

    def _perform(self, op: Operation) -> Any:
        if type(op) is WaitForPhase:
            timeout = wait_timeout(op.until, self._clock(), self._poll_interval)
            return self.backend.wait_for_phase(op.phase, timeout)
        if type(op) is SetState:
            self.cas_attempts += 1
        return call(self.backend, op)

    def _held(self) -> tuple[RendezvousState, Token | None]:
        """The node's state and its token (what a Write is set over)."""
        with self._lock:
            return self._core.view.state, self._core.token

    def _feed(self, result: Result) -> None:
        """Step the node with what an instruction did (an outage first, if the
        backend reports one since: before these counters are observed)."""
        self._after_outage()
        now = self._clock()
        with self._lock:
            self._core.feed(result, now)

    def _feed_now(self, result: Result) -> None:
        """Step the node with ``result`` (no outage check: nothing was read)."""
        with self._lock:
            self._core.feed(result, self._clock())

    def beat(self) -> None:
        """Bump this node's heartbeat counter (O(1) bytes) and record it."""
        self._feed(self._carry_out(Beat(), *self._held()))

    def _after_outage(self) -> None:
        """Time the peers afresh if the backend was unreachable since the last
        step (see the module docstring)."""
        outages = getattr(self.backend, "outages", None)
        if outages == self._outages_seen:
            return
        with self._lock:
            if outages == self._outages_seen:
                return
            self._outages_seen = outages
            self._core.feed(Outage(), self._clock())
        log.info("%s: the backend was unreachable; timing the peers' heartbeats afresh", self.node)

    def must_fence(self) -> bool:
        """Whether this node must stop its workers now: its lease ran out (see
        :meth:`rallypoint.core.RendezvousNode.must_fence`). Reads nothing."""
        with self._lock:
            return self._core.must_fence(self._clock())

    def _execute(self) -> tuple[NodeInstruction, bool]:
        """Step the node and carry its instruction out.

        Returns the instruction and whether it took effect (False: a Write lost its
        compare-and-set). Done and Verdict are returned, nothing carried out.
        """
        self._after_outage()
        with self._lock:
            instruction = self._core.next(self._clock())
            # the state and token a Write was made from
            state, token = self._core.view.state, self._core.token
        if self._on_instruction is not None:
            self._on_instruction(instruction)
        if isinstance(instruction, (Done, Verdict)):
            return instruction, True
        result = self._carry_out(instruction, state, token)
        self._feed(result)
        if type(result) is WriteResult and not result.won:
            self.cas_losses += 1
            return instruction, False
        return instruction, True

    def _drive(self, stop_at: float | None) -> Done | Verdict:
        """Carry out instructions until one is Done or a Verdict; return it.

        Lost compare-and-sets back off (:meth:`Retry.backoff
        <rallypoint.core.dispatch.Retry.backoff>`); an unreachable backend is
        retried for ``retry_window`` seconds (never past the operation's
        deadline, when ``stop_at`` is given) before the connection error is raised.
        """
        losses = 0
        down_since: float | None = None
        while True:
            try:
                instruction, took = self._execute()
                down_since = None
            except core_errors.RendezvousConnectionError as exc:
                now = self._clock()
                down_since = now if down_since is None else down_since
                with self._lock:
                    deadline = self._core.deadline if stop_at is not None else math.inf
                if self._retry.gives_up(now, deadline, now - down_since):
                    raise
                log.warning("%s: backend unreachable, retrying: %s", self.node, exc)
                self._feed_now(Unreachable())
                time.sleep(self._retry.unreachable_pause(self._rng))
                continue
            if isinstance(instruction, (Done, Verdict)):
                return instruction
            if not took:
                losses += 1
                time.sleep(self._retry.backoff(losses, self._rng))
            elif isinstance(instruction, Write):
                losses = 0

    # -- the loops ---------------------------------------------------------------------

    def run(self, op: Operator, deadline: float, *, fresh: bool = False) -> Done:
        """Run ``op`` until the node says Done, and return it.

        Args:
            op: the operator (JoinOp, ExitOp, CloseOp, KeepAliveOp, ...).
            deadline: local monotonic time after which the operator times out (a
                Write may move it: a redundant node that becomes a joiner).
            fresh: decide on the current view without reading first (it was just
                read or written, e.g. by the previous operator).

        Raises:
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        with self._driving:
            with self._lock:
                self._core.start(op, self._clock(), deadline, fresh=fresh)
            done = self._drive(deadline)
        assert isinstance(done, Done)
        return done

    def watch(self, joined: Membership | None, max_age: float = 0.0) -> Verdict:
        """What a node whose workers run in ``joined`` must act on (see
        :func:`rallypoint.core.driver.watch`), on a view at most ``max_age``
        seconds old.

        Raises:
            RendezvousConnectionError, RendezvousStateError: from the backend.
        """
        with self._driving:
            # Reading is the node's call (it asks for the counters when they are
            # due, and always before it declares a participant dead): only mark the
            # view stale when it is older than max_age.
            with self._lock:
                read_at = self._core.read_at
                fresh = read_at is not None and self._clock() - read_at < max_age
                self._core.watch(joined, fresh=fresh)
            verdict = self._drive(None)
        assert isinstance(verdict, Verdict)
        return verdict

    #: Renamed :meth:`watch` in 0.2.0 (CHANGELOG.md); warns, and goes in the next release.
    monitor = renamed_method("monitor", "watch")

    def invalidate(self) -> None:
        """Make the next decision read the state first."""
        self._feed_now(WaitResult())

    def refresh(self, max_age: float = 0.0, counters: bool = False) -> RendezvousState:
        """Re-read the state unless the view is at most ``max_age`` seconds old
        (and, with ``counters``, its counters were read with it); return it merged."""
        now = self._clock()
        with self._lock:
            view = self._core.view
            read_at, stale, counters_at = self._core.read_at, view.stale, view.counters_at
        fresh = not stale and read_at is not None and now - read_at <= max_age
        counters_fresh = counters_at is not None and now - counters_at <= max_age
        if not fresh or (counters and not counters_fresh):
            self._feed(self._carry_out(Read(counters), *self._held()))
        return self.state

    def wait_for_change(self, timeout: float) -> bool:
        """Block until a phase above the view's is published (anything a waiting or
        monitoring node decides on changed) or ``timeout`` passes; the next
        decision reads afresh."""
        changed = self.backend.wait_for_phase(self.state.phase, timeout)
        self.invalidate()
        return changed
