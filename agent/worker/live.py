"""Live regroup, the worker's side: keep the process and its training state across rounds.

A training script opts in by registering what must survive a regroup and running its
loop inside :meth:`Job.rounds`; the agent opts in with ``rallypoint run --live``::

    from rallypoint.agent.worker import live

    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    job = live.Job(model=model, optimizer=optimizer,   # anything with state_dict()
                   restore=lambda: load_checkpoint(model))  # read on a whole-job start only
    for rnd in job.rounds():                           # a ready process group each round
        with rnd:                                      # a lost peer ends the round quietly
            ddp = DistributedDataParallel(model)
            for step in rnd.steps(1000):               # job.step counts committed steps
                train_one_step(ddp, optimizer, step)

What happens on a membership change (a peer crashed, a node left or joined):

1. The agent joins the next round as it always does, then hands each of its live
   workers the new round's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...)
   over a local pipe (:mod:`rallypoint.agent.worker.live_channel`). Only workers that are
   really gone are started again. With ``Job(may_shrink=True)`` nobody waits for
   them: their node is out of the rendezvous while they start (the others regroup
   without it and train on), they report ready at ``job.rounds()``, and the node
   joins again (the core's admission rule, :mod:`rallypoint.core.newcomers`).
2. Every rank leaves the old round at the same step. A collective that cannot finish
   because a peer is gone fails (gloo: the peer's connection closes; NCCL: the
   communicator is aborted when the agent says a member is lost, or when the
   script has not reached a step boundary soon after the new round came), and
   ``with rnd`` swallows that failure. Otherwise the ranks agree, every few tenths of
   a second, whether a new round is pending (one small all-reduce on a CPU side
   group, started in the background and read at the next check), and all stop
   after the same step.
3. The new process group forms (``init_process_group``, ``env://``). The ranks compare
   their step counters; if they differ (a newcomer, or a rank that lost its last
   step), the lowest rank with the highest count sends the registered state to the
   others as tensors (:mod:`rallypoint.agent.worker.live_state`: a JSON layout and the
   tensors' bytes, over the side group, and CUDA tensors over the round's NCCL
   group; no pickle, so no code can travel). A newcomer never reads a checkpoint on
   this path: ``restore`` runs only when no rank holds the state (the whole job
   starts).
4. The next round is yielded; the script rebuilds whatever holds the process group
   (a ``DistributedDataParallel`` wrapper) and goes on from ``job.step``.

The registered state must be the same on every rank after a step (data parallel
training, as with DDP): a regroup copies one rank's state to the others. A worker
that does not take the new round within ``--live-timeout`` is stopped and started
again by its agent; with ``--progress-timeout`` a rank that commits no step for that
long counts as failed (mark long sections such as a checkpoint with
:meth:`Job.pause`). Run without ``--live`` (or under torchrun) :meth:`Job.rounds`
yields one round and a failure ends the process, as any script's would.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from datetime import timedelta
from types import TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ...core.live_switch import (
    Act,
    Agreement,
    Cause,
    Place,
    at_check,
    check_due,
    check_interval,
    offered,
    react,
)
from ...core.state_sources import (
    Position,
    RestoreFrom,
    place_copies,
    plan_restore,
    plan_sync,
    reshard_from,
)
from .live_channel import (
    BEAT_PERIOD,
    FD_ENV,
    SOURCE_DISK,
    STANDBY_ENV,
    STATUS_ENV,
    TIMEOUT_ENV,
    LiveMessage,
    Phase,
    StatusFile,
    decode_message,
)
from .live_reshard import reshard
from .live_snapshots import Snapshots, gather_copies
from .live_state import (
    Packed,
    Shard,
    StateTransferError,
    exchange_packed,
    exchange_state,
    local_shards,
    pack_state,
    read_layout,
    regraft,
    shard_of,
    unpack_state,
)

__all__ = ["Job", "LiveError", "Round", "Sharded", "Stateful"]

logger = logging.getLogger("rallypoint.live")

#: How long the ranks may run between two agreements on a pending round: the
#: latency of a planned switch (a node joining) against the cost of the check.
CHECK_PERIOD = 0.2
#: Seconds one look for the round's store may take (and a tenth: between two looks).
_MASTER_PROBE = 0.5
#: Markers of a collective that failed because a peer is gone (gloo raises plain
#: RuntimeErrors that name the transport; NCCL DistBackendErrors).
_COMMUNICATION_MARKERS = (
    "gloo",
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL",
    "aborted",
    "Socket Timeout",
)


class LiveError(RuntimeError):
    """The live API cannot go on (no new round came after a failed collective, a bad
    message from the agent); the worker then fails the classic way."""


class Stateful(Protocol):
    """What :class:`Job` can carry across a regroup (modules, optimizers, schedulers)."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any], /) -> Any: ...


