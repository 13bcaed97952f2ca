"""How the checker's states and events travel between its processes.

With several workers, every state of a level goes from the worker that reached it
to the main process, and from there to the worker that steps it (see
:mod:`~rallypoint.spec.check.search`). Pickled as they are, a state's nodes, enum
members, maps and local states each cost a Python call to pickle and another to
unpickle: on the 3-node space that was 5.5 CPU-seconds of the workers' and most of
the main process's 6.8, on a 2-core machine where the main process takes its CPU
from the workers. On the wire they are tuples of ints, strings, bools and None,
which pickle in C; each end keeps memo tables, so a shared state that many
successors share is encoded once and decoded once into one instance.

A wire state is ``(shared, locals, crashes, intents, failures, exclusions)``; its
shared state has a field per :class:`RendezvousState` field (maps and node sets
as tuples of node tuples). A wire event is ``(kind, slot, timers)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from immutables import Map

from ...core import NodeDesc, RendezvousState
from ..model.lifecycle import Phase
from .memo import Memo
from .state import Age, Deadline, Event, EventKind, Global, Local, Op, Timers

__all__ = ["Wire", "event_of"]

#: A state or an event on the wire (nested tuples of plain values).
WireTuple = tuple[Any, ...]

_FIELDS = tuple(f.name for f in dataclasses.fields(RendezvousState))
_MAPS = frozenset({"participants", "heartbeats", "last_ranks", "excluded"})
_SETS = frozenset({"wait_list", "redundancy_list", "returning"})


def _nodes(nodes: frozenset[NodeDesc]) -> tuple[tuple[str, int, int], ...]:
    # (in order: equal states have one wire form, and decode into one instance)
    return tuple(sorted(tuple(n) for n in nodes))  # type: ignore[misc]


def _encode_shared(state: RendezvousState) -> WireTuple:
    values: list[object] = []
    for name in _FIELDS:
        value = getattr(state, name)
        if name in _MAPS:
            value = tuple(sorted((tuple(n), v) for n, v in value.items()))
        elif name in _SETS:
            value = _nodes(value)
        values.append(value)
    return tuple(values)


def _decode_shared(wire: WireTuple) -> RendezvousState:
    fields: dict[str, Any] = {}
    for name, value in zip(_FIELDS, wire, strict=True):
        if name in _MAPS:
            value = Map({NodeDesc(*n): v for n, v in value})
        elif name in _SETS:
            value = frozenset(NodeDesc(*n) for n in value)
        fields[name] = value
    return RendezvousState(**fields)


def _encode_local(loc: Local) -> WireTuple:
    op = None if loc.op is None else loc.op.value
    deadline = None if loc.deadline is None else int(loc.deadline)
    return (loc.incarnation, loc.phase.value, op, deadline, loc.round_ended)


def _decode_local(wire: WireTuple) -> Local:
    incarnation, phase, op, deadline, round_ended = wire
    return Local(
        incarnation,
        Phase(phase),
        None if op is None else Op(op),
        None if deadline is None else Deadline(deadline),
        round_ended,
    )


def event_of(wire: WireTuple | Event) -> Event:
    """The event a wire event stands for (an event itself is returned as it is)."""
    if isinstance(wire, Event):
        return wire
    kind, slot, timers = wire
    if timers is not None:
        expired, own, over, deadline, contended = timers
        timers = Timers(
            frozenset(NodeDesc(*n) for n in expired),
            Age(own),
            over,
            None if deadline is None else Deadline(deadline),
            contended,
        )
    return Event(EventKind(kind), slot, timers)


class Wire:
    """One process's end of the wire: its encoding and decoding memo tables."""

    def __init__(self) -> None:
        #: id of a shared state -> (the state, its wire form); the entry keeps the
        #: state alive, so its id is not reused while the entry is there
        self._sent: Memo[int, tuple[RendezvousState, WireTuple]] = Memo()
        self._sent_locals: dict[Local, WireTuple] = {}
        #: wire form -> the one state (or local state) decoded from it
        self._received: Memo[WireTuple, RendezvousState] = Memo()
        self._received_locals: dict[WireTuple, Local] = {}
        #: event -> its wire form (a worker hands back the same timer choices in
        #: state after state)
        self._sent_events: Memo[Event, WireTuple] = Memo()

    def state(self, g: Global) -> WireTuple:
        """``g`` on the wire."""
        shared = g.shared
        known = self._sent.get(id(shared))
        if known is None or known[0] is not shared:
            known = self._sent.put(id(shared), (shared, _encode_shared(shared)))
        locals_ = []
        for loc in g.locals:
            wire = self._sent_locals.get(loc)
            if wire is None:
                wire = self._sent_locals[loc] = _encode_local(loc)
            locals_.append(wire)
        return (known[1], tuple(locals_), g.crashes, _nodes(g.intents), g.failures, g.exclusions)

    def global_of(self, wire: WireTuple) -> Global:
        """The state ``wire`` stands for."""
        shared_wire, locals_wire, crashes, intents, failures, exclusions = wire
        shared = self._received.get(shared_wire)
        if shared is None:
            shared = self._received.put(shared_wire, _decode_shared(shared_wire))
        locals_ = []
        for loc_wire in locals_wire:
            loc = self._received_locals.get(loc_wire)
            if loc is None:
                loc = self._received_locals[loc_wire] = _decode_local(loc_wire)
            locals_.append(loc)
        nodes = frozenset(NodeDesc(*n) for n in intents)
        return Global(shared, tuple(locals_), crashes, nodes, failures, exclusions)

    def event(self, event: Event) -> WireTuple:
        """``event`` on the wire."""
        known = self._sent_events.get(event)
        if known is not None:
            return known
        timers = event.timers
        wire_timers = None
        if timers is not None:
            deadline = None if timers.deadline is None else int(timers.deadline)
            wire_timers = (
                _nodes(timers.expired),
                timers.own.value,
                timers.last_call_over,
                deadline,
                timers.contended,
            )
        return self._sent_events.put(event, (event.kind.value, event.slot, wire_timers))
