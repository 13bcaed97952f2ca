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
    "fence_after",
    "fence_due",
    "heartbeat_of",
    "lease_expiry",
    "observe",
    "observe_own",
    "observe_read",
    "renew_own",
    "sanitize",
]

#: Bits of a sighting's counter that hold the side counter.
SIDE_BITS = 32
_SIDE_MASK = (1 << SIDE_BITS) - 1
_NOBODY: frozenset[NodeDesc] = frozenset()
_since: Callable[[HeartbeatSighting], float] = operator.attrgetter("since")
#: Observations made here (see Observations._derived), the class method bound once.
_observations = Observations._derived


def heartbeat_of(state_counter: int, side_counter: int) -> int:
    """The counter a sighting watches: it moves whenever either part moves."""
    return (state_counter << SIDE_BITS) | (side_counter & _SIDE_MASK)


def _oldest(sightings: Map[NodeDesc, HeartbeatSighting]) -> float | None:
    if not sightings:
        return None
    return min(map(_since, sightings.values()))


# -- the rules, on one sighting at a time ------------------------------------------------
#
# A node keeps its own sighting (its lease) and the last-call sighting apart from
# its sightings of the others (see rallypoint.core.driver.NodeView): they change on
# nearly every read and write, the others only when the side counters are read.
# The functions on whole Observations further down apply these same rules.


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
    return LastCallSighting(state.round, arming, now)


def _own_read(
    own: HeartbeatSighting | None, counter: int | None, side_counter: int, now: float
) -> HeartbeatSighting | None:
    """A node's own sighting after it read (or wrote without renewing) a state in
    which its counter is ``counter`` (None: it has no entry), its side counter
    being ``side_counter``: gone with the entry; a new entry first seen now; a
    counter that another node's write moved (a batch admitted it) keeps the
    lease's start, since a read is no renewal (see :func:`renew_own`)."""
    if counter is None:
        return None
    pair = heartbeat_of(counter, side_counter)
    if own is None:
        return HeartbeatSighting(pair, now)
    if own.counter == pair:
        return own
    return HeartbeatSighting(pair, own.since)


def _own_renewed(own: HeartbeatSighting | None, pair: int, started: float) -> HeartbeatSighting:
    """A node's own sighting after a renewal of its lease (a keep-alive, or a won
    write of its own) that moved its counter pair to ``pair``, sent at local time
    ``started`` (see :func:`renew_own`)."""
    if own is not None and own.since > started and own.counter == pair:
        started = own.since  # already recorded by a later renewal
    return HeartbeatSighting(pair, started)


def _observe_sightings(
    seen: Map[NodeDesc, HeartbeatSighting],
    oldest: float | None,
    counts: Map[NodeDesc, int],
    side: Mapping[NodeDesc, int] | None,
    now: float,
    observer: NodeDesc | None,
) -> tuple[Map[NodeDesc, HeartbeatSighting], float | None]:
    """The sightings ``seen`` (the earliest of them ``oldest``) after the state
    counters ``counts`` were read with the side counters ``side``: a member whose
    counter pair differs from the one seen (or is new) restarts its timer, and
    nodes no longer in the state are forgotten. ``observer``'s own entry is left
    out (its sighting is kept apart)."""
    mutable = seen.mutate()
    restarted = False  # some sighting now starts at ``now``
    lost_oldest = False  # the sighting ``oldest`` came from was replaced or dropped
    for node, counter in counts.items():
        if node == observer:
            continue
        value = heartbeat_of(counter, 0 if side is None else side.get(node, 0))
        sighting = seen.get(node)
        if sighting is None or sighting.counter != value:
            if sighting is not None and sighting.since == oldest:
                lost_oldest = True
            mutable[node] = HeartbeatSighting(value, now)
            restarted = True
    dropped = False
    watched = len(counts) - (observer is not None and observer in counts)
    if len(mutable) != watched:  # some nodes left the state
        for node, sighting in seen.items():
            if node not in counts or node == observer:
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
    return updated, oldest


def _none_expired(oldest: float | None, settings: Settings, now: float) -> bool:
    """No sighting, the earliest of them taken at ``oldest`` (None: none), is
    older than the liveness window: nobody can be declared dead yet."""
    return oldest is None or now - oldest <= settings.liveness_window


def _fence_due(own: HeartbeatSighting | None, settings: Settings, now: float) -> bool:
    """:func:`fence_due` of the own sighting ``own``."""
    return own is not None and now - own.since >= fence_after(settings)