class Sharded:
    """A sharded model and its optimizers as one :class:`Stateful`, through torch's
    distributed state-dict API (``get_state_dict`` / ``set_state_dict``): FSDP2
    (``fully_shard``), HSDP (a replicate x shard mesh) and tensor-parallel models,
    whose parameters and optimizer state are ``DTensor`` shards. Return it from
    :class:`Job`'s ``build``.

    Attributes:
        model: the wrapped model.
        optimizers: its optimizers (the first is also :attr:`optimizer`).
    """

    def __init__(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizers = optimizers

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optimizers[0]

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizers = get_state_dict(self.model, self.optimizers)
        return {"model": model, "optimizers": optimizers}

    def load_state_dict(self, state_dict: Mapping[str, Any], /) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizers"],
        )


class _Inbox:
    """The agent's messages, read by a daemon thread so that the training loop only
    reads an attribute to know whether a new round is pending."""

    def __init__(self, fd: int, on_message: Any) -> None:
        self._fd = fd
        self._cond = threading.Condition()
        self._latest: LiveMessage | None = None
        self.closed = False
        self._on_message = on_message
        threading.Thread(target=self._read, name="rallypoint-live-inbox", daemon=True).start()

    def _read(self) -> None:
        rest = b""
        with open(self._fd, "rb", buffering=0, closefd=True) as pipe:
            while True:
                data = pipe.read(65536)
                if not data:
                    break
                *lines, rest = (rest + data).split(b"\n")
                for line in lines:
                    try:
                        message = decode_message(line)
                    except ValueError as exc:
                        logger.warning("ignoring a message from the agent: %s", exc)
                        continue
                    with self._cond:
                        self._latest = message
                        self._cond.notify_all()
                    self._on_message(message)
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def newer_than(self, round_: int) -> LiveMessage | None:
        latest = self._latest
        return latest if latest is not None and latest.round > round_ else None

    def wait_newer_than(self, round_: int, timeout: float | None) -> LiveMessage | None:
        """The first message of a round after ``round_``, waiting up to ``timeout``
        seconds (None: until one comes or the agent closes the pipe)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                found = self.newer_than(round_)
                left = None if deadline is None else deadline - time.monotonic()
                if found is not None or self.closed or (left is not None and left <= 0):
                    return found
                self._cond.wait(left)


class Job:
    """What survives a regroup in this worker, and the rounds it trains in.

    Args:
        state: the objects to carry over, by name (each has ``state_dict`` and
            ``load_state_dict``); more can be passed as keyword arguments.
        backend: the process group's backend (None: ``nccl`` when CUDA is available,
            else ``gloo``).
        timeout: the process group's timeout for collectives and for forming it
            (None: torch's default).
        restore: called with no arguments on every rank when the job starts as a
            whole (no rank of the round holds the job's state: every worker is
            fresh), to load a checkpoint into the registered objects; it returns the
            step to resume at (the checkpoint's ``job.step``; 0 or None: from the
            start). A worker that joins a running job (a replacement, a node joining)
            does not call it: it gets the state from a peer, so it reads no file.
        build: for sharded state (FSDP2, HSDP, tensor parallel): called on every rank
            of every round once its process group has formed, before the state is
            brought in; it builds the mesh and the wrapped objects for the round's
            world (``init_device_mesh``, ``fully_shard``, the optimizer) and returns
            them by name (:class:`Sharded`), in place of ``state``. The state then
            comes from a rank that holds the same shard (another replica), or from
            the rank's own memory when it kept its place; when no rank holds some
            shard any more, every rank restores the checkpoint (``restore``).
        snapshot_every: with ``build``, every this many steps each rank keeps a copy
            of its shard in its host memory and one in the host memory of a rank on
            another node (sent in the background while training goes on), so that a
            shard no live rank holds any more (FSDP, tensor parallel) comes back
            from memory: every rank rolls back to the newest step whose copies are
            whole, instead of restoring the checkpoint. 0: off. When ``build``
            returns :class:`Sharded` objects only, the copy itself is made in the
            background too, while the next step's forward and backward run (CUDA
            tensors on a stream of their own), and the optimizers' next ``step()``
            waits for it: change the parameters and the optimizer state only
            through ``step()`` then (anything else: register it in an object of
            its own, and the copy is made at the step, before training goes on).
        may_shrink: the job may train on without this worker for a while: when it
            is lost, the other nodes regroup without its node and go on stepping
            while its replacement starts, and take the replacement in once it is
            ready (within ``--nnodes``). Right for data-parallel training whose
            results do not depend on the world size; leave it False when every rank
            is needed (a fixed global batch split by rank, model parallelism): the
            others then wait for the replacement.

    Attributes:
        step: committed steps; carried over with the state, and reported to the agent
            on each commit (set it after loading a checkpoint, before :meth:`rounds`).
    """

    def __init__(
        self,
        state: Mapping[str, Stateful] | None = None,
        *,
        backend: str | None = None,
        timeout: float | None = None,
        restore: Callable[[], int | None] | None = None,
        build: Callable[[], Mapping[str, Stateful]] | None = None,
        snapshot_every: int = 0,
        may_shrink: bool = False,
        **named: Stateful,
    ) -> None:
        self.state: dict[str, Stateful] = {**(state or {}), **named}
        self.step = 0
        self.restore = restore
        self.build = build
        if snapshot_every < 0 or (snapshot_every and build is None):
            raise ValueError(
                f"snapshot_every={snapshot_every}: a count of steps >= 0, for a job with build="
            )
        self.snapshot_every = snapshot_every
        self.snapshots = Snapshots()
        self._copy_in_background = False
        # The round's copies: the group they travel on, this rank's buddy and wards
        # (rank -> the shard it holds), and the shard this rank holds.
        self._copies: tuple[Any, int | None, dict[int, int]] | None = None
        self._shard = shard_of(None)
        self.may_shrink = may_shrink
        # Whether this process holds the job's state: restored it, got it from a
        # peer, or trained. A fresh worker does not, even at step 0.
        self._holds_state = False
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout = timedelta(seconds=timeout) if timeout is not None else None
        self.round = int(os.environ.get("RALLYPOINT_ROUND", "0"))
        self._status: StatusFile | None = None
        self._inbox: _Inbox | None = None
        self._live_timeout = float(os.environ.get(TIMEOUT_ENV, "30"))
        self._current: Round | None = None
        self._round_sockets: dict[int, str] = {}
        # While a round's group forms: the sockets from before, so that a newer
        # round can break the forming (a peer of the old one may never come).
        self._forming: dict[int, str] | None = None
        self._forming_lock = threading.Lock()
        # While the ranks compare positions and move the state (a new round is then
        # acted on as the core's switch rule says for a sync).
        self._syncing = False
        # A newcomer started outside the group: its first round comes from the agent.
        self._standby = False
        status_path, fd = os.environ.get(STATUS_ENV), os.environ.get(FD_ENV)
        if status_path and fd:
            self._status = StatusFile(status_path)
            self._status.write_may_shrink(may_shrink)
            self._inbox = _Inbox(int(fd), self._on_message)
            self._standby = os.environ.get(STANDBY_ENV) == "1"
            _beat(self._status, threading.get_ident())
            # Inherited by nothing this worker starts: its own children are not live.
            for name in (STATUS_ENV, FD_ENV, STANDBY_ENV):
                os.environ.pop(name, None)

    @property
    def live(self) -> bool:
        """Whether a live agent (``rallypoint run --live``) hands this worker rounds."""
        return self._inbox is not None

    # ------------------------------------------------------------- rounds

    def rounds(self) -> Iterator[Round]:
        """Yield one :class:`Round` per round this worker trains in, each with its
        process group formed and the state in place; stop once a round ends without
        being interrupted (the script's loop finished). The last round's process
        group stays up for the script's final collectives.

        Raises:
            LiveError: a collective failed and no new round came in time.
        """
        if self._standby:
            self._standby = False
            self._await_admission()
        while True:
            self._report_round(self.round)
            try:
                rnd = self._open_round()
            except Exception as exc:
                if not self._is_lost_peer(exc):
                    raise
                self._report(Phase.JOINING)
                self._leave_group()
                self._next_round(exc)
                continue
            self._current = rnd
            yield rnd
            self._current = None
            if not rnd.interrupted:
                self._report(Phase.DONE)
                self.snapshots.wait(self._live_timeout / 2)  # none in flight at the end
                rnd.settle()  # the script may keep `rnd`: it must not keep the side group
                return
            self._report(Phase.JOINING)  # waiting for the next round is not a stall
            if rnd.failure is None:  # a planned switch: let a snapshot in flight land
                self.snapshots.wait(self._live_timeout / 2)
            self.abort()
            self.snapshots.wait(self._live_timeout / 2)
            rnd.settle()  # no work of the round may be in flight when its groups go
            self._leave_group()
            self._next_round(rnd.failure)

    def _await_admission(self) -> None:
        """A newcomer outside the group: report ready, then wait for the round that
        takes it in (the agent sends it, or stops this process; the wait ends with
        the agent at the latest, when the pipe closes)."""
        assert self._status is not None and self._inbox is not None
        self._status.write_ready(time.monotonic())
        message = self._inbox.wait_newer_than(self.round, None)
        if message is None:
            raise LiveError("the agent was gone before this worker was taken into a round")
        self._take(message)

    def _open_round(self) -> Round:
        """Form this round's process group and bring the state to the front-runner's."""
        kwargs: dict[str, Any] = {"backend": self.backend}
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        before = _sockets()
        with self._forming_lock:
            self._forming = before
        try:
            self._wait_for_master()
            _name_groups_afresh()
            dist.init_process_group(**kwargs)
            side = dist.new_group(backend="gloo")
            copies_group = dist.new_group(backend="gloo") if self.snapshot_every else None
            held, wanted = self._rebuild()
        finally:
            with self._forming_lock:
                self._forming = None
        # gloo connects every pair while the groups form (the script's mesh too):
        # these are the round's.
        self._round_sockets = _opened_since(before)
        if self._status is not None:
            self._status.write_group_ready(time.monotonic())
        self._report(Phase.SYNCING)
        self._syncing = True
        try:
            source, size = self._sync_state(side, held, wanted)
            if copies_group is not None:
                self._place_copies(side, copies_group)
        finally:
            self._syncing = False
        if self._status is not None:
            self._status.write_state(time.monotonic(), source, size)
        self._report(Phase.STEPPING)
        return Round(self, side)

    def _tree(self) -> dict[str, Any]:
        """The registered objects' state, by name (tensors are the objects' own)."""
        return {name: obj.state_dict() for name, obj in self.state.items()}

    def _positions(self, side: Any, have: Shard, need: Shard) -> list[Position]:
        """Every rank's position, by rank: its steps, whether it holds the state,
        the shard it holds (``have``, of its state from before, and that state's
        layout) and the one it needs (``need``, of the objects of this round)."""
        row = [self.step, int(self._holds_state), have.index, need.index, have.layout, have.count]
        mine = torch.tensor(row, dtype=torch.int64)
        gathered = [torch.zeros(len(row), dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine, group=side)
        return [
            Position(int(step), bool(holds), int(shard), int(wants), int(layout), int(count))
            for step, holds, shard, wants, layout, count in (t.tolist() for t in gathered)
        ]

    def _in_layout(self, positions: list[Position]) -> list[Position]:
        """The positions as the round's layout sees them: a state held in another
        layout is no state of this round's (:func:`plan_sync` compares the rest)."""
        layout = self._shard.layout
        return [replace(p, holds=p.holds and p.layout == layout) for p in positions]

    def _guard_optimizers(self) -> bool:
        """Whether a snapshot's copy may be made in the background while training
        goes on: only optimizers change the registered state (every object is a
        :class:`Sharded`), and each one's next step waits for the copy (a step
        pre-hook on the objects this round built)."""
        if not self.snapshot_every or not all(isinstance(o, Sharded) for o in self.state.values()):
            return False
        for obj in self.state.values():
            assert isinstance(obj, Sharded)
            for optimizer in obj.optimizers:
                optimizer.register_step_pre_hook(lambda *_: self.snapshots.wait_copied())
        return True

    def _rebuild(self) -> tuple[Any, Any]:
        """The state this rank holds from before (None: nothing) and the objects'
        state for this round: with ``build``, the objects built for this round's
        world; else the same objects'."""
        held: Any = self._tree() if self._holds_state or self.build is None else None
        if self.build is not None:
            self.state = dict(self.build())
            self._copy_in_background = self._guard_optimizers()
            return held, self._tree()
        if shard_of(held).layout != shard_of(None).layout:
            raise LiveError(
                "the registered state holds sharded tensors (DTensor): pass live.Job(build=...) "
                "so that every round builds the mesh and the wrapping for its world"
            )
        return held, held

    def _sync_state(self, side: Any, held: Any, wanted: Any) -> tuple[int, int]:
        """Bring every rank to one state, as the core plans it (per shard, the
        front-runner's): (the rank it came from, -1 when nothing came, or
        :data:`SOURCE_DISK`; bytes in). ``held``, ``wanted``: :meth:`_rebuild`'s.
        When no rank holds the state (the whole job starts), or no rank holds some
        shard any more, every rank restores its checkpoint first (:attr:`restore`)."""
        self._shard = shard_of(wanted)
        have = self._shard if held is wanted else shard_of(held)
        everyone = self._positions(side, have, self._shard)
        old = reshard_from(everyone, self._shard.layout)
        positions = self._in_layout(everyone)
        plan = plan_sync(positions)
        why: str | None = None  # why the ranks read the checkpoint, though some hold the state
        if old is not None:  # the mesh changed: the state is held in another layout
            resharded = self._reshard(side, old, held, wanted)
            if resharded is not None:
                return resharded
            why = "no step has a copy of every shard of the mesh the state was trained in"
        elif not plan.restore and not plan.from_peers:
            if self.snapshot_every:
                restored = self._restore_copies(side, positions, held, wanted)
                if restored is not None:
                    return restored
            why = (
                f"no rank holds shard(s) {sorted(plan.missing)} any more"
                if plan.missing
                else "the shards' newest copies are at different steps"
            )
        if why is not None or plan.restore:
            self._restore_checkpoint(why)
            held = wanted = self._tree()
            positions = self._in_layout(self._positions(side, self._shard, self._shard))
            plan = plan_sync(positions)
            if not plan.from_peers:  # every rank holds a state: only an uneven one
                raise LiveError(f"round {self.round}: the checkpoints restored differ by shard")
        me = dist.get_rank()
        mine = positions[me]
        send_to = next((plan.receivers[s] for s, r in plan.sources.items() if r == me), ())
        needs_it = me in plan.receivers.get(mine.needs, ())
        receive_from = plan.sources[mine.needs] if needs_it else None
        # CUDA tensors go over the round's NCCL group; the rest over the CPU side group.
        devices = {"cuda": dist.group.WORLD} if self.backend == "nccl" else {}
        try:
            doc, size = exchange_state(
                {"step": self.step, "state": held} if send_to else None,
                send_to=sorted(send_to),
                receive_from=receive_from,
                group=side,
                device_groups=devices,
                like={"step": 0, "state": wanted},
            )
        except StateTransferError as exc:
            raise LiveError(f"round {self.round}: {exc}") from exc
        if receive_from is None:
            if held is not wanted:  # this rank kept its shard: into the objects rebuilt
                self._load(regraft(held, wanted))
            return (SOURCE_DISK if why is not None else -1), 0
        self._load(doc["state"])
        self.step = int(doc["step"])
        self._holds_state = True
        logger.info("round %d: state of step %d from rank %d", self.round, self.step, receive_from)
        return receive_from, size

    def _restore_copies(
        self, side: Any, positions: list[Position], held: Any, wanted: Any
    ) -> tuple[int, int] | None:
        """Some shard has no live copy: roll every rank back to the newest step
        whose copies (live or snapshot) the ranks hold whole, as the core plans it;
        (source, bytes in) as :meth:`_sync_state`, or None when no step is whole."""
        me = dist.get_rank()
        layout = self._shard.layout
        copies = gather_copies(self.snapshots.copies(layout, me), side)
        plan = plan_restore(self._shard.count, positions, copies)
        if plan.source is RestoreFrom.DISK or plan.step is None:
            return None
        step = plan.step

        def copy_of(shard: int) -> Packed | StateTransferError:
            p = positions[me]
            if p.holds and (p.shard, p.step) == (shard, step):
                return pack_state(held, direct_devices=frozenset({"cpu"}))
            found = self.snapshots.get(layout, shard, step)
            return found or StateTransferError(f"rank {me} lost its copy of shard {shard}")

        sends = {
            rank: copy_of(p.needs)
            for rank, p in enumerate(positions)
            if rank != me and plan.senders[p.needs] == me
        }
        source = plan.senders[positions[me].needs]
        try:
            received = exchange_packed(sends, [] if source == me else [source], group=side)
            packed = received[0] if received else copy_of(positions[me].needs)
            if isinstance(packed, StateTransferError):
                raise packed
            tree = unpack_state(read_layout(packed.layout), packed.transfers, like=wanted)
        except StateTransferError as exc:
            raise LiveError(f"round {self.round}: {exc}") from exc
        self._load(tree)
        logger.warning(
            "round %d: no rank held shard(s) of step %d any more; every rank rolled back to "
            "the snapshot of step %d",
            self.round,
            max(p.step for p in positions),
            step,
        )
        self.step = step
        self._holds_state = True
        self.snapshots.forget_after(step)
        return (-1 if source == me else source), (0 if source == me else packed.nbytes)

    def _reshard(
        self, side: Any, old: tuple[Position, ...], held: Any, wanted: Any
    ) -> tuple[int, int] | None:
        """The mesh changed: reshard the state in memory from the newest step of which
        the ranks hold every old shard (live, or in snapshots), as the core plans it
        (:func:`plan_restore` over the old layout, then
        :mod:`~rallypoint.agent.worker.live_reshard`); (source, bytes in) as
        :meth:`_sync_state`, or None when no step is whole."""
        me = dist.get_rank()
        front = next(p for p in old if p.holds)
        layout = front.layout
        kept = self.snapshots.copies(layout, me)
        copies = gather_copies(kept, side) if self.snapshot_every else []
        plan = plan_restore(front.count, old, copies)
        if plan.source is RestoreFrom.DISK or plan.step is None:
            return None
        sources: list[Any] = []
        failure = None
        mine = old[me]
        for shard in sorted(s for s, sender in plan.senders.items() if sender == me):
            if mine.holds and (mine.shard, mine.step) == (shard, plan.step):
                sources.append(local_shards(held))
                continue
            packed = self.snapshots.get(layout, shard, plan.step)
            if packed is None:
                failure = f"it lost its copy of shard {shard} of step {plan.step}"
                break
            doc = read_layout(packed.layout)
            sources.append(unpack_state(doc, packed.transfers, local_shards=True))
        devices = {"cuda": dist.group.WORLD} if self.backend == "nccl" else {}
        try:
            tree, size, came_from = reshard(
                sources,
                wanted,
                reference=plan.senders[0],
                group=side,
                device_groups=devices,
                failure=failure,
            )
        except StateTransferError as exc:
            raise LiveError(f"round {self.round}: {exc}") from exc
        self._load(tree)
        logger.warning(
            "round %d: the state of step %d was resharded in memory from %d shards to %d",
            self.round,
            plan.step,
            front.count,
            self._shard.count,
        )
        self.step = plan.step
        self._holds_state = True
        self.snapshots.forget_after(plan.step)
        return (min(came_from) if came_from else -1), size

    def _place_copies(self, side: Any, group: Any) -> None:
        """Where this round's snapshots go: each rank's buddy on another node (the
        core's placement over the ranks' nodes) and the shards of the ranks whose
        buddy this one is."""
        node = int(os.environ.get("GROUP_RANK", "0"))
        mine = torch.tensor([node, self._shard.index], dtype=torch.int64)
        rows = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine, group=side)
        nodes = [int(r[0]) for r in rows]
        buddies = place_copies(nodes)
        me = dist.get_rank()
        wards = {rank: int(rows[rank][1]) for rank, b in enumerate(buddies) if b == me}
        self._copies = (group, buddies[me], wards)

    def _snapshot(self) -> None:
        """Keep a copy of the state at this step, and send one to the buddy."""
        if self._copies is None:
            return
        group, buddy, wards = self._copies
        self.snapshots.take(
            self._tree(),
            self._shard,
            self.step,
            buddy=buddy,
            wards=wards,
            group=group,
            in_background=self._copy_in_background,
        )

    def _restore_checkpoint(self, why: str | None) -> None:
        """Load the checkpoint on this rank (:attr:`restore`): the whole job starts
        (``why`` None), or, for ``why``, the ranks cannot make one state from what
        they hold."""
        if why is not None:
            if self.restore is None:
                raise LiveError(
                    f"round {self.round}: {why}, and live.Job has no restore= to read a checkpoint"
                )
            logger.warning("round %d: %s; every rank restores the checkpoint", self.round, why)
        if self.restore is not None:
            self.step = int(self.restore() or 0)
        self._holds_state = True
        self.snapshots.forget_after(self.step)

    def _load(self, tree: Mapping[str, Any]) -> None:
        """Load ``tree`` (by name) into the registered objects."""
        if set(tree) != set(self.state):
            raise LiveError(
                f"round {self.round}: the peer's state holds {sorted(tree)}, this worker's "
                f"{sorted(self.state)}: register the same objects on every rank"
            )
        for name, obj in self.state.items():
            obj.load_state_dict(tree[name])

    def abort(self) -> None:
        """Break the round's communication so that no rank waits in it any more: NCCL
        aborts its communicators; gloo cannot, so the round's connections are shut
        down (the peers' collectives then fail as if this process had died). Safe
        from any thread. With NCCL every NCCL group of the process is aborted: the
        round's and those the script built on it (a device mesh's)."""
        if self.backend == "nccl" and dist.is_initialized():
            for group in _nccl_groups():
                with contextlib.suppress(Exception):
                    group.abort()
        _shut_down(self._round_sockets)

    def _leave_group(self) -> None:
        if not dist.is_initialized():
            return
        self.abort()
        self._round_sockets = {}
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _next_round(self, failure: BaseException | None) -> None:
        """Wait for the agent's next round and take its variables."""
        if self._inbox is None:
            if failure is not None:
                raise failure
            raise LiveError("a round was interrupted without a live agent")
        message = self._inbox.wait_newer_than(self.round, self._live_timeout)
        if message is None:
            why = (
                "the agent is gone"
                if self._inbox.closed
                else (f"no new round came within {self._live_timeout:g} s")
            )
            raise LiveError(
                f"round {self.round} was interrupted ({failure or 'a new round was due'}) and {why}"
            ) from failure
        self._take(message)

    def _take(self, message: LiveMessage) -> None:
        """Become a worker of the round ``message`` assigns (its torchrun variables)."""
        os.environ.update(message.env)
        self.round = message.round

    # ------------------------------------------------------------ reporting

    def _report_round(self, round_: int) -> None:
        if self._status is not None:
            self._status.write_round(round_, joined_at=time.monotonic())
            self._status.write_phase(Phase.JOINING)

    def _report(self, phase: Phase) -> None:
        if self._status is not None:
            self._status.write_phase(phase)

    def _commit(self) -> None:
        self.step += 1
        status = self._status
        if status is not None:
            status.write_step(self.step)
        if self.snapshot_every and self.step % self.snapshot_every == 0:
            self._snapshot()

    def _first_step(self) -> None:
        if self._status is not None:
            self._status.write_first_step(time.monotonic())

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Mark a long section (a checkpoint): ``--progress-timeout`` does not count it."""
        self._report(Phase.PAUSED)
        try:
            yield
        finally:
            self._report(Phase.STEPPING)

    # -------------------------------------------------------------- failures

    def _on_message(self, message: LiveMessage) -> None:
        """On the inbox thread: a new round, acted on as the core's switch rule says
        for where this worker is (:func:`rallypoint.core.live_switch.react`). A
        collective waiting for a lost peer may never return by itself (NCCL; gloo
        across a cut network), so the round (or the sync) is broken at once when the
        agent says a member is lost, else when the loop has not left the round well
        after the ranks' agreement was due. A worker outside a round (a newcomer,
        one between rounds) takes the message where it waits for it."""
        rnd = self._current
        with self._forming_lock:
            forming = self._forming is not None
        if rnd is not None:
            place = Place.TRAINING
        elif forming:
            place = Place.FORMING
        elif self._syncing:
            place = Place.SYNCING
        else:
            return
        act, _ = react(place, Cause.NEWER_ROUND_LOST if message.lost else Cause.NEWER_ROUND)
        if act is Act.BREAK_AND_TAKE:
            self._break_forming()
        elif act is Act.ABORT:
            if rnd is not None:
                rnd.abort()
            else:
                self.abort()
        elif act is Act.OFFER and rnd is not None:
            # The agreement needs up to two check periods and a step or two: well
            # past that, the loop is stuck in a collective that only an abort ends.
            timer = threading.Timer(4 * CHECK_PERIOD + 4 * rnd.step_seconds, rnd.abort)
            timer.daemon = True
            timer.start()

    def _wait_for_master(self) -> None:
        """Wait until the round's store answers, unless a newer round comes first.
        A rank that does not host the store otherwise connects inside
        ``init_process_group``, which retries a refused connection until the group's
        timeout: if the round is superseded before its host (rank 0's worker) opens
        the store, nothing could end that wait.

        Raises:
            LiveError: a newer round came first.
        """
        inbox = self._inbox
        if inbox is None:
            return
        env = os.environ
        hosted = env.get("RANK") == "0" or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        address = (env.get("MASTER_ADDR", ""), int(env.get("MASTER_PORT", "0") or 0))
        # No longer than init_process_group itself would wait; then it reports.
        limit = (self.timeout or default_pg_timeout).total_seconds()
        deadline = time.monotonic() + limit
        while True:
            if inbox.newer_than(self.round) is not None:
                raise LiveError(f"round {self.round} was superseded before its group formed")
            if hosted or not address[1] or time.monotonic() > deadline:
                return
            try:
                with socket.create_connection(address, timeout=_MASTER_PROBE):
                    return
            except OSError:
                time.sleep(_MASTER_PROBE / 10)  # refused: its host has not opened it yet

    def _break_forming(self) -> None:
        """A newer round came while this round's group forms: shut the connections
        the forming opened (the store's, gloo's), so that a wait on them fails now
        instead of running out its timeout for a peer that may never come (the
        store is waited for before, in :meth:`_wait_for_master`; a gloo connect that
        retries a vanished peer is not broken this way: the agent starts a worker
        that holds nothing again, see :data:`rallypoint.core.live_switch.EMPTY_GRACE`)."""
        with self._forming_lock:
            if self._forming is not None:
                _shut_down(_opened_since(self._forming))

    def _is_lost_peer(self, exc: BaseException) -> bool:
        """Whether ``exc`` may be a collective broken by the regroup (so the worker
        waits for the new round rather than failing)."""
        if self._inbox is None:
            return False
        if self._inbox.newer_than(self.round) is not None:
            return True
        if isinstance(exc, dist.DistError):
            return True
        text = str(exc)
        return isinstance(exc, RuntimeError) and any(m in text for m in _COMMUNICATION_MARKERS)


#: Where a thread waits for peers: inside torch.distributed, or in a backward pass
#: (DDP's all-reduce runs under it).
_WAITING_IN = (
    os.path.join("torch", "distributed", ""),
    os.path.join("torch", "autograd", ""),
)


def _beat(status: StatusFile, main: int) -> None:
    """Start the thread that shows the agent this process is alive, and whether its
    training thread waits inside a collective: a rank stuck waiting for a stalled
    peer is not the one to blame."""

    def run() -> None:
        beat = 0
        while True:
            beat += 1
            frame = sys._current_frames().get(main)
            waiting = False
            while frame is not None and not waiting:
                waiting = any(part in frame.f_code.co_filename for part in _WAITING_IN)
                frame = frame.f_back
            status.write_beat(beat, waiting)
            time.sleep(BEAT_PERIOD)

    threading.Thread(target=run, name="rallypoint-live-beat", daemon=True).start()


def _name_groups_afresh() -> None:
    """Give the round's default process group the name every rank gives it.

    torch names a default group after a process-wide count of the groups made since
    the default group was last destroyed ("0" for the first), and keys what the
    group posts in the store under that name. It counts the group before the
    rendezvous, and only ``destroy_process_group()`` sets the count back, so a
    forming that failed (a round superseded while its group formed, which the
    switch breaks on purpose: ``Act.BREAK_AND_TAKE``) leaves it at 1 with no group
    to destroy. The next round's group is then "1" in this process and "0" in a
    fresh peer; neither ever sees the other's keys, and the forming waits out the
    group's timeout while the agent, whose worker took the round, waits too. With
    no default group, no group of this process bears a name from the count, so it
    starts again from 0, as a destroy would have set it."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():
        world.group_count = 0


def _nccl_groups() -> list[Any]:
    """This process's NCCL process groups (the default one at least)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", None) or [dist.group.WORLD])
    found = []
    for group in groups:
        with contextlib.suppress(Exception):
            if "nccl" in str(dist.get_backend(group)):
                found.append(group)
    return found


def _opened_since(before: Mapping[int, str]) -> dict[int, str]:
    """The sockets this process opened since ``before`` was taken (:func:`_sockets`)."""
    return {fd: inode for fd, inode in _sockets().items() if before.get(fd) != inode}


def _shut_down(sockets: Mapping[int, str]) -> None:
    """Shut down ``sockets`` (descriptor -> what it named) that are still open, so
    that whatever waits on them fails now."""
    current = _sockets()
    for fd, inode in sockets.items():
        if current.get(fd) != inode:
            continue  # closed, or the number reused since
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            # A listener is left alone: gloo's accept loop aborts the process
            # on a listener shut under it.
            with contextlib.suppress(OSError):
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _sockets() -> dict[int, str]:
    """This process's socket descriptors and what they name (``socket:[inode]``)."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:"):
                    found[int(name)] = target
    return found


class Round:
    """One round of a :class:`Job`: the process group is formed and the state synced.

    Attributes:
        number: the rendezvous round (``RALLYPOINT_ROUND``, the same on every rank).
        rank, world_size, local_rank: this worker's place in the round.
        interrupted: the round ended for a new one (set once its block is left).
    """

    def __init__(self, job: Job, side: Any) -> None:
        self.job = job
        self.number = job.round
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.interrupted = False
        self.failure: BaseException | None = None
        self.step_seconds = 0.0
        self._side = side
        self._open = True
        self._check_at = job.step + 1
        self._flag = torch.zeros(2, dtype=torch.int64)
        self._check: Any = None
        self._first = True
        if job.live:
            self._agree(pending=False, interval=1)

    @property
    def group(self) -> Any:
        """The round's process group (the default group)."""
        return dist.group.WORLD

    def steps(self, total: int) -> Iterator[int]:
        """Yield the step numbers from ``job.step`` up to ``total``; after each, commit
        it (``job.step += 1``, reported to the agent). Stops early, at the same step on
        every rank, when a new round is due."""
        job = self.job
        last = time.monotonic()
        while job.step < total:
            yield job.step
            job._commit()
            now = time.monotonic()
            took = now - last
            self.step_seconds = 0.8 * self.step_seconds + 0.2 * took if self.step_seconds else took
            last = now
            if self._first:
                self._first = False
                job._first_step()
            if job.live and check_due(job.step, self._check_at) and self._switch_now():
                self.interrupted = True
                return

    def _switch_now(self) -> bool:
        """At an agreed step: read the last agreement (is a round pending anywhere?),
        and start the next one in the background."""
        self._check.wait()
        pending, interval = (int(v) for v in self._flag.tolist())
        outcome = at_check(Agreement(bool(pending), interval), self.job.step)
        if outcome.switch:
            return True
        self._check_at = outcome.next_check
        inbox = self.job._inbox
        newest = inbox.newer_than(self.number) if inbox is not None else None
        mine = offered(None if newest is None else newest.round, self.number)
        self._agree(pending=mine, interval=check_interval(self.step_seconds, CHECK_PERIOD))
        return False

    def _agree(self, *, pending: bool, interval: int) -> None:
        self._flag = torch.tensor([int(pending), interval], dtype=torch.int64)
        self._check = dist.all_reduce(
            self._flag, op=dist.ReduceOp.MAX, group=self._side, async_op=True
        )

    def settle(self) -> None:
        """Wait for the round's agreement in flight, if any (once the round is broken
        it ends at once, with an error that is of no interest any more), and let go of
        the side group: a gloo group that lives on into interpreter exit can abort the
        process while it is torn down."""
        check, self._check = self._check, None
        if check is not None:
            with contextlib.suppress(Exception):
                check.wait()
        self._side = None

    def abort(self) -> None:
        """Break the round's communication (:meth:`Job.abort`) while it is open."""
        if self._open:
            self.job.abort()

    def __enter__(self) -> Round:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._open = False
        if exc is None:
            return False
        if isinstance(exc, Exception) and self.job._is_lost_peer(exc):
            logger.warning("round %d interrupted: %s", self.number, str(exc).splitlines()[0])
            self.job.abort()  # peers waiting on this rank fail now, not at their timeout
            self.interrupted = True
            self.failure = exc
            return True
        return False
