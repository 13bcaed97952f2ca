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
  the source, and every rank of that shard that is behind (or holds nothing)
  receives from it;
* a shard that no rank holds any more cannot come from a peer (:attr:`SyncPlan.missing`);
  shards whose sources are at different steps cannot make one consistent state
  either (:attr:`SyncPlan.uneven`): either needs an older copy (a snapshot, a
  checkpoint) that every shard has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Position", "SyncPlan", "plan_sync"]


@dataclass(frozen=True)
class Position:
    """One rank's account of its state when a round starts.

    Attributes:
        step: the steps it has committed.
        holds: it holds the job's state (restored it, received it or trained).
        shard: the part of the state it holds (0 for data-parallel training).
    """

    step: int
    holds: bool
    shard: int = 0


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
        uneven: the shards' newest copies are at different steps.
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
        if not p.holds or p.step < best.get(p.shard, -1):
            behind.setdefault(p.shard, set()).add(rank)
    missing = frozenset(shard for shard in behind if shard not in best)
    steps = set(best.values())
    uneven = len(steps) > 1
    return SyncPlan(
        restore=False,
        sources={shard: source[shard] for shard in behind if shard in source},
        receivers={shard: frozenset(ranks) for shard, ranks in behind.items() if shard in source},
        step=None if missing or uneven else steps.pop(),
        missing=missing,
        uneven=uneven,
    )
