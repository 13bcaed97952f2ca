"""Sharded state's second copies and the restore plan: where each rank's snapshot
is kept, which step a round restores after a loss and from whom; the sweep over
small jobs finding no broken property, and finding each likely bug planted in the
core's placement or plan."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import pytest
from helpers.examples import examples
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.core import state_sources as core_sources
from rallypoint.core.state_sources import (
    Copy,
    Position,
    RestoreFrom,
    RestorePlan,
    place_copies,
    plan_restore,
)
from rallypoint.spec.check.snapshots import plan_violations, sweep_violations


def test_each_rank_keeps_one_copy_of_a_rank_on_the_next_node() -> None:
    # 3 nodes x 2 ranks: node 0 -> node 1 -> node 2 -> node 0.
    assert place_copies([0, 0, 1, 1, 2, 2]) == (2, 3, 4, 5, 0, 1)
    # Nodes named in any order: the ring follows their sorted names.
    assert place_copies(["b", "a"]) == (1, 0)


def test_a_round_on_one_node_has_no_second_copy() -> None:
    assert place_copies([7, 7, 7]) == (None, None, None)


def test_a_lost_shard_comes_from_its_buddy_and_the_others_roll_back() -> None:
    """FSDP on 2 nodes x 2 ranks, snapshots at step 8, training at step 10: the
    rank of shard 2 is gone; its buddy (rank 0) keeps its copy of step 8. Rank 3
    rolls back from its own snapshot, not from its buddy's copy of it."""
    live = [
        Position(10, True, 0),
        Position(10, True, 1),
        Position(0, False, 2),
        Position(10, True, 3),
    ]
    copies = [Copy(0, 8, 0), Copy(1, 8, 1), Copy(3, 8, 3), Copy(2, 8, 0), Copy(3, 8, 1)]
    plan = plan_restore(4, live, copies)
    assert plan == RestorePlan(
        RestoreFrom.SNAPSHOT, 8, {0: 0, 1: 1, 2: 0, 3: 3}, frozenset({0, 1, 3})
    )


def test_hsdp_heals_from_a_replica_without_rolling_back() -> None:
    """2 replicas x 2 shards: the lost rank's shard lives on in the other replica."""
    live = [
        Position(10, True, 0),
        Position(10, True, 1),
        Position(10, True, 0),
        Position(0, False, 1),
    ]
    plan = plan_restore(2, live, [Copy(1, 8, 0)])
    assert plan == RestorePlan(RestoreFrom.PEERS, 10, {0: 0, 1: 1}, frozenset())


def test_an_unfinished_newer_snapshot_is_passed_over_for_the_older_whole_one() -> None:
    live = [Position(10, True, 0), Position(0, False, 1)]
    copies = [Copy(0, 8, 0), Copy(0, 4, 0), Copy(1, 4, 0)]  # shard 1's copy of 8 never arrived
    plan = plan_restore(2, live, copies)
    assert (plan.source, plan.step, plan.senders) == (RestoreFrom.SNAPSHOT, 4, {0: 0, 1: 0})


def test_a_node_lost_with_its_buddy_falls_back_to_the_disk() -> None:
    plan = plan_restore(2, [Position(10, True, 0), Position(0, False, 1)], [Copy(0, 8, 0)])
    assert plan == RestorePlan(RestoreFrom.DISK, None, {}, frozenset())


def test_the_sweep_of_small_jobs_breaks_no_property() -> None:
    assert sweep_violations(4, 3) == []


holdings = st.integers(1, 4).flatmap(
    lambda shards: st.tuples(
        st.just(shards),
        st.lists(
            st.builds(Position, st.integers(0, 4), st.booleans(), st.integers(0, shards - 1)),
            max_size=6,
        ),
        st.lists(
            st.builds(Copy, st.integers(0, shards - 1), st.integers(0, 4), st.integers(0, 5)),
            max_size=8,
        ),
    )
)


@examples(500)
@given(holdings)
def test_any_holdings_get_a_plan_that_keeps_the_properties(
    case: tuple[int, list[Position], list[Copy]],
) -> None:
    assert plan_violations(*case) == []


def _next_rank(nodes: Sequence[Hashable]) -> tuple[int | None, ...]:
    return tuple((rank + 1) % len(nodes) for rank in range(len(nodes)))


def _newest_anywhere(shards: int, live: Sequence[Position], copies: Iterable[Copy]) -> RestorePlan:
    copies = list(copies)
    step = max(c.step for c in copies) if copies else 0
    return RestorePlan(RestoreFrom.SNAPSHOT, step, {s: 0 for s in range(shards)}, frozenset())


def _disk_unless_live(shards: int, live: Sequence[Position], copies: Iterable[Copy]) -> RestorePlan:
    plan = plan_restore(shards, live, copies)
    if plan.source is RestoreFrom.PEERS:
        return plan
    return RestorePlan(RestoreFrom.DISK, None, {}, frozenset())


def _oldest_whole(shards: int, live: Sequence[Position], copies: Iterable[Copy]) -> RestorePlan:
    copies = list(copies)
    plan = plan_restore(shards, live, [c for c in copies if c.step != max(c.step for c in copies)])
    return plan if plan.source is not RestoreFrom.DISK else plan_restore(shards, live, copies)


@pytest.mark.parametrize(
    ("name", "planted", "broken"),
    [
        ("place_copies", _next_rank, "both copies of rank"),
        ("plan_restore", _newest_anywhere, "a round starts from a step some shard has no copy at"),
        ("plan_restore", _disk_unless_live, "the disk while every shard has a copy"),
        ("plan_restore", _oldest_whole, "step 8 has every shard, but 4 is restored"),
    ],
    ids=["buddy beside it", "newest snapshot anywhere", "disk too soon", "an older whole step"],
)
def test_a_planted_bug_is_found(
    monkeypatch: pytest.MonkeyPatch, name: str, planted: object, broken: str
) -> None:
    monkeypatch.setattr(core_sources, name, planted)
    found = sweep_violations(3, 2)
    assert any(broken in line for line in found), found[:3]
