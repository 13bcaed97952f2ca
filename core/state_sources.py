"""Where each rank's training state comes from when a live round starts.

When a round's process group has formed, its ranks compare their *positions*: the
steps each committed, whether it holds the job's state at all (a fresh worker does
not, even at step 0), and which part of the state it holds, its *shard*. In
data-parallel training every rank holds the whole state: one shard, 0. In a sharded
job the ranks that hold the same part (the same coordinate along the shard
dimension of an HSDP mesh, one per replica) share a shard number.

:func:`plan_sync` turns every rank's position into the round's plan. Each rank
computes it alone from the same gathered positions, so they all agree without
another message:

* nobody holds anything: the whole job starts, and each rank restores its
  checkpoint (then the ranks compare again);
* otherwise, per shard, the lowest rank holding the shard at its highest step is
  the source, and every rank that needs that shard and is behind (or holds
  nothing, or holds another shard: its place in the mesh moved) receives from it;
* a shard that no rank holds any more cannot come from a peer (:attr:`SyncPlan.missing`);
  shards whose sources are at different steps cannot make one consistent state
  either (:attr:`SyncPlan.uneven`): either needs an older copy (a snapshot, a
  checkpoint) that every shard has.

Sharded state whose shard has no live copy any more (FSDP without replicas: the
rank that held it is gone) comes from a **snapshot**: every few steps each rank
keeps a copy of its shard in its host memory and sends one to its *buddy*, a rank
on another node (:func:`place_copies`, once per round), so that losing one node
never loses a shard. After a loss, :func:`plan_restore` picks the newest step at
which every shard has a copy among the ranks that are left, live or snapshot
(every rank ahead of it rolls back), or, when no step is whole, the checkpoint on
disk.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Copy",
    "Position",
    "RestoreFrom",
    "RestorePlan",
    "SyncPlan",
    "place_copies",
    "plan_restore",
    "plan_sync",
    "reshard_from",
]


@dataclass(frozen=True)
class Position:
    """One rank's account of its state when a round starts.

    Attributes:
        step: the steps it has committed.
        holds: it holds the job's state (restored it, received it or trained).
        shard: the part of the state it holds (0 for data-parallel training).
        wants: the part it needs in this round's layout (None: ``shard``; a rank
            whose place in the mesh moved holds one shard and needs another).
        layout: names the layout of the state it holds (the mesh it was trained
            in); :func:`plan_sync` compares only positions of the round's layout.
        count: how many shards that layout has.
    """

    step: int
    holds: bool
    shard: int = 0
    wants: int | None = None
    layout: int = 0
    count: int = 1

    @property
    def needs(self) -> int:
        """The shard this rank must hold before the round's first step."""
        return self.shard if self.wants is None else self.wants


@dataclass(frozen=True)
class SyncPlan:
    """What a round does with its ranks' states before its first step.

    Attributes:
        restore: nobody holds the state: every rank restores its checkpoint, and the
            ranks compare their positions again.
        sources: shard -> the rank that sends it (only shards some rank is behind in).
        receivers: shard -> the ranks that load what its source sends.
        step: the step of the state every rank is at once the plan is carried out
            (None with ``restore``, or when the shards cannot agree).
        missing: shards some rank needs and no rank holds.
        uneven: the newest copies of the shards needed are at different steps.
    """

    restore: bool
    sources: Mapping[int, int]
    receivers: Mapping[int, frozenset[int]]
    step: int | None
    missing: frozenset[int]
    uneven: bool

    @property
    def from_peers(self) -> bool:
        """Whether peers alone can bring every rank to one state."""
        return not self.restore and not self.missing and not self.uneven


def plan_sync(positions: Sequence[Position]) -> SyncPlan:
    """The round's plan from every rank's position, by rank (see the module)."""
    if not any(p.holds for p in positions):
        return SyncPlan(True, {}, {}, None, frozenset(), False)
    best: dict[int, int] = {}
    source: dict[int, int] = {}
    for rank, p in enumerate(positions):
        if p.holds and p.step > best.get(p.shard, -1):
            best[p.shard], source[p.shard] = p.step, rank
    behind: dict[int, set[int]] = {}
    for rank, p in enumerate(positions):
        current = p.holds and p.shard == p.needs and p.step == best[p.shard]
        if not current:
            behind.setdefault(p.needs, set()).add(rank)
    needed = {p.needs for p in positions}
    missing = frozenset(shard for shard in needed if shard not in best)
    steps = {best[shard] for shard in needed if shard in best}
    uneven = len(steps) > 1
    return SyncPlan(
        restore=False,
        sources={shard: source[shard] for shard in behind if shard in source},
        receivers={shard: frozenset(ranks) for shard, ranks in behind.items() if shard in source},
        step=None if missing or uneven else steps.pop(),
        missing=missing,
        uneven=uneven,
    )


