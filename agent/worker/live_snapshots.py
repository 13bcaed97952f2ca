"""Snapshots of a worker's shard in host memory, and its buddy's copy (live regroup).

Runs in the worker's process (:mod:`rallypoint.agent.worker.live`). A sharded job whose
lost shard no replica holds (FSDP, tensor parallel) recovers from memory when each
rank keeps, every few steps, a copy of its state in its own host memory and one in
the host memory of a *buddy* rank on another node (docs/design.md, decision 14).
Where the copies go and which step a round restores are the core's decisions
(:func:`rallypoint.core.state_sources.place_copies`,
:func:`~rallypoint.core.state_sources.plan_restore`); this module keeps the copies
and moves them.

A snapshot is taken at a committed step on every rank alike: the rank copies its
state (packed for the wire, :func:`~rallypoint.agent.worker.live_state.pack_state`) into
its own memory at once, then a background thread sends the copy to its buddy and
receives its wards' copies over a group of the round kept for this, so that the
training loop goes on meanwhile. A copy counts once it is whole: the rank's own at
once, a ward's when the exchange ended on every rank. The two newest steps are kept
(a snapshot in flight when a rank is lost is not whole: the one before it is).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...core.state_sources import Copy
from .live_state import Packed, Shard, StateTransferError, exchange_packed, pack_state

__all__ = ["Snapshots", "Taken", "gather_copies"]

logger = logging.getLogger("rallypoint.live")

#: How many steps' snapshots a rank keeps (its own and each ward's).
KEEP = 2


@dataclass(frozen=True)
class Taken:
    """A whole snapshot of one shard at one step, in this rank's host memory."""

    shard: Shard
    step: int
    packed: Packed


class Snapshots:
    """This rank's snapshots: its own and the copies it keeps for its wards."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int, int], Taken] = {}  # (layout, shard, step)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()

    def take(
        self,
        tree: Any,
        shard: Shard,
        step: int,
        *,
        buddy: int | None,
        wards: Mapping[int, int],
        group: Any,
        in_background: bool = False,
    ) -> None:
        """Keep ``tree`` (the state at ``step``, which ``shard`` names) and start
        sending it to ``buddy`` and receiving the copies of the ``wards`` (rank ->
        the shard it holds) over ``group``. Every rank of ``group`` calls it at the
        same step. Waits for the previous exchange first, so that every rank runs
        them in the same order.

        ``in_background``: the copy itself is made by the background thread too,
        while training goes on; the caller then calls :meth:`wait_copied` before
        anything changes the state (the optimizers' next step). CUDA tensors are
        copied on a stream of their own, after the work queued so far."""
        self.wait()
        ready = None
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        if in_background and cuda:
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()  # the step that made this state, on the training's stream
        copied = threading.Event()
        self._copied = copied

        def copy() -> Packed:
            try:
                if ready is None:
                    own = pack_state(tree, direct_devices=frozenset({"cpu"}), copy=True)
                else:
                    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                    stream.wait_event(ready)
                    with torch.cuda.stream(stream):
                        own = pack_state(tree, direct_devices=frozenset({"cpu"}), copy=True)
                    stream.synchronize()
                self._keep(Taken(shard, step, own))
                return own
            finally:
                copied.set()

        own = None if in_background else copy()  # host memory
        if own is not None and buddy is None and not wards:
            return
        sources = sorted(wards)

        def exchange() -> None:
            mine: Packed | StateTransferError
            try:
                mine = own if own is not None else copy()
            except Exception as exc:  # the peers still take part, and learn it failed
                logger.warning("the snapshot of step %d could not be taken: %s", step, exc)
                mine = StateTransferError(f"the snapshot of step {step} could not be taken: {exc}")
            if buddy is None and not wards:
                return
            try:
                sends = {} if buddy is None else {buddy: mine}
                received = exchange_packed(sends, sources, group=group)
            except Exception as exc:  # a peer lost mid-way: this snapshot is not whole
                logger.info("the snapshot of step %d did not reach its buddy: %s", step, exc)
                return
            for ward, copy_ in zip(sources, received, strict=True):
                self._keep(Taken(Shard(wards[ward], shard.layout), step, copy_))

        self._thread = threading.Thread(target=exchange, name="rallypoint-snapshot", daemon=True)
        self._thread.start()

    def wait_copied(self) -> None:
        """Wait until the newest snapshot's own copy is made (it is made in the
        background: the state must not change before)."""
        self._copied.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the exchange in flight, if any; False when it still runs."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            return False
        self._thread = None
        return True

    def _keep(self, taken: Taken) -> None:
        with self._lock:
            self._kept[(taken.shard.layout, taken.shard.index, taken.step)] = taken
            steps = sorted({step for _, _, step in self._kept}, reverse=True)[:KEEP]
            self._kept = {key: t for key, t in self._kept.items() if key[2] in steps}

    def forget_after(self, step: int) -> None:
        """Drop the copies of steps after ``step``: the job went back to it, and a
        copy from the timeline it left must never mix with the new one's."""
        with self._lock:
            self._kept = {key: t for key, t in self._kept.items() if key[2] <= step}

    @property
    def bytes_kept(self) -> int:
        """The host memory the copies hold."""
        with self._lock:
            return sum(t.packed.nbytes for t in self._kept.values())

    def copies(self, layout: int, holder: int) -> list[Copy]:
        """The whole copies of shards of ``layout`` this rank (``holder``) keeps."""
        with self._lock:
            return [
                Copy(index, step, holder) for (kept, index, step) in self._kept if kept == layout
            ]

    def get(self, layout: int, shard: int, step: int) -> Packed | None:
        with self._lock:
            taken = self._kept.get((layout, shard, step))
        return None if taken is None else taken.packed


def gather_copies(mine: list[Copy], group: Any, limit: int = 32) -> list[Copy]:
    """Every rank's copies (:meth:`Snapshots.copies`), gathered over ``group``
    (the newest ``limit`` of each rank)."""
    mine = sorted(mine, key=lambda c: -c.step)[:limit]
    row = torch.full((1 + 2 * limit,), -1, dtype=torch.int64)
    row[0] = len(mine)
    for i, copy in enumerate(mine):
        row[1 + 2 * i], row[2 + 2 * i] = copy.shard, copy.step
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    found = []
    for holder, r in enumerate(rows):
        values = r.tolist()
        found += [Copy(values[1 + 2 * i], values[2 + 2 * i], holder) for i in range(values[0])]
    return found
