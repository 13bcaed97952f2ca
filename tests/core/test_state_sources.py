"""Where a live round's ranks get their state: the plan every rank computes alone
from the gathered positions."""

from __future__ import annotations

from helpers.examples import examples
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.core.state_sources import Position, plan_sync

positions = st.lists(
    st.builds(
        Position, st.integers(0, 6), st.booleans(), st.integers(0, 2), st.none() | st.integers(0, 2)
    ),
    min_size=1,
    max_size=8,
)


@examples(500)
@given(positions)
def test_each_shard_comes_from_the_lowest_rank_at_its_newest_step(ranks: list[Position]) -> None:
    plan = plan_sync(ranks)
    assert plan.restore == (not any(p.holds for p in ranks))
    if plan.restore:
        return
    newest = {p.shard: max(q.step for q in ranks if q.holds and q.shard == p.shard)
              for p in ranks if p.holds}  # fmt: skip
    for shard, source in plan.sources.items():
        holders = [r for r, p in enumerate(ranks) if p.holds and p.shard == shard]
        assert ranks[source].holds and ranks[source].shard == shard
        assert source == min(r for r in holders if ranks[r].step == newest[shard])
        assert source not in plan.receivers[shard]
    for rank, p in enumerate(ranks):
        current = p.holds and p.shard == p.needs and p.step == newest[p.shard]
        receives = [shard for shard, group in plan.receivers.items() if rank in group]
        expected = [] if current or p.needs not in newest else [p.needs]
        assert receives == expected, (rank, plan)
    needed = {p.needs for p in ranks}
    assert plan.missing == needed - set(newest)
    assert plan.uneven == (len({newest[s] for s in needed if s in newest}) > 1)
    if plan.from_peers:
        assert plan.step == max(newest[s] for s in needed)


def test_a_rank_whose_place_moved_takes_the_shard_it_needs() -> None:
    """HSDP shrunk to one replica: the survivors hold shards 1 and 0 and need 0 and 1."""
    ranks = [Position(6, True, 1, wants=0), Position(6, True, 0, wants=1)]
    plan = plan_sync(ranks)
    assert plan.sources == {0: 1, 1: 0}
    assert plan.receivers == {0: frozenset({0}), 1: frozenset({1})}
    assert plan.from_peers and plan.step == 6


def test_data_parallel_ranks_take_the_front_runners_state() -> None:
    """A fresh replacement and a rank one step behind both receive from the lowest
    rank at the newest step."""
    ranks = [Position(7, True), Position(8, True), Position(0, False), Position(8, True)]
    plan = plan_sync(ranks)
    assert plan.sources == {0: 1} and plan.receivers == {0: frozenset({0, 2})}
    assert plan.step == 8 and plan.from_peers


def test_ranks_at_the_same_step_need_nothing() -> None:
    plan = plan_sync([Position(5, True), Position(5, True)])
    assert plan.sources == {} and plan.step == 5 and plan.from_peers


def test_a_shard_nobody_holds_cannot_come_from_a_peer() -> None:
    """HSDP, 2 replicas x 2 shards: both holders of shard 1 were lost."""
    lost = Position(0, False, 1)
    ranks = [Position(4, True, 0), lost, Position(4, True, 0), lost]
    plan = plan_sync(ranks)
    assert plan.missing == {1} and not plan.from_peers


def test_shards_at_different_steps_make_no_consistent_state() -> None:
    ranks = [Position(4, True, 0), Position(3, True, 1)]
    plan = plan_sync(ranks)
    assert plan.uneven and plan.step is None and not plan.from_peers
