"""Liveness: what time does to the shared state, as seen by one node.

Heartbeats are counters, never clock values (docs/design.md, decision 2). Each node
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

import operator
from collections.abc import Callable, Mapping

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
    "observe_read",
    "sanitize",
]

#: Bits of a sighting's counter that hold the side counter.
SIDE_BITS = 32
_SIDE_MASK = (1 << SIDE_BITS) - 1
_NOBODY: frozenset[NodeDesc] = frozenset()
#: A named tuple from all its fields, without the Python-level ``__new__`` that
#: calling the class runs (sightings are renewed on nearly every read and write).
_built = tuple.__new__
_since: Callable[[HeartbeatSighting], float] = operator.attrgetter("since")


def heartbeat_of(state_counter: int, side_counter: int) -> int:
    """The counter a sighting watches: it moves whenever either part moves."""
    return (state_counter << SIDE_BITS) | (side_counter & _SIDE_MASK)


def _oldest(sightings: Map[NodeDesc, HeartbeatSighting]) -> float | None:
    if not sightings:
        return None
    return min(map(_since, sightings.values()))


def _last_call_seen(
    seen: LastCallSighting | None, state: RendezvousState, now: float
) -> LastCallSighting | None:
    """The last-call sighting after reading ``state`` (``seen`` itself if it still
    stands)."""
    arming = state.last_call
    if arming is None:
        return None
    if seen is not None and seen.arming == arming and seen.round == state.round:
        return seen
    return _built(LastCallSighting, (state.round, arming, now))


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
    counts = state.heartbeats
    if counters and (observations.source is not counts or observations.source_side is not side):
        return _observe_counters(observations, state, now, side)
    # Most reads and writes: only the last call can have changed.
    last_call = _last_call_seen(observations.last_call, state, now)
    if last_call is observations.last_call:
        return observations
    return Observations._derived(
        observations.heartbeats,
        last_call,
        observations.source,
        observations.source_side,
        observations.oldest,
    )


def _observe_counters(
    observations: Observations,
    state: RendezvousState,
    now: float,
    side: Mapping[NodeDesc, int] | None,
) -> Observations:
    """:func:`observe` of counters that are not the ones last observed."""
    seen = observations.heartbeats
    counts = state.heartbeats
    oldest = observations.oldest
    mutable = seen.mutate()
    restarted = False  # some sighting now starts at ``now``
    lost_oldest = False  # the sighting ``oldest`` came from was replaced or dropped
    for node, counter in counts.items():
        value = counter if side is None else heartbeat_of(counter, side.get(node, 0))
        sighting = seen.get(node)
        if sighting is None or sighting.counter != value:
            if sighting is not None and sighting.since == oldest:
                lost_oldest = True
            mutable[node] = _built(HeartbeatSighting, (value, now))
            restarted = True
    dropped = False
    if len(mutable) != len(counts):  # some nodes left the state
        for node, sighting in seen.items():
            if node not in counts:
                if sighting.since == oldest:
                    lost_oldest = True
                del mutable[node]
                dropped = True
    updated = mutable.finish() if restarted or dropped else seen
    if lost_oldest:
        oldest = _oldest(updated)
    elif restarted and (oldest is None or now < oldest):
        # Every other sighting is unchanged, and the new ones all start at now.
        oldest = now
    last_call = _last_call_seen(observations.last_call, state, now)
    return Observations._derived(updated, last_call, counts, side, oldest)


def observe_read(
    observations: Observations,
    state: RendezvousState,
    node: NodeDesc,
    side_counter: int,
    now: float,
) -> Observations:
    """What ``node`` sees in a ``state`` read (or written) without the side
    counters, its own side counter being ``side_counter``: exactly
    ``observe_own(observe(observations, state, now, counters=False), node, pair,
    now)`` for its own counter pair, in one call. Most reads change neither
    sighting, and then cost no new object."""
    last_call = _last_call_seen(observations.last_call, state, now)
    counter = state.heartbeats.get(node)
    sighting = observations.heartbeats.get(node)
    if counter is None:
        own = None
        moved = sighting is not None
    else:
        own = (counter << SIDE_BITS) | (side_counter & _SIDE_MASK)  # heartbeat_of, inlined
        moved = sighting is None or sighting.counter != own
    if last_call is not observations.last_call:
        observations = Observations._derived(
            observations.heartbeats,
            last_call,
            observations.source,
            observations.source_side,
            observations.oldest,
        )
    return observe_own(observations, node, own, now) if moved else observations


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
        updated = seen.set(node, _built(HeartbeatSighting, (counter, now)))
    oldest = observations.oldest
    if (sighting is not None and sighting.since == oldest) or oldest is None:
        # A node that reads no side counters holds its own new sighting alone.
        only_own = counter is not None and len(updated) == 1
        oldest = now if only_own else _oldest(updated)
    return Observations._derived(
        updated, observations.last_call, observations.source, observations.source_side, oldest
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
        return _NOBODY
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
    oldest = observations.oldest
    if oldest is None or now - oldest <= settings.liveness_window:
        return state, _NOBODY  # dead_nodes' own first test: no sighting is that old
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
