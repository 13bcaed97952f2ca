"""Resharding plans checked over every pair of small FSDP, HSDP and 2-D layouts: no
broken property, and each likely bug planted in the core's planner named."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from rallypoint.core import reshard as core_reshard
from rallypoint.core.reshard import Box, Piece
from rallypoint.spec.check.reshard import Layout, sweep_violations


def test_the_layouts_split_tensors_as_torch_chunk_does() -> None:
    fsdp = Layout((3,), (0,))
    assert [fsdp.box((7, 3), r) for r in range(3)] == [
        Box((0, 0), (3, 3)), Box((3, 0), (3, 3)), Box((6, 0), (1, 3))
    ]  # fmt: skip
    hsdp = Layout((2, 2), (None, 0))
    assert hsdp.box((5,), 1) == hsdp.box((5,), 3) == Box((3,), (2,))
    assert Layout((4,), (0,)).box((2,), 3) == Box((2,), (0,))


def test_the_sweep_breaks_no_property() -> None:
    assert sweep_violations() == []


def _from_the_lowest_holder(plan: Callable[..., tuple[Piece, ...]]) -> Any:
    """Ignores that the target holds a box itself: state crosses the network."""

    def planted(shapes: Any, held: Any, needed: Any) -> tuple[Piece, ...]:
        pieces = plan(shapes, held, needed)
        lowest = {
            (name, box): min(
                r for r, t in held.items() for b in t.get(name, ()) if b.intersection(box) == box
            )
            for name, box in {(p.tensor, p.box) for p in pieces}
        }
        return tuple(Piece(p.target, p.tensor, p.box, lowest[(p.tensor, p.box)]) for p in pieces)

    return planted


def _first_piece_dropped(plan: Callable[..., tuple[Piece, ...]]) -> Any:
    def planted(shapes: Any, held: Any, needed: Any) -> tuple[Piece, ...]:
        return plan(shapes, held, needed)[1:]

    return planted


def _in_gathering_order(plan: Callable[..., tuple[Piece, ...]]) -> Any:
    """Breaks ties by the order the boxes came in, not by rank."""

    def planted(shapes: Any, held: Any, needed: Any) -> tuple[Piece, ...]:
        first = next(iter(held))
        return tuple(
            Piece(p.target, p.tensor, p.box, first)
            if p.source != p.target and any(b == p.box for b in held[first].get(p.tensor, ()))
            else p
            for p in plan(shapes, held, needed)
        )

    return planted


def _no_tiling_check(plan: Callable[..., tuple[Piece, ...]]) -> Any:
    def planted(shapes: Any, held: Any, needed: Any) -> tuple[Piece, ...]:
        saved = core_reshard._check_tiling
        core_reshard._check_tiling = lambda *args: None  # type: ignore[assignment]
        try:
            return plan(shapes, held, needed)
        finally:
            core_reshard._check_tiling = saved

    return planted


@pytest.mark.parametrize(
    ("bug", "named"),
    [
        (_from_the_lowest_holder, "crosses the network"),
        (_first_piece_dropped, "gets"),
        (_in_gathering_order, "order the boxes were gathered in"),
        (_no_tiling_check, "planned with a hole"),
    ],
)
def test_each_planted_bug_is_named(
    monkeypatch: pytest.MonkeyPatch, bug: Callable[..., Any], named: str
) -> None:
    monkeypatch.setattr(core_reshard, "plan_reshard", bug(core_reshard.plan_reshard))
    violations = sweep_violations(4)
    assert violations and any(named in v for v in violations), violations[:3]
