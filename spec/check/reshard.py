"""Resharding plans (:mod:`rallypoint.core.reshard`), checked over small meshes.

When a sharded job's mesh changes, every rank needs other boxes of every tensor
than the ones held; :func:`~rallypoint.core.reshard.plan_reshard` says which pieces
move where. This module builds the boxes of the layouts FSDP2, HSDP and tensor
parallelism produce (a tensor's dimension split over a mesh dimension the way
``torch.chunk`` splits it: equal chunks, the last ones shorter or empty; a
replicated mesh dimension holds the same box on each of its ranks), on its own,
without torch, and judges every plan between two of them against the properties
resharding exists for:

* **each rank gets exactly what it needs**: the pieces of a (rank, tensor) do not
  overlap, lie inside the box it needs and cover all of it;
* **nothing comes from a rank that lacks it**: every piece lies inside a box its
  source holds;
* **nothing crosses the network that was here**: a rank that holds a piece's box
  sends it to itself;
* **every rank computes the same plan**: the plan does not depend on the order the
  boxes were gathered in;
* **a hole is refused, not filled with garbage**: with one shard's boxes missing,
  planning fails (:class:`~rallypoint.core.reshard.ReshardError`).

The core's function is looked up at call time, so a test can plant a variant and
see it named.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ...core import reshard as core_reshard
from ...core.reshard import Box, Piece, ReshardError

__all__ = ["Layout", "layouts", "plan_violations", "sweep_violations"]

#: The tensors every swept layout holds: a vector, a matrix and one of uneven sizes.
SHAPES: dict[str, tuple[int, ...]] = {"bias": (5,), "weight": (6, 4), "odd": (7, 3)}


@dataclass(frozen=True)
class Layout:
    """A mesh and how it splits the tensors: ``mesh`` is the mesh's shape, and
    ``splits[d]`` the tensor dimension mesh dimension ``d`` splits (None: replicated)."""

    mesh: tuple[int, ...]
    splits: tuple[int | None, ...]

    @property
    def world(self) -> int:
        return _volume(self.mesh)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The rank's place in the mesh (row-major, as a device mesh numbers ranks)."""
        place = []
        for n in reversed(self.mesh):
            place.append(rank % n)
            rank //= n
        return tuple(reversed(place))

    def box(self, shape: Sequence[int], rank: int) -> Box:
        """The box of a tensor of ``shape`` that ``rank`` holds."""
        offsets, sizes = [0] * len(shape), list(shape)
        for dim, (n, split) in enumerate(zip(self.mesh, self.splits, strict=True)):
            if split is None or split >= len(shape):
                continue
            chunk = -(-sizes[split] // n)  # torch.chunk: ceil, the last ones short
            start = min(chunk * self.coordinate(rank)[dim], sizes[split])
            end = min(start + chunk, sizes[split])
            offsets[split] += start
            sizes[split] = end - start
        return Box(tuple(offsets), tuple(sizes))


def layouts(max_world: int = 6) -> Iterator[Layout]:
    """FSDP over n ranks, HSDP (r replicas x n shards), 2-D sharding (FSDP x tensor
    parallel on the other dimension) and plain replication, up to ``max_world`` ranks."""
    for n in range(1, max_world + 1):
        yield Layout((n,), (0,))
        yield Layout((n,), (None,))
    for r, n in itertools.product(range(2, max_world + 1), repeat=2):
        if r * n <= max_world:
            yield Layout((r, n), (None, 0))
            yield Layout((r, n), (0, 1))


def _boxes(layout: Layout, ranks: Sequence[int]) -> dict[int, dict[str, list[Box]]]:
    return {
        rank: {name: [layout.box(shape, rank)] for name, shape in SHAPES.items()} for rank in ranks
    }


def plan_violations(
    held: Mapping[int, Mapping[str, Sequence[Box]]], needed: Mapping[int, Mapping[str, Box]]
) -> list[str]:
    """What is wrong with the core's plan between these boxes (empty: nothing)."""
    case = f"held {dict(held)}, needed {dict(needed)}"
    try:
        plan = core_reshard.plan_reshard(SHAPES, held, needed)
    except ReshardError as exc:
        return [f"a whole layout was refused ({exc}): {case}"]
    found = []
    by_target: dict[tuple[int, str], list[Piece]] = {}
    for piece in plan:
        by_target.setdefault((piece.target, piece.tensor), []).append(piece)
        sources = held.get(piece.source, {}).get(piece.tensor, ())
        if not any(piece.box.intersection(box) == piece.box for box in sources):
            found.append(f"{piece} comes from a rank that does not hold it: {case}")
        local = held.get(piece.target, {}).get(piece.tensor, ())
        if piece.source != piece.target and any(
            piece.box.intersection(box) == piece.box for box in local
        ):
            found.append(f"{piece} crosses the network, but its target holds it: {case}")
    for target, tensors in needed.items():
        for name, need in tensors.items():
            pieces = by_target.get((target, name), [])
            outside = [p for p in pieces if need.intersection(p.box) != p.box]
            overlapping = [
                (a, b) for a, b in itertools.combinations(pieces, 2) if a.box.intersection(b.box)
            ]
            covered = sum(p.box.volume for p in pieces)
            if outside or overlapping or covered != need.volume:
                found.append(
                    f"rank {target} gets {covered} of the {need.volume} elements of {name} it "
                    f"needs ({len(outside)} pieces outside, {len(overlapping)} overlaps): {case}"
                )
    reordered = core_reshard.plan_reshard(
        SHAPES,
        {rank: held[rank] for rank in reversed(list(held))},
        {rank: needed[rank] for rank in reversed(list(needed))},
    )
    if reordered != plan:
        found.append(f"the plan depends on the order the boxes were gathered in: {case}")
    return found


def sweep_violations(max_world: int = 6) -> list[str]:
    """Every broken property (module docstring) over every pair of :func:`layouts`:
    all old ranks sending, and every old rank but one (a hole) refused."""
    found: list[str] = []
    all_layouts = list(layouts(max_world))
    for old, new in itertools.product(all_layouts, repeat=2):
        held = _boxes(old, range(old.world))
        needed = {
            rank: {name: found_boxes[0] for name, found_boxes in boxes.items()}
            for rank, boxes in _boxes(new, range(new.world)).items()
        }
        found += plan_violations(held, needed)
        if old.mesh[-1] > 1:
            # The last coordinate's ranks all gone: refused exactly when some element
            # of some tensor has no copy left (a replicated dimension keeps others).
            lost = {r for r in held if old.coordinate(r)[-1] == old.mesh[-1] - 1}
            survivors = {r: b for r, b in held.items() if r not in lost}
            hole = any(
                sum(box.volume for box in {b[name][0] for b in survivors.values()}) < _volume(shape)
                for name, shape in SHAPES.items()
            )
            try:
                core_reshard.plan_reshard(SHAPES, survivors, needed)
                refused = False
            except ReshardError:
                refused = True
            if refused != hole:
                found.append(
                    f"{old} -> {new} without coordinate {old.mesh[-1] - 1}: "
                    f"{'refused' if refused else 'planned'} with{'' if hole else 'out'} a hole"
                )
    return found


def _volume(shape: Sequence[int]) -> int:
    size = 1
    for n in shape:
        size *= n
    return size
