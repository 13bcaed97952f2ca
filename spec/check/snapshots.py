"""Sharded state's copies and the restore plan (:mod:`rallypoint.core.state_sources`), checked.

A sharded job keeps a snapshot of each rank's shard on the rank itself and on a
buddy (:func:`~rallypoint.core.state_sources.place_copies`); after a loss the round
restores the newest step that the ranks left hold whole
(:func:`~rallypoint.core.state_sources.plan_restore`). Both see small inputs, so
this module sweeps them for small clusters and judges every answer against the
properties they exist for (docs/design.md, decision 14):

* **copies on two nodes**: when a round runs on two nodes or more, every rank's
  buddy runs on another node, and no rank keeps many more copies than the others;
* **no round starts from a step some rank cannot restore**: every shard's sender
  holds that shard at the plan's step;
* **no progress thrown away**: no step newer than the plan's has a copy of every
  shard, and exactly the ranks ahead of it roll back;
* **no shard is lost while a copy lives**: the disk is read only when no step has
  a copy of every shard; in a job whose snapshots reached their buddies, losing
  any one node never sends it to the disk.

The core's functions are looked up at call time, so a test can plant a variant and
see it named.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ...core import state_sources as core_sources
from ...core.state_sources import Copy, Position, RestoreFrom

__all__ = ["Scenario", "placement_violations", "plan_violations", "scenarios", "sweep_violations"]

#: The steps a swept job's snapshots and live states are at.
OLDER, NEWER, NOW = 4, 8, 10


def placement_violations(nodes: Sequence[int]) -> list[str]:
    """What is wrong with the placement of copies for a round whose ``nodes[rank]``
    runs each rank (empty: nothing)."""
    buddies = core_sources.place_copies(nodes)
    found = []
    if len(buddies) != len(nodes):
        return [f"{nodes}: {len(buddies)} buddies for {len(nodes)} ranks"]
    several = len(set(nodes)) > 1
    for rank, buddy in enumerate(buddies):
        if not several:
            if buddy is not None:
                found.append(f"{nodes}: rank {rank} has a buddy on a one-node round")
        elif buddy is None or not 0 <= buddy < len(nodes):
            found.append(f"{nodes}: rank {rank} has no buddy on another node ({buddy})")
        elif nodes[buddy] == nodes[rank]:
            found.append(f"{nodes}: both copies of rank {rank}'s shard on node {nodes[rank]}")
    if several and not found:
        counts = [nodes.count(node) for node in set(nodes)]
        fair = math.ceil(max(counts) / min(counts))
        load = max(list(buddies).count(rank) for rank in range(len(nodes)))
        if load > fair:
            found.append(f"{nodes}: a rank keeps {load} copies (at most {fair} needed)")
    return found


def _whole_steps(shards: int, live: Sequence[Position], copies: Sequence[Copy]) -> set[int]:
    """The properties' own reading: the steps at which every shard has a copy."""
    kept = {(p.shard, p.step) for p in live if p.holds} | {(c.shard, c.step) for c in copies}
    return {step for _, step in kept if all((s, step) in kept for s in range(shards))}


def plan_violations(shards: int, live: Sequence[Position], copies: Sequence[Copy]) -> list[str]:
    """What is wrong with the core's restore plan for these holdings (empty: nothing)."""
    plan = core_sources.plan_restore(shards, live, copies)
    whole = _whole_steps(shards, live, copies)
    case = f"{shards} shards, live {list(live)}, copies {list(copies)}: {plan}"
    if plan.source is RestoreFrom.DISK:
        return (
            [f"the disk while every shard has a copy at step {max(whole)}: {case}"] if whole else []
        )
    if plan.step is None or plan.step not in whole:
        return [f"a round starts from a step some shard has no copy at: {case}"]
    found = []
    for shard in range(shards):
        sender = plan.senders.get(shard)
        has_it = sender is not None and (
            (0 <= sender < len(live) and live[sender].holds
             and (live[sender].shard, live[sender].step) == (shard, plan.step))
            or Copy(shard, plan.step, sender) in copies
        )  # fmt: skip
        if not has_it:
            found.append(f"shard {shard}'s sender {sender} does not hold it: {case}")
    if max(whole) > plan.step:
        found.append(f"step {max(whole)} has every shard, but {plan.step} is restored: {case}")
    ahead = {rank for rank, p in enumerate(live) if p.holds and p.step > plan.step}
    if set(plan.rolls_back) != ahead:
        found.append(f"the ranks rolling back are {set(plan.rolls_back)}, not {ahead}: {case}")
    return found


@dataclass(frozen=True)
class Scenario:
    """A sharded job (one shard per rank) that snapshotted at :data:`OLDER` (every
    copy reached its buddy) and at :data:`NEWER` (the ranks in ``sent`` finished
    sending theirs), trained on to :data:`NOW`, and lost the nodes in ``lost``."""

    nodes: tuple[int, ...]
    sent: frozenset[int]
    lost: frozenset[int]

    def holdings(self) -> tuple[list[Position], list[Copy]]:
        """What the ranks left hold: their live shards and the snapshots they keep
        (holders keep their ranks of the lost round: the layout is the old one)."""
        buddies = core_sources.place_copies(self.nodes)
        alive = [node not in self.lost for node in self.nodes]
        live = [Position(NOW, ok, rank) for rank, ok in enumerate(alive)]
        copies = []
        for rank, buddy in enumerate(buddies):
            for step in (OLDER, NEWER):
                if alive[rank]:
                    copies.append(Copy(rank, step, rank))
                if buddy is not None and alive[buddy] and (step == OLDER or rank in self.sent):
                    copies.append(Copy(rank, step, buddy))
        return live, copies


def scenarios(max_nodes: int, max_local: int) -> Iterator[Scenario]:
    """Every job of up to ``max_nodes`` nodes with 1..``max_local`` ranks each, the
    newer snapshot sent by none, half or all of the ranks, and every set of lost nodes."""
    for count in range(1, max_nodes + 1):
        for sizes in itertools.product(range(1, max_local + 1), repeat=count):
            nodes = tuple(node for node, size in enumerate(sizes) for _ in range(size))
            ranks = len(nodes)
            for sent in (frozenset(), frozenset(range(ranks // 2)), frozenset(range(ranks))):
                for lost_count in range(count + 1):
                    for lost in itertools.combinations(range(count), lost_count):
                        yield Scenario(nodes, sent, frozenset(lost))


def sweep_violations(max_nodes: int = 4, max_local: int = 3) -> list[str]:
    """Every broken property over :func:`scenarios` (module docstring): the placement
    of each job, the plan after each loss, and no trip to the disk after one node's
    loss."""
    found: list[str] = []
    placed: set[tuple[int, ...]] = set()
    for scenario in scenarios(max_nodes, max_local):
        if scenario.nodes not in placed:
            placed.add(scenario.nodes)
            found += placement_violations(scenario.nodes)
        live, copies = scenario.holdings()
        shards = len(scenario.nodes)
        found += plan_violations(shards, live, copies)
        several = len(set(scenario.nodes)) > 1
        if several and len(scenario.lost) == 1:
            plan = core_sources.plan_restore(shards, live, copies)
            if plan.source is RestoreFrom.DISK:
                found.append(f"one node's loss sends the job to the disk: {scenario}")
    return found
