"""Liveness: what time does to the shared state, as seen by one node.

Heartbeats are counters, never clock values (DESIGN.md decision 2). Each node
records, on its own monotonic clock, when it first saw each counter value
(:func:`observe`); a node whose counter this observer has not seen move for the
liveness window is dead to it (:func:`dead_nodes`), and :func:`sanitize` removes
the dead from the state before a decision.

A member has two counters: the one in the state (bumped by the core's own join
actions, written with the state) and a *side* counter under the node's own key
(bumped by a keep-alive without rewriting the O(n) state). A sighting watches the
pair, folded into one integer (``state << 32 | side``): the node is alive while
either part moves. Sightings are taken when the side counters are read (at most
every quarter keep-alive interval, and always before a death is declared), and for
the observer itself whenever its own counter moves (:func:`observe_own`); reading
the state alone costs no per-node work.
"""

from __future__ import annotations

from collections.abc import Mapping

from immutables import Map

from .actions import remove_participant_epilogue
from .state import (
    HeartbeatSighting,
    LastCallSighting,
    NodeDesc,
    Observations,
    RendezvousState,
    Settings,
)

__all__ = [
    "SIDE_BITS",
    "dead_nodes",
    "heartbeat_of",
    "observe",
    "observe_own",
    "sanitize",
]

#: Bits of a sighting's counter that hold the side counter.
SIDE_BITS = 32
_SIDE_MASK = (1 << SIDE_BITS) - 1


def heartbeat_of(state_counter: int, side_counter: int) -> int:
    """The counter a sighting watches: it moves whenever either part moves."""
    return (state_counter << SIDE_BITS) | (side_counter & _SIDE_MASK)


def _oldest(sightings: Map[NodeDesc, HeartbeatSighting]) -> float | None:
    return min((s.since for s in sightings.values()), default=None)


def observe(
    observations: Observations,
    state: RendezvousState,
    now: float,
    side: Mapping[NodeDesc, int] | None = None,
    *,
    counters: bool = True,
) -> Observations:
    """Record what a freshly read (or written) ``state`` shows, at local time ``now``.

    With ``counters`` (the default), ``side`` holds the side counters read with the
    state (None: there are none, and the state's counters are watched alone): a
    member whose counter pair differs from the last one seen (or is new) restarts
    its liveness timer, and nodes no longer in the state are forgotten. Without
    ``counters`` (the state was read alone), only the last call is observed. A
    newly armed last call starts this node's last-call timer.
    """
    seen = observations.heartbeats
    updated = seen
    source, source_side, oldest = observations.source, observations.source_side, observations.oldest
    counts = state.heartbeats
    if counters and (source is not counts or source_side is not side):
        changed = False
        mutable = seen.mutate()
        for node, counter in counts.items():
            value = counter if side is None else heartbeat_of(counter, side.get(node, 0))
            sighting = seen.get(node)
            if sighting is None or sighting.counter != value:
                mutable[node] = HeartbeatSighting(value, now)
                changed = True
        if len(mutable) != len(counts):  # some nodes left the state
            for node in seen:
                if node not in counts:
                    del mutable[node]
                    changed = True
        finished = mutable.finish()
        if changed:
            updated = finished
        if updated is not seen:
            oldest = _oldest(updated)
        source, source_side = counts, side

    last_call = observations.last_call
    if state.last_call is None:
        last_call = None
    elif last_call is None or (last_call.round, last_call.arming) != (
        state.round,
        state.last_call,
    ):
        last_call = LastCallSighting(state.round, state.last_call, now)

    if (
        updated is seen
        and last_call is observations.last_call
        and source is observations.source
        and source_side is observations.source_side
    ):
        return observations
    return Observations(
        heartbeats=updated,
        last_call=last_call,
        source=source,
        source_side=source_side,
        oldest=oldest,
    )


def observe_own(
    observations: Observations, node: NodeDesc, counter: int | None, now: float
) -> Observations:
    """Record that this node's own counter pair is now ``counter`` (None: it has no
    entry any more): its keep-alive timer restarts when the counter moved."""
    seen = observations.heartbeats
    sighting = seen.get(node)
    if counter is None:
        if sighting is None:
            return observations
        updated = seen.delete(node)
    elif sighting is not None and sighting.counter == counter:
        return observations
    else:
        updated = seen.set(node, HeartbeatSighting(counter, now))
    oldest = observations.oldest
    if (sighting is not None and sighting.since == oldest) or oldest is None:
        oldest = _oldest(updated)
    return Observations(
        heartbeats=updated,
        last_call=observations.last_call,
        source=observations.source,
        source_side=observations.source_side,
        oldest=oldest,
    )


def dead_nodes(
    state: RendezvousState,
    observations: Observations,
    settings: Settings,
    now: float,
    observer: NodeDesc | None = None,
) -> frozenset[NodeDesc]:
    """Nodes whose heartbeat counter this observer has not seen move for the
    liveness window (``keep_alive_interval * keep_alive_max_attempt``).

    Never the ``observer`` itself: a node that finds its own counter silent (it
    could not beat, e.g. while the backend was down) is alive and beats now; its
    peers judge it by their own sightings.
    """
    window = settings.liveness_window
    oldest = observations.oldest
    if oldest is None or now - oldest <= window:
        return frozenset()
    return frozenset(
        node
        for node in state.heartbeats
        if (sighting := observations.heartbeats.get(node)) is not None
        and now - sighting.since > window
        and node != observer
    )


def sanitize(
    state: RendezvousState,
    observations: Observations,
    settings: Settings,
    now: float,
    observer: NodeDesc | None = None,
) -> tuple[RendezvousState, frozenset[NodeDesc]]:
    """Remove the nodes this observer considers dead; return the new state and them.

    Call :func:`observe` first, so that every node has a sighting: a node never seen
    is never declared dead, and neither is the ``observer`` (see :func:`dead_nodes`).
    """
    dead = dead_nodes(state, observations, settings, now, observer)
    if not dead:
        return state, dead
    participant_removed = any(node in state.participants for node in dead)
    participants = state.participants
    heartbeats = state.heartbeats
    for node in dead:
        heartbeats = heartbeats.delete(node)
        if node in participants:
            participants = participants.delete(node)
    state = state.evolve(
        participants=participants,
        heartbeats=heartbeats,
        wait_list=state.wait_list - dead,
        redundancy_list=state.redundancy_list - dead,
    )
    if participant_removed:
        state = remove_participant_epilogue(state, settings)
    return state, dead
