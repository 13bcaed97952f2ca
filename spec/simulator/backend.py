"""The simulated backend (:class:`Backend`): the state in a compare-and-set
register with a version, one side heartbeat counter per node, the highest
published phase and its watches, and one intent log per round; the requests it
serves (the operations of :mod:`rallypoint.core.dispatch`), the commit of a won
write, and the writes, beats and intents injected by tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from immutables import Map

from ...core import Action, NodeDesc, NodeInstruction, RendezvousState, Write, encode_state
from ...core.codec import EncodedSize
from ...core.dispatch import (
    AppendIntent,
    BumpHeartbeat,
    GetHeartbeats,
    GetIntents,
    GetState,
    Operation,
    SetState,
    Steps,
    run_steps,
)
from .checks import Checks
from .events import EventLoop
from .node import SimNode

__all__ = ["Backend", "StateChange"]

#: An injected write: the stored state -> the state to store (None: write nothing).
StateChange = Callable[[RendezvousState], RendezvousState | None]

#: The operations that read: a request that starts with one is a read request.
_READS = (GetState, GetHeartbeats, GetIntents)


def _key_bytes(node: NodeDesc) -> int:
    """Bytes of one side counter on the wire: its key and an 8-byte value."""
    return len(str(node)) + 8


def _entry_bytes(node: NodeDesc) -> int:
    """Bytes of one intent-log entry when read: the node's name and a separator."""
    return len(str(node)) + 1


