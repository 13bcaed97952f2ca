"""Resharding plans: which pieces of each tensor move from which rank to which when
a sharded job's mesh changes."""

from __future__ import annotations

import pytest

from rallypoint.core.reshard import Box, Piece, ReshardError, plan_reshard
from rallypoint.core.state_sources import Position, reshard_from


def rows(start: int, count: int, width: int = 2) -> Box:
    return Box((start, 0), (count, width))


def test_four_shards_of_rows_become_two() -> None:
    """FSDP over 4 ranks -> 2: rank 0 keeps its rows and takes rank 1's, rank 1
    takes ranks 2's and 3's (it held rows 2-3, none of which it needs now)."""
    held = {r: {"w": [rows(2 * r, 2)]} for r in range(4)}
    needed = {0: {"w": rows(0, 4)}, 1: {"w": rows(4, 4)}}
    assert plan_reshard({"w": (8, 2)}, held, needed) == (
        Piece(0, "w", rows(0, 2), 0),
        Piece(0, "w", rows(2, 2), 1),
        Piece(1, "w", rows(4, 2), 2),
        Piece(1, "w", rows(6, 2), 3),
    )


def test_two_shards_become_three_uneven_ones() -> None:
    held = {0: {"w": [rows(0, 4)]}, 1: {"w": [rows(4, 3)]}}
    needed = {0: {"w": rows(0, 3)}, 1: {"w": rows(3, 3)}, 2: {"w": rows(6, 1)}}
    assert plan_reshard({"w": (7, 2)}, held, needed) == (
        Piece(0, "w", rows(0, 3), 0),
        Piece(1, "w", rows(3, 1), 0),
        Piece(1, "w", rows(4, 2), 1),
        Piece(2, "w", rows(6, 1), 1),
    )


def test_a_replicated_box_comes_from_the_rank_itself_or_the_lowest_holder() -> None:
    held = {0: {"b": [Box((0,), (4,))]}, 2: {"b": [Box((0,), (4,))]}}
    needed = {1: {"b": Box((0,), (2,))}, 2: {"b": Box((2,), (2,))}}
    assert plan_reshard({"b": (4,)}, held, needed) == (
        Piece(1, "b", Box((0,), (2,)), 0),
        Piece(2, "b", Box((2,), (2,)), 2),
    )


def test_a_rank_sends_its_own_shard_and_the_snapshot_it_keeps_of_another() -> None:
    held = {0: {"w": [rows(0, 2), rows(2, 2)]}}
    assert plan_reshard({"w": (4, 2)}, held, {0: {"w": rows(0, 4)}}) == (
        Piece(0, "w", rows(0, 2), 0),
        Piece(0, "w", rows(2, 2), 0),
    )


def test_empty_shards_and_empty_tensors_need_no_piece() -> None:
    held = {0: {"w": [rows(0, 2)], "e": [Box((0,), (0,))]}, 1: {"w": [rows(2, 0)]}}
    needed = {0: {"w": rows(0, 2), "e": Box((0,), (0,))}, 1: {"w": rows(2, 0)}}
    assert plan_reshard({"w": (2, 2), "e": (0,)}, held, needed) == (Piece(0, "w", rows(0, 2), 0),)


@pytest.mark.parametrize(
    ("held", "needed", "message"),
    [
        ({0: {"w": [rows(0, 2)]}}, {0: {"w": rows(0, 4)}}, "cover 4 of its 8 elements"),
        ({0: {"w": [rows(0, 3)]}, 1: {"w": [rows(2, 2)]}}, {0: {"w": rows(0, 4)}}, "overlap"),
        ({0: {"w": [rows(0, 4)]}}, {0: {"w": rows(2, 4)}}, "outside its shape"),
        ({0: {"w": [rows(0, 4)], "x": [rows(0, 1)]}}, {}, "the new layout lacks"),
        ({0: {"w": [rows(0, 4)]}}, {0: {"y": rows(0, 1)}}, "no rank holds"),
    ],
)
def test_plans_that_cannot_be_made_are_refused(
    held: dict[int, dict[str, list[Box]]], needed: dict[int, dict[str, Box]], message: str
) -> None:
    with pytest.raises(ReshardError, match=message):
        plan_reshard({"w": (4, 2)}, held, needed)


def test_a_round_reshards_from_the_front_runners_layout() -> None:
    # Survivors of a 4-shard round (layout 7) in a 2-shard round (layout 9); rank 2 is new.
    positions = [
        Position(10, True, 0, 0, layout=7, count=4),
        Position(10, True, 3, 1, layout=7, count=4),
        Position(0, False, 0, 0, layout=9, count=2),
    ]
    old = reshard_from(positions, 9)
    assert old is not None
    assert [(p.holds, p.shard, p.layout) for p in old] == [
        (True, 0, 7),
        (True, 3, 7),
        (False, 0, 7),
    ]
    # Nothing to reshard: nobody holds, or the front-runner holds the round's layout.
    assert reshard_from([Position(0, False)], 9) is None
    assert reshard_from([Position(3, True, layout=9), Position(2, True, layout=7)], 9) is None
