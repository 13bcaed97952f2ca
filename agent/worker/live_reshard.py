"""Resharding a live job's state in memory when its mesh changes (live regroup).

Runs in the worker's process (:mod:`rallypoint.agent.worker.live`). When a sharded job
(FSDP2, HSDP, tensor parallel) regroups into a world of another size, every rank's
rebuilt objects hold other boxes of every ``DTensor`` than the ones trained. The
old boxes are still in memory: live on the ranks that kept them, and in the
snapshots their buddies keep for the ranks that are gone. :func:`reshard` moves
them:

1. each rank states, over the round's CPU side group, the boxes it sends (the old
   shards the core's restore plan gives it) and the box of each tensor its new
   objects hold (JSON, never pickle);
2. every rank computes the same plan from what all stated
   (:func:`rallypoint.core.reshard.plan_reshard`): the pieces to move, a piece
   that a rank holds itself coming from its own memory;
3. the pieces travel point to point as tensors
   (:func:`~rallypoint.agent.worker.live_state.exchange_packed`), with the plain values
   of the state (an optimizer's step counts, its hyperparameters) from one rank;
4. each rank assembles its new boxes and wraps them in ``DTensor`` s of its new
   mesh.

A plan that cannot be made (a box with no copy, a tensor whose shape or dtype
changed) fails on every rank alike, before anything moves.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...core.reshard import Box, Piece, ReshardError, plan_reshard
from .live_state import (
    LocalShard,
    Packed,
    StateTransferError,
    as_dtensor,
    exchange_packed,
    is_dtensor,
    local_device,
    map_leaves,
    pack_state,
    place_of,
    read_layout,
    unpack_state,
)

__all__ = ["reshard"]


def reshard(
    sources: Sequence[Any],
    wanted: Any,
    *,
    reference: int,
    group: Any,
    device_groups: Mapping[str, Any] | None = None,
    failure: str | None = None,
) -> tuple[Any, int, frozenset[int]]:
    """The state of this rank's new objects, resharded from the old shards the ranks
    send (see the module). Every rank of ``group`` calls it.

    Args:
        sources: the old shards this rank sends: state trees whose sharded tensors
            are :class:`~rallypoint.agent.worker.live_state.LocalShard` s (its own
            state's, a snapshot's).
        wanted: this rank's new objects' state (their ``DTensor`` s say which box
            of each tensor it needs, and on which mesh).
        reference: the rank whose plain values every rank takes (it sends
            ``sources[0]``'s).
        group: the round's CPU group (its ranks are the world's).
        device_groups: a group per device type whose tensors travel on it
            (``{"cuda": nccl_group}``).
        failure: why this rank cannot take part (its sources could not be had):
            every rank then fails with it.

    Returns:
        the tree to load, the bytes that came, and the ranks they came from.

    Raises:
        StateTransferError: on every rank, when the plan cannot be made or a
            transfer failed.
    """
    me = dist.get_rank(group)
    held: dict[str, list[LocalShard]] = {}
    for tree in sources:
        map_leaves(tree, lambda path, v: _collect(held, path, v))
    needs: dict[str, tuple[LocalShard, Any]] = {}  # path -> (its place, the DTensor)
    map_leaves(wanted, lambda path, v: _collect_need(needs, path, v))
    statement = {
        "failure": failure,
        "held": {
            path: [[list(s.shape), list(s.box.offsets), list(s.box.sizes), _dtype(s.data)]
                   for s in shards]
            for path, shards in held.items()
        },
        "needs": {
            path: [list(s.shape), list(s.box.offsets), list(s.box.sizes), _dtype(s.data)]
            for path, (s, _) in needs.items()
        },
    }  # fmt: skip
    everyone = _all_gather_json(statement, group)
    plan = _plan(everyone)
    mine = [p for p in plan if p.target == me]
    # Outgoing: per target, the pieces in the plan's order, and the plain values.
    outgoing: dict[int, list[torch.Tensor]] = {}
    for piece in plan:
        if piece.source == me and piece.target != me:
            outgoing.setdefault(piece.target, []).append(_cut(held, piece))
    skeleton = None
    if me == reference:
        skeleton = map_leaves(sources[0], lambda _, v: _PLACEHOLDER if _is_sharded(v) else v)
        outgoing.update({rank: outgoing.get(rank, []) for rank in range(len(everyone))})
        outgoing.pop(me)
    devices = frozenset({"cpu", *(device_groups or {})})
    sends: dict[int, Packed | StateTransferError | None] = {}
    for rank, pieces in outgoing.items():
        try:
            message = {"pieces": pieces, "skeleton": skeleton}
            sends[rank] = pack_state(message, direct_devices=devices)
        except StateTransferError as exc:
            sends[rank] = exc
    senders = sorted({p.source for p in mine if p.source != me} | {reference} - {me})
    received = exchange_packed(sends, senders, group=group, device_groups=device_groups)
    came: dict[int, Any] = {}
    for rank, packed in zip(senders, received, strict=True):
        came[rank] = unpack_state(read_layout(packed.layout), packed.transfers, local_device)
    if me != reference:
        skeleton = came[reference]["skeleton"]
    # Each sender's pieces come in the plan's order: take them in the same order.
    pending = {rank: iter(tree["pieces"]) for rank, tree in came.items()}
    assembled: dict[str, torch.Tensor] = {}
    for path, (place, like) in needs.items():
        mine_local = like.to_local()
        assembled[path] = torch.empty(
            place.box.sizes, dtype=mine_local.dtype, device=mine_local.device
        )
    for piece in mine:
        data = _cut(held, piece) if piece.source == me else next(pending[piece.source])
        region = _region(needs[piece.tensor][0].box, piece.box)
        assembled[piece.tensor][region].copy_(data)
    tree = map_leaves(
        skeleton,
        lambda path, v: as_dtensor(assembled[path], needs[path][1], path) if path in needs else v,
    )
    return tree, sum(p.nbytes for p in received), frozenset(senders)


#: What stands for a sharded tensor in the plain values sent to every rank.
_PLACEHOLDER = torch.empty(0)


def _is_sharded(value: Any) -> bool:
    return isinstance(value, LocalShard)


def _collect(held: dict[str, list[LocalShard]], path: str, value: Any) -> Any:
    if isinstance(value, LocalShard):
        held.setdefault(path, []).append(value)
    return value


def _collect_need(needs: dict[str, tuple[LocalShard, Any]], path: str, value: Any) -> Any:
    if is_dtensor(value):
        shape, box = place_of(value)
        needs[path] = (LocalShard(value.to_local(), shape, box), value)
    return value


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _plan(everyone: Sequence[Mapping[str, Any]]) -> tuple[Piece, ...]:
    """The core's plan from every rank's statement; the same verdict on every rank."""
    failed = [(rank, s["failure"]) for rank, s in enumerate(everyone) if s["failure"]]
    if failed:
        rank, why = failed[0]
        raise StateTransferError(f"rank {rank} cannot reshard its state: {why}")
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for rank, statement in enumerate(everyone):
        entries = [(path, entry) for path, entry in statement["needs"].items()] + [
            (path, entry) for path, boxes in statement["held"].items() for entry in boxes
        ]
        for path, (shape, _, _, dtype) in entries:
            if shapes.setdefault(path, tuple(shape)) != tuple(shape):
                raise StateTransferError(
                    f"{path} is {tuple(shape)} on rank {rank} but {shapes[path]} elsewhere: "
                    "the model's shapes changed between the meshes"
                )
            if dtypes.setdefault(path, dtype) != dtype:
                raise StateTransferError(
                    f"{path} is {dtype} on rank {rank} but {dtypes[path]} elsewhere: build the "
                    "same model, in the same precision, in every round"
                )
    held = {
        rank: {
            path: [Box(tuple(offsets), tuple(sizes)) for _, offsets, sizes, _ in boxes]
            for path, boxes in statement["held"].items()
        }
        for rank, statement in enumerate(everyone)
    }
    needed = {
        rank: {
            path: Box(tuple(offsets), tuple(sizes))
            for path, (_, offsets, sizes, _) in statement["needs"].items()
        }
        for rank, statement in enumerate(everyone)
    }
    try:
        return plan_reshard(shapes, held, needed)
    except ReshardError as exc:
        raise StateTransferError(f"the state cannot be resharded to the new mesh: {exc}") from None


def _region(outer: Box, inner: Box) -> tuple[slice, ...]:
    """Where ``inner`` lies in a tensor holding ``outer`` (both in global coordinates)."""
    return tuple(
        slice(i - o, i - o + n)
        for o, i, n in zip(outer.offsets, inner.offsets, inner.sizes, strict=True)
    )


def _cut(held: Mapping[str, Sequence[LocalShard]], piece: Piece) -> torch.Tensor:
    """The data of ``piece`` from the box this rank holds that contains it."""
    for shard in held[piece.tensor]:
        if shard.box.intersection(piece.box) == piece.box:
            return shard.data[_region(shard.box, piece.box)]
    raise StateTransferError(f"{piece.tensor}: this rank holds no box containing {piece.box}")


def _all_gather_json(value: Any, group: Any) -> list[Any]:
    """``value`` (plain data) from every rank of ``group``, by rank."""
    data = json.dumps(value, separators=(",", ":")).encode()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    rows = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(rows, mine, group=group)
    lengths = [int(n.item()) for n in sizes]
    return [json.loads(row[:n].numpy().tobytes()) for row, n in zip(rows, lengths, strict=True)]
