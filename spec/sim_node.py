"""One simulated node slot (:class:`SimNode`): its clock, its view and what it is
driving (:class:`Task`)."""

from __future__ import annotations

import math

from ..core import Membership, NodeDesc, NodeView, Operator
from .lifecycle import Name, Phase

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
        "deadline",
        "desc",
        "drift",
        "healed_at",
        "incarnation",
        "joined",
        "leaving",
        "losses",
        "mwait",
        "next_beat",
        "next_monitor",
        "offset",
        "op",
        "partitioned",
        "phase",
        "queued_beat",
        "queued_monitor",
        "registered",
        "req",
        "sent",
        "slot",
        "task",
        "ticks",
        "version",
        "view",
        "waiting",
        "watch_q",
        "wtok",
    )

    def __init__(self, slot: int, offset: float, drift: float) -> None:
        self.slot = slot
        self.offset = offset
        self.drift = drift
        self.incarnation = 0
        self.desc = NodeDesc(f"10.0.{slot // 250}.{slot % 250 + 1}", 1000, 0)
        self.alive = False
        self.partitioned = False
        self.healed_at = -math.inf
        self.phase: Phase = Phase.DOWN
        #: what this node knows (the driver's view) and the state version it last
        #: read or wrote (its compare-and-set token; 0: nothing read)
        self.view = NodeView()
        self.version = 0
        #: the task being driven (None: none), its operator and its deadline
        #: (local time)
        self.task: Task | None = None
        self.op: Operator | None = None
        self.deadline = math.inf
        #: the token of the request, wait or backoff in flight (events of older
        #: ones are dropped), whether it is a driver Wait, the CAS losses in a row,
        #: and whether this process has created its heartbeat key
        self.req = 0
        #: local time the request in flight was sent (a renewal counts from then)
        self.sent = 0.0
        self.waiting = False
        self.losses = 0
        self.registered = False
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

    def local(self, t: float) -> float:
        return self.offset + (1.0 + self.drift) * t

    def global_time(self, local: float) -> float:
        return (local - self.offset) / (1.0 + self.drift)