def reshard_from(positions: Sequence[Position], layout: int) -> tuple[Position, ...] | None:
    """When the round's state must be resharded: the ranks' positions in the layout
    the state is held in (only ranks of that layout hold it), or None when it need
    not be (nobody holds the state, or the front-runner holds it in ``layout``, the
    round's own: :func:`plan_sync` then applies to the ranks of that layout).

    The front-runner is the rank holding the state at the highest step (the lowest
    rank among equals); its layout is the one every other rank's boxes come from
    (:mod:`rallypoint.core.reshard`).
    """
    holders = [(p.step, -rank) for rank, p in enumerate(positions) if p.holds]
    if not holders:
        return None
    front = positions[-max(holders)[1]]
    if front.layout == layout:
        return None
    return tuple(
        Position(p.step, p.holds and p.layout == front.layout, p.shard, None, front.layout, p.count)
        for p in positions
    )


# ------------------------------------------------------------ snapshots and buddies


def place_copies(nodes: Sequence[Hashable]) -> tuple[int | None, ...]:
    """Where each rank's snapshot keeps its second copy: by rank, the buddy rank (on
    another node), or None for every rank when the round runs on one node.

    ``nodes[rank]`` names the node that runs the rank (any sortable id, such as the
    agent's group rank). The nodes, in sorted order, form a ring: the ``j``-th rank of
    a node sends its copy to the ``j``-th rank (cyclically) of the next node, so with
    as many ranks on every node each rank keeps exactly one copy of another's.
    """
    by_node: dict[Hashable, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    ring = sorted(by_node)  # type: ignore[type-var]
    buddies: list[int | None] = [None] * len(nodes)
    if len(ring) < 2:
        return tuple(buddies)
    for index, node in enumerate(ring):
        after = by_node[ring[(index + 1) % len(ring)]]
        for j, rank in enumerate(by_node[node]):
            buddies[rank] = after[j % len(after)]
    return tuple(buddies)


@dataclass(frozen=True)
class Copy:
    """A whole snapshot of one shard, kept in a rank's host memory.

    Attributes:
        shard: whose shard (its number in the snapshot's layout).
        step: the step it was taken at.
        holder: the rank (of the round being planned) that keeps it.
    """

    shard: int
    step: int
    holder: int


class RestoreFrom(enum.Enum):
    """Where a round's state comes from when peers' live state is not enough."""

    #: every shard has a live copy at the newest step: no rank rolls back
    PEERS = "peers"
    #: the newest step with a copy of every shard, some of them snapshots: the ranks
    #: ahead of it roll back
    SNAPSHOT = "snapshot"
    #: no step has a copy of every shard among the ranks left: the disk checkpoint
    DISK = "disk"


@dataclass(frozen=True)
class RestorePlan:
    """What a round restores, and from whom.

    Attributes:
        source: peers, a snapshot, or the disk (:class:`RestoreFrom`).
        step: the step every rank is at once the plan is carried out (None: disk).
        senders: shard -> the rank that sends its copy at ``step`` (a live copy
            first, then a snapshot a rank of that shard keeps, then any; among
            equals the lowest rank).
        rolls_back: the ranks whose live state is ahead of ``step`` and is dropped.
    """

    source: RestoreFrom
    step: int | None
    senders: Mapping[int, int]
    rolls_back: frozenset[int]


def plan_restore(shards: int, live: Sequence[Position], copies: Iterable[Copy]) -> RestorePlan:
    """The round's restore plan (see the module).

    Args:
        shards: how many shards the layout has (0..shards-1 must all be restored).
        live: every rank's live position, by rank (``shard`` in the same layout).
        copies: the whole snapshots the ranks keep.
    """
    # step -> shard -> (preference, holder): live state first, then a snapshot kept
    # by a rank of that shard (it loads its own copy: nothing crosses the network),
    # then any snapshot; among equals the lowest rank.
    held: dict[int, dict[int, list[tuple[int, int]]]] = {}
    for rank, p in enumerate(live):
        if p.holds:
            held.setdefault(p.step, {}).setdefault(p.shard, []).append((0, rank))
    for copy in copies:
        own = copy.holder < len(live) and live[copy.holder].shard == copy.shard
        preference = 1 if own else 2
        held.setdefault(copy.step, {}).setdefault(copy.shard, []).append((preference, copy.holder))
    whole = [step for step, by_shard in held.items() if all(s in by_shard for s in range(shards))]
    if not whole:
        return RestorePlan(RestoreFrom.DISK, None, {}, frozenset())
    step = max(whole)
    chosen = {shard: min(held[step][shard]) for shard in range(shards)}
    ahead = frozenset(rank for rank, p in enumerate(live) if p.holds and p.step > step)
    from_snapshot = ahead or any(kind for kind, _ in chosen.values())
    return RestorePlan(
        RestoreFrom.SNAPSHOT if from_snapshot else RestoreFrom.PEERS,
        step,
        {shard: holder for shard, (_, holder) in chosen.items()},
        ahead,
    )
