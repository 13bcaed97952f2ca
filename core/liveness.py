"""Liveness: what time does to the shared state, as seen by one node.

Heartbeats are counters, never clock values (DESIGN.md decision 2). Each node
records, on its own monotonic clock, when it first saw each counter value
(:func:`observe`); a node whose counter this observer has not seen move for the
liveness window is dead to it (:func:`dead_nodes`), and :func:`sanitize` removes
the dead from the state before a decision.

The heartbeat merge rule lives here too. A backend keeps two counters per node:
the one in the state blob (bumped by the core's own join actions, rewritten with
the blob) and a *side* counter under the node's own key (bumped by a keep-alive
without rewriting the O(n) blob). The core decides on one counter per node,
``blob << 32 | side`` (:func:`merge_heartbeats`): it moves whenever either part
moves. :func:`split_heartbeats` maps a state the core derived back to the blob to
store.
"""

from __future__ import annotations

import operator
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
    "merge_heartbeats",
    "observe",
    "sanitize",
    "split_heartbeats",
]

_SINCE = operator.itemgetter(1)  # HeartbeatSighting.since, read in C

#: Bits of the merged counter that hold the backend (side) counter.
SIDE_BITS = 32
_SIDE_MASK = (1 << SIDE_BITS) - 1


def merge_heartbeats(blob: RendezvousState, side: Mapping[NodeDesc, int]) -> RendezvousState:
    """The state the core decides on: each member's counter is ``blob << 32 | side``.

    The merged ``heartbeat_seq`` lies above every merged counter of the blob's
    sequence, so a counter the core hands out to a new entry is new in both parts.
    """
    merged = {
        node: (counter << SIDE_BITS) | (side.get(node, 0) & _SIDE_MASK)
        for node, counter in blob.heartbeats.items()
    }
    return blob.evolve(
        heartbeats=Map(merged), heartbeat_seq=(blob.heartbeat_seq << SIDE_BITS) | _SIDE_MASK
    )


def split_heartbeats(
    new: RendezvousState, base_merged: RendezvousState, base_blob: RendezvousState
) -> RendezvousState:
    """The blob to store for ``new``, a state the core derived from ``base_merged``
    (which :func:`merge_heartbeats` made from ``base_blob``).

    A member whose merged counter the core left alone keeps its blob counter; one
    whose counter the core changed (a join action's heartbeat, a new entry) gets a
    blob counter above every one handed out before (``heartbeat_seq + 1``), so it
    moves, and an entry that comes back after a removal never repeats a value an
    observer may still hold.
    """
    bumped = base_blob.heartbeat_seq + 1
    counters = {}
    any_bumped = False
    for node, counter in new.heartbeats.items():
        if base_merged.heartbeats.get(node) == counter and node in base_blob.heartbeats:
            counters[node] = base_blob.heartbeats[node]
        else:
            counters[node] = bumped
            any_bumped = True
    return new.evolve(
        heartbeats=Map(counters),
        heartbeat_seq=bumped if any_bumped else base_blob.heartbeat_seq,
    )


def observe(observations: Observations, state: RendezvousState, now: float) -> Observations:
    """Record what a freshly read (or written) ``state`` shows, at local time ``now``.

    A heartbeat counter that differs from the last value seen (or is new) restarts
    its node's liveness timer; nodes no longer in the state are forgotten. A newly
    armed last call starts this node's last-call timer.
    """
    seen = observations.heartbeats
    updated = seen
    counters = state.heartbeats
    source = observations.source
    items = observations.source_items
    oldest = observations.oldest
    if source is not counters and source != counters:
        items = frozenset(counters.items())
        if source is None:  # sightings not made by observe(): compare counter by counter
            changed = frozenset((n, c) for n, c in items if n not in seen or seen[n].counter != c)
        else:
            changed = items - observations.source_items
        if changed or len(seen) != len(counters):
            with seen.mutate() as mutable:
                for node, counter in changed:
                    mutable[node] = HeartbeatSighting(counter, now)
                if len(mutable) != len(counters):  # some nodes left the state
                    for node in seen:
                        if node not in counters:
                            del mutable[node]
                updated = mutable.finish()
        if updated is not seen:
            oldest = min(map(_SINCE, updated.values()), default=None)

    last_call = observations.last_call
    if state.last_call is None:
        last_call = None
    elif last_call is None or (last_call.round, last_call.arming) != (
        state.round,
        state.last_call,
    ):
        last_call = LastCallSighting(state.round, state.last_call, now)

    if updated is seen and last_call is observations.last_call and source is counters:
        return observations
    return Observations(
        heartbeats=updated, last_call=last_call, source=counters, source_items=items, oldest=oldest
    )


def dead_nodes(
    state: RendezvousState, observations: Observations, settings: Settings, now: float
) -> frozenset[NodeDesc]:
    """Nodes whose heartbeat counter this observer has not seen move for the
    liveness window (``keep_alive_interval * keep_alive_max_attempt``)."""
    window = settings.liveness_window
    oldest = observations.oldest
    if oldest is None or now - oldest <= window:
        return frozenset()
    return frozenset(
        node
        for node in state.heartbeats
        if (sighting := observations.heartbeats.get(node)) is not None
        and now - sighting.since > window
    )


def sanitize(
    state: RendezvousState, observations: Observations, settings: Settings, now: float
) -> tuple[RendezvousState, frozenset[NodeDesc]]:
    """Remove the nodes this observer considers dead; return the new state and them.

    Call :func:`observe` first, so that every node has a sighting: a node never seen
    is never declared dead.
    """
    dead = dead_nodes(state, observations, settings, now)
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