class Backend:
    """The backend's data and the requests it serves (each an event, answered
    after the latency by a ``response`` event). Every write it commits goes
    through ``checks`` first.

    Args:
        loop: the run's event loop; the backend registers the handlers of its
            requests (``backend_*``) and of injections there.
        checks: what checks each committed write and removal.
        initial: the stored state before the first write.
    """

    def __init__(self, loop: EventLoop, checks: Checks, initial: RendezvousState) -> None:
        self.loop = loop
        self.config = loop.config
        self.report = loop.report
        self.checks = checks
        #: the stored state and its version (the compare-and-set token)
        self.state = initial
        self.version = 0
        #: the side counter of every node (an immutable map: a read hands out a
        #: snapshot without copying), the highest published phase (-1: none), and
        #: the intent log of each round with its size in bytes
        self.side: Map[NodeDesc, int] = Map()
        self.published = -1
        self.intents: dict[int, list[NodeDesc]] = {}
        self._intent_bytes: dict[int, int] = {}
        #: phase watches: the phase watched -> {slot: watch token}
        self._watching: dict[int, dict[int, int]] = {}
        #: injected writes waiting for the next compare-and-set (inject_write(race=True))
        self._races: list[StateChange] = []
        self.size = EncodedSize(self.state)
        #: bytes of the side counters of the state's heartbeat members
        self.counter_bytes = 0
        #: how each operation of a request is served
        self._serving: dict[type, Callable[[SimNode, Any, NodeInstruction], Any]] = {
            GetState: self._get_state,
            GetHeartbeats: self._get_heartbeats,
            GetIntents: self._get_intents,
            SetState: self._set_state,
            BumpHeartbeat: self._bump_heartbeat,
            AppendIntent: self._append,
        }
        loop.on("backend_watch", self._on_backend_watch)
        loop.on("backend_request", self._on_backend_request)
        loop.on("inject", self._on_inject)

    def _reply(self, node: SimNode, data: Any) -> None:
        loop = self.loop
        loop.at(loop.now + loop.delay(), "response", node.slot, node.req, data)

    # -- phase watches -------------------------------------------------------------

    def watch(self, node: SimNode, phase: int) -> None:
        """Ask the backend to notify ``node`` once a phase above ``phase`` is
        published (a request: lost while partitioned, the timer then decides)."""
        self.unwatch(node)
        if not node.partitioned:
            loop = self.loop
            loop.at(loop.now + loop.delay(), "backend_watch", node.slot, node.wtok, phase)

    def unwatch(self, node: SimNode) -> None:
        """Drop ``node``'s phase watch (its pending events too)."""
        node.wtok += 1
        watched = node.watch_q
        if watched is not None:
            node.watch_q = None
            slots = self._watching.get(watched)
            if slots is not None:
                slots.pop(node.slot, None)
                if not slots:
                    del self._watching[watched]

    def _on_backend_watch(self, node: SimNode, phase: int) -> None:
        if self.published > phase:
            loop = self.loop
            loop.at(loop.now + loop.delay(), "notify", node.slot, node.wtok)
            return
        self._watching.setdefault(phase, {})[node.slot] = node.wtok
        node.watch_q = phase

    def _publish(self, phase: int) -> None:
        """Publish ``phase``: notify the nodes watching a lower one (only them; a
        partitioned one stays registered and is notified by a later phase)."""
        if phase <= self.published:
            return
        self.published = phase
        self.report.phases += 1
        watching = self._watching
        loop = self.loop
        nodes = loop.nodes
        for watched in [q for q in watching if q < phase]:
            slots = watching.pop(watched)
            kept: dict[int, int] = {}
            for slot, token in slots.items():
                node = nodes[slot]
                if token != node.wtok:
                    continue
                if node.partitioned:
                    kept[slot] = token
                    continue
                node.watch_q = None
                loop.at(loop.now + loop.delay(), "notify", slot, token)
            if kept:
                watching[watched] = kept

    # -- the backend -------------------------------------------------------------------

    def _on_backend_request(
        self, node: SimNode, data: tuple[Steps, Operation, NodeInstruction]
    ) -> None:
        """A node's request arrives: serve its operations now, all of them (one
        round trip: a read's state, counters and intent log are read together),
        and answer with the result to feed its node."""
        steps, op, instruction = data
        if type(op) in _READS:
            self.report.stats[node.slot].reads += 1
        serving = self._serving

        def serve(op: Operation) -> Any:
            return serving[type(op)](node, op, instruction)

        self._reply(node, run_steps(steps, serve, serve(op)))

    def _get_state(self, node: SimNode, op: GetState, _: NodeInstruction) -> object:
        self.report.stats[node.slot].bytes_read += self.size.value
        return self.state, self.version

    def _get_heartbeats(self, node: SimNode, op: GetHeartbeats, _: NodeInstruction) -> object:
        # Every node's counter (an immutable snapshot, no copy); the driver looks
        # up the members' only, which is what the bytes count (kept incrementally
        # for the stored state's members).
        keys = op.keys
        stats = self.report.stats[node.slot]
        if keys is self.state.heartbeats:
            stats.bytes_read += self.counter_bytes
        else:
            stats.bytes_read += sum(map(_key_bytes, keys))
        return self.side

    def _get_intents(self, node: SimNode, op: GetIntents, _: NodeInstruction) -> object:
        stats = self.report.stats[node.slot]
        stats.intent_reads += 1
        stats.bytes_read += self._intent_bytes.get(op.round, 0)
        entries = self.intents.get(op.round)
        return () if entries is None else tuple(entries)

    def _set_state(self, node: SimNode, op: SetState, write: NodeInstruction) -> object:
        assert type(write) is Write
        if self._races:
            # Injected writes that beat this compare-and-set.
            races, self._races = self._races, []
            for change in races:
                self._inject_write(change)
        stats = self.report.stats[node.slot]
        if op.token != self.version or (
            self.config.conflict_rate and self.loop.rng.random() < self.config.conflict_rate
        ):
            stats.conflicts += 1
            stats.bytes_read += self.size.value
            return self.state, self.version, False
        for gone in sorted(write.dead):  # sorted: the report is independent of hashing
            self.checks.judge_death(node, gone)
        # The writer may be among the dead (its own counter stood still, e.g. while
        # it was partitioned): name each touched node once.
        touched = tuple(dict.fromkeys((node.desc, *sorted(write.dead), *write.admitted)))
        self._commit(node, op.state, touched)
        if write.action is Action.CHARGE_RESTART:
            self.report.charges += 1
        elif write.action is Action.EXCLUDE:
            self.report.exclusions += 1
        if op.phase is not None:
            stats.bytes_written += 8
            self._publish(op.phase)
        return self.state, self.version, True

    def _bump_heartbeat(self, node: SimNode, op: BumpHeartbeat, _: NodeInstruction) -> int:
        key: NodeDesc = op.key
        value = self.side.get(key, 0) + 1
        self.side = self.side.set(key, value)
        stats = self.report.stats[node.slot]
        size = _key_bytes(key)
        stats.beats += 1
        stats.bytes_written += size
        stats.beat_bytes += size
        return value

    def _append_intent(self, desc: NodeDesc, round_: int) -> None:
        self.intents.setdefault(round_, []).append(desc)
        self._intent_bytes[round_] = self._intent_bytes.get(round_, 0) + _entry_bytes(desc)

    def _append(self, node: SimNode, op: AppendIntent, _: NodeInstruction) -> None:
        entry: NodeDesc = op.entry
        self._append_intent(entry, op.round)
        stats = self.report.stats[node.slot]
        stats.announces += 1
        stats.bytes_written += len(str(entry)) + 8
        self.loop.log(node, f"announces itself in round {op.round}")

    def _commit(
        self, writer: SimNode | None, new: RendezvousState, touched: tuple[NodeDesc, ...]
    ) -> None:
        old = self.state
        problems = self.checks.check(old, new, touched)
        self.version += 1
        self.state = new
        size = self.size.update(new, touched)
        for desc in touched:
            if desc in old.heartbeats:
                self.counter_bytes -= _key_bytes(desc)
            if desc in new.heartbeats:
                self.counter_bytes += _key_bytes(desc)
        if self.config.verify_bytes:
            encoded = len(encode_state(new))
            if size != encoded:
                problems.append(f"incremental size {size} != encoded size {encoded}")
            counted = sum(map(_key_bytes, new.heartbeats))
            if self.counter_bytes != counted:
                problems.append(f"counter bytes {self.counter_bytes} != {counted}")
        if writer is not None:
            stats = self.report.stats[writer.slot]
            stats.writes += 1
            stats.bytes_written += size
        self.checks.account_round(old, new, touched)
        if problems:
            self.loop.violate(problems)

    # -- injection (the conformance tests) ---------------------------------------

    def inject_write(self, at: float, change: StateChange, *, race: bool = False) -> None:
        """At simulated time ``at``, a writer that is not simulated replaces the
        stored state with ``change(state)`` (None: writes nothing). The write is
        committed like a node's: checked, versioned, and its phase published if it
        moved the state's. With ``race``, the write lands right before the first
        compare-and-set served at or after ``at``, which then loses to it."""
        self.loop.at(at, "inject", 0, -1, ("race" if race else "write", change))

    def inject_beat(self, at: float, node: NodeDesc) -> None:
        """At simulated time ``at``, bump the side heartbeat counter of ``node``
        (a node that is not simulated beats)."""
        self.loop.at(at, "inject", 0, -1, ("beat", node))

    def inject_announce(self, at: float, node: NodeDesc, round_: int) -> None:
        """At simulated time ``at``, append ``node`` to the intent log of
        ``round_`` (a joiner that is not simulated announces itself)."""
        self.loop.at(at, "inject", 0, -1, ("announce", (node, round_)))

    def _on_inject(self, _: SimNode, data: Any) -> None:
        what, payload = data
        if what == "beat":
            self.side = self.side.set(payload, self.side.get(payload, 0) + 1)
            self.loop.log(None, f"injected beat of {payload}")
        elif what == "announce":
            node, round_ = payload
            self._append_intent(node, round_)
            self.loop.log(None, f"injected announce of {node} in round {round_}")
        elif what == "race":
            self._races.append(payload)
        else:
            self._inject_write(payload)

    def _inject_write(self, change: StateChange) -> None:
        old = self.state
        new = change(old)
        if new is None:
            return
        touched = old.members() | new.members() | set(old.heartbeats) | set(new.heartbeats)
        self.loop.log(None, "injected write")
        self._commit(None, new, tuple(sorted(touched)))
        if new.phase > old.phase:
            self._publish(new.phase)
