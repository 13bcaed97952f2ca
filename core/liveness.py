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
#: A named tuple from all its fields, without the Python-level ``__new__`` that
#: calling the class runs (sightings are renewed on nearly every read and write).
_built = tuple.__new__
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
    state (None: there are none; every side counter counts as 0): a
    member whose counter pair differs from the last one seen (or is new) restarts
    its liveness timer, and nodes no longer in the state are forgotten. Without
    ``counters`` (the state was read alone), only the last call is observed. A
    newly armed last call starts this node's last-call timer.
    """
    counts = state.heartbeats
    if counters and (observations.source is not counts or observations.source_side is not side):
        return _observe_counters(observations, state, now, side)
    # Most reads and writes: only the last call can have changed.
    return _with_last_call(observations, _last_call_seen(observations.last_call, state, now))


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
        value = heartbeat_of(counter, 0 if side is None else side.get(node, 0))
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
    return _observations(updated, last_call, counts, side, oldest)


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
    sighting, and then cost no new object; a read that changes both builds one."""
    return _observe_own_entry(
        observations, state, node, state.heartbeats.get(node), side_counter, now
    )


def _observe_own_entry(
    observations: Observations,
    state: RendezvousState,
    node: NodeDesc,
    counter: int | None,
    side_counter: int,
    now: float,
) -> Observations:
    """:func:`observe_read`, given ``node``'s own entry in ``state``'s heartbeats
    (``counter``; None: it has none), which the driver has looked up already."""
    last_call = seen = observations.last_call
    arming = state.last_call
    # (_last_call_seen, inlined: this runs on every read and write of every node)
    if arming is None:
        last_call = None
    elif last_call is None or last_call.arming != arming or last_call.round != state.round:
        last_call = _built(LastCallSighting, (state.round, arming, now))
    updated = sightings = observations.heartbeats
    oldest = observations.oldest
    sighting = sightings.get(node)
    if counter is None:
        if sighting is None:
            if last_call is seen:
                return observations
        else:
            # The own entry is gone (observe_own of None).
            updated = sightings.delete(node)
            if sighting.since == oldest or oldest is None:
                oldest = _oldest(updated)
    else:
        own = (counter << SIDE_BITS) | (side_counter & _SIDE_MASK)  # heartbeat_of, inlined
        if sighting is None:
            # A new own entry, first seen now (observe_own).
            updated = sightings.set(node, _built(HeartbeatSighting, (own, now)))
            if oldest is None:
                oldest = now if len(updated) == 1 else _oldest(updated)
        elif sighting.counter == own:
            if last_call is seen:
                return observations
        else:
            # Another node's write moved this node's counter (a batch admitted it):
            # a read is no renewal of this node's lease (keep_own_since, renew_own).
            since = sighting.since
            updated = sightings.set(node, _built(HeartbeatSighting, (own, since)))
            if oldest is None or since < oldest:
                oldest = since
    return _observations(updated, last_call, observations.source, observations.source_side, oldest)


def _with_last_call(observations: Observations, last_call: LastCallSighting | None) -> Observations:
    """``observations`` with the last-call sighting ``last_call`` (itself when it
    is the one they hold)."""
    if last_call is observations.last_call:
        return observations
    return _observations(
        observations.heartbeats,
        last_call,
        observations.source,
        observations.source_side,
        observations.oldest,
    )


def keep_own_since(
    observations: Observations, node: NodeDesc, counter: int, since: float
) -> Observations:
    """``observations`` with this node's own sighting at ``counter`` and its
    ``since`` (the last renewal) kept."""
    updated = observations.heartbeats.set(node, _built(HeartbeatSighting, (counter, since)))
    oldest = observations.oldest
    if oldest is None or since < oldest:
        oldest = since
    return _observations(
        updated, observations.last_call, observations.source, observations.source_side, oldest
    )


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
    return _renewed(observations, node, counter, started, observations.last_call)


def observe_renewal(
    observations: Observations,
    state: RendezvousState,
    node: NodeDesc,
    counter: int,
    now: float,
    started: float,
) -> Observations:
    """:func:`observe_read` of a ``state`` this node just wrote, with its own counter
    pair (:func:`heartbeat_of`) moved by the write to ``counter``, then
    :func:`renew_own` from ``started``: in one construction (a join's write)."""
    return _renewed(
        observations, node, counter, started, _last_call_seen(observations.last_call, state, now)
    )


def _renewed(
    observations: Observations,
    node: NodeDesc,
    counter: int,
    started: float,
    last_call: LastCallSighting | None,
) -> Observations:
    seen = observations.heartbeats
    sighting = seen.get(node)
    if sighting is not None and sighting.since > started and sighting.counter == counter:
        started = sighting.since  # already recorded by a later renewal
    updated = seen.set(node, _built(HeartbeatSighting, (counter, started)))
    oldest = observations.oldest
    if oldest is None or (sighting is not None and sighting.since == oldest):
        # (A node that reads no side counters holds its own sighting alone.)
        oldest = started if len(updated) == 1 else _oldest(updated)
    elif started < oldest:
        oldest = started
    return _observations(updated, last_call, observations.source, observations.source_side, oldest)


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
    sighting = observations.heartbeats.get(node)
    return sighting is not None and now - sighting.since >= fence_after(settings)


def lease_expiry(observations: Observations, node: NodeDesc, settings: Settings) -> float | None:
    """The local time from which a peer may declare ``node`` dead (None: no lease)."""
    sighting = observations.heartbeats.get(node)
    return None if sighting is None else sighting.since + settings.liveness_window


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
    return _observations(
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
    peers judge it by their own sightings. Nor a node whose counter in ``state``
    is not the one its sighting watched: it moved after the sighting was taken
    (found by the simulator: a node removed during a partition rejoined, and a
    peer declared it dead again on the sighting of its old entry while it trained).
    """
    window = settings.liveness_window
    oldest = observations.oldest
    if oldest is None or now - oldest <= window:
        return _NOBODY
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
