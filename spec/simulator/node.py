"""One simulated node slot (:class:`SimNode`): its clock, its view and what it is
driving (:class:`Task`)."""

from __future__ import annotations

import math

from ...core import Membership, NodeDesc, NodeView, Operator, RendezvousNode, Settings
from ...core.newcomers import NewcomerView
from ..model.lifecycle import Name, Phase

__all__ = ["SimNode", "Task"]


class Task(Name):
    """What a node is driving."""

    #: an operation (join, exit, close)
    OP = "op"
    #: a keep-alive (the handler's heartbeat loop)
    BEAT = "beat"
    #: the agent's monitor pass
    MONITOR = "monitor"


class SimNode:
    """One node slot: a process that may crash and come back with a new pid."""

    __slots__ = (
        "alive",
        "core",
        "desc",
        "drift",
        "healed_at",
        "incarnation",
        "joined",
        "leaving",
        "losses",
        "mwait",
        "newcomers",
        "newcomers_ready_at",
        "next_beat",
        "next_monitor",
        "offset",
        "outside",
        "partitioned",
        "phase",
        "queued_beat",
        "queued_monitor",
        "req",
        "slot",
        "task",
        "ticks",
        "waiting",
        "watch_q",
        "wtok",
    )

    def __init__(self, slot: int, offset: float, drift: float, settings: Settings) -> None:
        self.slot = slot
        self.offset = offset
        self.drift = drift
        self.incarnation = 0
        self.desc = NodeDesc(f"10.0.{slot // 250}.{slot % 250 + 1}", 1000, 0)
        self.alive = False
        self.partitioned = False
        self.healed_at = -math.inf
        self.phase: Phase = Phase.DOWN
        #: the node this process drives: its view, the state version it last read
        #: or wrote (its compare-and-set token), its operator and deadline
        self.core = RendezvousNode(self.desc, settings)
        #: the task being driven (None: none)
        self.task: Task | None = None
        #: the token of the request, wait or backoff in flight (events of older
        #: ones are dropped), whether it is a driver Wait, and the CAS losses in a row
        self.req = 0
        self.waiting = False
        self.losses = 0
        #: the phase watch: its token, and the phase it is registered under at the
        #: backend (None: not registered); mwait: the agent's monitor is waiting
        self.wtok = 0
        self.watch_q: int | None = None
        self.mwait = False
        #: training: the round joined, the timers (local times) and queued ticks
        self.joined: Membership | None = None
        self.ticks = 0
        self.next_beat = math.inf
        self.next_monitor = math.inf
        self.queued_beat = False
        self.queued_monitor = False
        #: whether the node's exit is a graceful leave (the process then stays
        #: down a while) rather than the first half of a re-rendezvous
        self.leaving = False
        #: live: what the node knew when it last asked the admission rule about
        #: newcomers still starting (None: none start), when they are ready
        #: (simulated time), and whether it is out of the rendezvous meanwhile
        self.newcomers: NewcomerView | None = None
        self.newcomers_ready_at = -math.inf
        self.outside = False

    @property
    def view(self) -> NodeView:
        """What this node knows (the node's view)."""
        return self.core.view

    @property
    def op(self) -> Operator | None:
        """The operator being driven (None: none)."""
        return self.core.op if self.task is not None else None

    @property
    def deadline(self) -> float:
        """The operation's deadline (local time)."""
        return self.core.deadline

    def local(self, t: float) -> float:
        return self.offset + (1.0 + self.drift) * t

    def global_time(self, local: float) -> float:
        return (local - self.offset) / (1.0 + self.drift)