# -- the same rules on a node's whole Observations ----------------------------------------


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
    state (None: there are none; every side counter counts as 0): a
    member whose counter pair differs from the last one seen (or is new) restarts
    its liveness timer, and nodes no longer in the state are forgotten. Without
    ``counters`` (the state was read alone), only the last call is observed. A
    newly armed last call starts this node's last-call timer.
    """
    counts = state.heartbeats
    last_call = _last_call_seen(observations.last_call, state, now)
    if counters and (observations.source is not counts or observations.source_side is not side):
        seen, oldest = _observe_sightings(
            observations.heartbeats, observations.oldest, counts, side, now, None
        )
        return _observations(seen, last_call, counts, side, oldest)
    # Most reads and writes: only the last call can have changed.
    if last_call is observations.last_call:
        return observations
    return _observations(
        observations.heartbeats,
        last_call,
        observations.source,
        observations.source_side,
        observations.oldest,
    )


def _with_own(
    observations: Observations,
    node: NodeDesc,
    own: HeartbeatSighting | None,
    last_call: LastCallSighting | None,
) -> Observations:
    """``observations`` with ``node``'s sighting ``own`` (None: none) and the
    last-call sighting ``last_call`` (itself when neither changed)."""
    seen = observations.heartbeats
    before = seen.get(node)
    if own is before:
        if last_call is observations.last_call:
            return observations
        updated = seen
    elif own is None:
        updated = seen.delete(node)
    else:
        updated = seen.set(node, own)
    oldest = observations.oldest
    if before is not None and (oldest is None or before.since == oldest):
        oldest = _oldest(updated)  # the earliest sighting may have gone
    elif own is not None and (oldest is None or own.since < oldest):
        oldest = own.since
    return _observations(updated, last_call, observations.source, observations.source_side, oldest)


def observe_read(
    observations: Observations,
    state: RendezvousState,
    node: NodeDesc,
    side_counter: int,
    now: float,
) -> Observations:
    """What ``node`` sees in a ``state`` read (or written) without the side
    counters, its own side counter being ``side_counter``: the last call (as
    :func:`observe` without counters), and its own counter pair. A new own entry is
    first seen now; an own counter that another node's write moved keeps the
    lease's start (a read is no renewal, see :func:`renew_own`)."""
    own = _own_read(
        observations.heartbeats.get(node), state.heartbeats.get(node), side_counter, now
    )
    last_call = _last_call_seen(observations.last_call, state, now)
    return _with_own(observations, node, own, last_call)


def renew_own(
    observations: Observations, node: NodeDesc, counter: int | None, started: float
) -> Observations:
    """Record a renewal of this node's lease: a keep-alive or a won write of its
    own that moved its counter pair to ``counter``, sent at local time ``started``.

    The own sighting's ``since`` is the lease's start (docs/design.md, decision
    7): a peer first sees the new counter no earlier than it reached the store,
    which is no earlier than it was sent, so a peer declares this node dead no
    earlier than ``liveness_window`` after ``since``. Its keep-alive timer runs
    from there too. Reads never renew: a counter moved by another node's write (a
    batch admission) keeps its ``since``.
    """
    if counter is None:
        return observe_own(observations, node, None, started)
    own = _own_renewed(observations.heartbeats.get(node), counter, started)
    return _with_own(observations, node, own, observations.last_call)


def fence_after(settings: Settings) -> float:
    """How long after its last renewal (see :func:`renew_own`) a node must have
    stopped its workers: half a keep-alive interval (at most a quarter of the
    window) before any peer can declare it dead. A node cut off from the store
    fences itself before the others can regroup without it, so two groups never
    train at once (docs/design.md, decision 7)."""
    window = settings.liveness_window
    return window - min(settings.keep_alive_interval / 2, window / 4)


def fence_due(observations: Observations, node: NodeDesc, settings: Settings, now: float) -> bool:
    """Whether ``node``'s lease has run out at local time ``now``: it has not
    renewed for :func:`fence_after` and must stop its workers now. False for a
    node that holds no heartbeat entry (nothing to fence)."""
    return _fence_due(observations.heartbeats.get(node), settings, now)


def lease_expiry(observations: Observations, node: NodeDesc, settings: Settings) -> float | None:
    """The local time from which a peer may declare ``node`` dead (None: no lease)."""
    sighting = observations.heartbeats.get(node)
    return None if sighting is None else sighting.since + settings.liveness_window


def observe_own(
    observations: Observations, node: NodeDesc, counter: int | None, now: float
) -> Observations:
    """Record that this node's own counter pair is now ``counter`` (None: it has no
    entry any more): its keep-alive timer restarts when the counter moved."""
    sighting = observations.heartbeats.get(node)
    if counter is None:
        own = None
    elif sighting is not None and sighting.counter == counter:
        own = sighting
    else:
        own = HeartbeatSighting(counter, now)
    return _with_own(observations, node, own, observations.last_call)


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
    peers judge it by their own sightings. Nor a node whose counter in ``state``
    is not the one its sighting watched: it moved after the sighting was taken
    (found by the simulator: a node removed during a partition rejoined, and a
    peer declared it dead again on the sighting of its old entry while it trained).
    """
    if _none_expired(observations.oldest, settings, now):
        return _NOBODY
    window = settings.liveness_window
    seen = observations.heartbeats
    return frozenset(
        node
        for node, counter in state.heartbeats.items()
        if (sighting := seen.get(node)) is not None
        and now - sighting.since > window
        and node != observer
        # A state counter other than the one the sighting watched moved since (the
        # node came back, or was admitted again): the sighting is not evidence.
        and sighting.counter >> SIDE_BITS == counter
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
        # A dead node is known gone: the next round does not wait for it.
        returning=state.returning - dead,
    )
    if participant_removed:
        state = remove_participant_epilogue(state, settings)
    return state, dead
