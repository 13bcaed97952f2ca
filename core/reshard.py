"""Which pieces of a sharded state move where when the job's mesh changes.

A sharded tensor (a ``DTensor`` of FSDP2, HSDP or tensor parallelism) is cut into
**boxes**: each rank holds the part of the whole (its *global shape*) that starts at
``offsets`` and spans ``sizes``. When a round runs in another mesh than the one the
state was trained in (the world shrank or grew: a node lost for good, a node
joining), every rank needs another box of every tensor. The old boxes are still in
memory, live on the ranks that kept them or in the snapshots their buddies keep
(:mod:`rallypoint.core.state_sources` picks, per old shard, the rank that sends it).

:func:`plan_reshard` computes, from the boxes the senders hold and the boxes every
rank needs, the **pieces** to move: each is the intersection of one held box with
one needed box, sent by a rank that holds it to the rank that needs it. Every rank
computes the plan alone from the same gathered boxes, so the ranks agree on it
without another message. Its rules:

* the distinct boxes held of a tensor tile it: they do not overlap and together
  cover its global shape (replicas hold the same box; any other overlap, or a
  hole, is a layout this plan cannot read, :class:`ReshardError`);
* every needed box lies inside the global shape, and is covered exactly once by
  its pieces;
* a piece comes from the rank that needs it when that rank holds its box (nothing
  crosses the network), else from the lowest rank that holds it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Box", "Piece", "ReshardError", "plan_reshard"]


class ReshardError(ValueError):
    """The boxes held or needed cannot make a plan: says which tensor and why."""


@dataclass(frozen=True, order=True)
class Box:
    """A part of a tensor: ``sizes`` elements along each dimension from ``offsets``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    def intersection(self, other: Box) -> Box | None:
        """The part both boxes hold (None: none, or an empty one)."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        ends = tuple(
            min(a + n, b + m)
            for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        )
        if any(end <= start for start, end in zip(starts, ends, strict=True)):
            return None
        return Box(starts, tuple(end - start for start, end in zip(starts, ends, strict=True)))

    def within(self, shape: Sequence[int]) -> bool:
        """Whether the box lies inside a tensor of ``shape``."""
        return len(self.offsets) == len(self.sizes) == len(shape) and all(
            o >= 0 and n >= 0 and o + n <= s
            for o, n, s in zip(self.offsets, self.sizes, shape, strict=True)
        )


@dataclass(frozen=True, order=True)
class Piece:
    """One part of one tensor to move: ``box`` (global coordinates) of ``tensor``,
    from the rank ``source`` to the rank ``target`` (the same rank: a local copy)."""

    target: int
    tensor: str
    box: Box
    source: int


def plan_reshard(
    shapes: Mapping[str, Sequence[int]],
    held: Mapping[int, Mapping[str, Sequence[Box]]],
    needed: Mapping[int, Mapping[str, Box]],
) -> tuple[Piece, ...]:
    """The pieces that give every rank the boxes it needs (see the module), sorted by
    target, tensor and place.

    Args:
        shapes: every sharded tensor's global shape, by name.
        held: rank -> tensor -> the boxes that rank sends (a rank may send several:
            its own and a snapshot of another's).
        needed: rank -> tensor -> the box that rank needs.

    Raises:
        ReshardError: a tensor without a shape, held boxes that do not tile their
            tensor, or a needed box outside it.
    """
    holders: dict[str, dict[Box, list[int]]] = {name: {} for name in shapes}
    for rank, tensors in held.items():
        for name, boxes in tensors.items():
            if name not in holders:
                raise ReshardError(f"{name}: rank {rank} holds a tensor the new layout lacks")
            for box in boxes:
                if not box.within(shapes[name]):
                    raise ReshardError(
                        f"{name}: rank {rank} holds {box}, outside its shape {tuple(shapes[name])}"
                    )
                holders[name].setdefault(box, []).append(rank)
    for name, by_box in holders.items():
        _check_tiling(name, shapes[name], sorted(by_box))
    pieces = []
    for target, wants in needed.items():
        for name, need in wants.items():
            if name not in holders:
                raise ReshardError(f"{name}: rank {target} needs a tensor no rank holds")
            if not need.within(shapes[name]):
                raise ReshardError(
                    f"{name}: rank {target} needs {need}, outside its shape {tuple(shapes[name])}"
                )
            for box, ranks in sorted(holders[name].items()):
                part = box.intersection(need)
                if part is not None:
                    source = target if target in ranks else min(ranks)
                    pieces.append(Piece(target, name, part, source))
    return tuple(sorted(pieces))


def _check_tiling(name: str, shape: Sequence[int], boxes: Sequence[Box]) -> None:
    """The distinct boxes held of one tensor tile it exactly."""
    boxes = [box for box in boxes if box.volume]
    for i, box in enumerate(boxes):
        for other in boxes[i + 1 :]:
            if box.intersection(other) is not None:
                raise ReshardError(
                    f"{name}: the boxes held overlap ({box} and {other}) without being "
                    "replicas: a layout live resharding cannot read"
                )
    covered = sum(box.volume for box in boxes)
    if covered != math.prod(shape):
        raise ReshardError(
            f"{name}: the boxes held cover {covered} of its {math.prod(shape)} elements: "
            "some part of it has no copy"
        )
