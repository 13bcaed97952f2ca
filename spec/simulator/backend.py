"""The simulated backend (:class:`Backend`): the state in a compare-and-set
register with a version, one side heartbeat counter per node, the highest
published phase and its watches, and one intent log per round; the requests it
serves, the commit of a won write, and the writes, beats and intents injected by
tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from immutables import Map

from ...core import Action, NodeDesc, RendezvousState, Write, encode_state
from ...core.codec import EncodedSize
from .checks import Checks
from .events import EventLoop
from .node import SimNode

__all__ = ["Backend", "StateChange"]

#: An injected write: the stored state -> the state to store (None: write nothing).
StateChange = Callable[[RendezvousState], RendezvousState | None]


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
        loop.on("backend_watch", self._on_backend_watch)
        loop.on("backend_read", self._on_backend_read)
        loop.on("backend_cas", self._on_backend_cas)
        loop.on("backend_beat", self._on_backend_beat)
        loop.on("backend_announce", self._on_backend_announce)
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

    def _on_backend_read(self, node: SimNode, data: tuple[bool, bool, bool]) -> None:
        counters, intents, with_state = data
        stats = self.report.stats[node.slot]
        stats.reads += 1
        if with_state:
            state = self.state
            size = self.size.value
        else:
            state = node.view.state  # StateSync keeps the view's state and token
            size = 0
        side = None
        if counters:
            # Every node's counter (an immutable snapshot, no copy); the driver
            # looks up the members' only, which is what the bytes count.
            side = self.side
            if with_state:
                size += self.counter_bytes
            else:
                size += sum(map(_key_bytes, state.heartbeats))
        log = None
        if intents:
            stats.intent_reads += 1
            entries = self.intents.get(state.round)
            log = () if entries is None else tuple(entries)
            size += self._intent_bytes.get(state.round, 0)
        stats.bytes_read += size
        reply = ("read", state if with_state else None, self.version, side, log)
        self._reply(node, reply)

    def _on_backend_cas(self, node: SimNode, data: tuple[int, Write]) -> None:
        expected, write = data
        if self._races:
            # Injected writes that beat this compare-and-set.
            races, self._races = self._races, []
            for change in races:
                self._inject_write(change)
        stats = self.report.stats[node.slot]
        if expected != self.version or (
            self.config.conflict_rate and self.loop.rng.random() < self.config.conflict_rate
        ):
            stats.conflicts += 1
            stats.bytes_read += self.size.value
            self._reply(node, ("cas", False, self.state, self.version, write))
            return
        for gone in sorted(write.dead):  # sorted: the report is independent of hashing
            self.checks.judge_death(node, gone)
        # The writer may be among the dead (its own counter stood still, e.g. while
        # it was partitioned): name each touched node once.
        touched = tuple(dict.fromkeys((node.desc, *sorted(write.dead), *write.admitted)))
        self._commit(node, write.state, touched)
        if write.action is Action.CHARGE_RESTART:
            self.report.charges += 1
        elif write.action is Action.EXCLUDE:
            self.report.exclusions += 1
        if write.phase is not None:
            stats.bytes_written += 8
            self._publish(write.phase)
        self._reply(node, ("cas", True, self.state, self.version, write))

    def _on_backend_beat(self, node: SimNode, data: Any) -> None:
        value = self.side.get(node.desc, 0) + 1
        self.side = self.side.set(node.desc, value)
        stats = self.report.stats[node.slot]
        size = _key_bytes(node.desc)
        stats.beats += 1
        stats.bytes_written += size
        stats.beat_bytes += size
        self._reply(node, ("beat", value))

    def _append_intent(self, desc: NodeDesc, round_: int) -> None:
        self.intents.setdefault(round_, []).append(desc)
        self._intent_bytes[round_] = self._intent_bytes.get(round_, 0) + _entry_bytes(desc)

    def _on_backend_announce(self, node: SimNode, round_: int) -> None:
        self._append_intent(node.desc, round_)
        stats = self.report.stats[node.slot]
        stats.announces += 1
        stats.bytes_written += len(str(node.desc)) + 8
        self.loop.log(node, f"announces itself in round {round_}")
        self._reply(node, ("announce", round_))

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
