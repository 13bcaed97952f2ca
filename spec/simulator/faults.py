"""The faults the simulator injects (:class:`FaultInjector`): crashes, partitions
from the backend, graceful leaves, workers' failures and failed health checks,
each at a rate per node per minute (:class:`Fault`), and the methods that inject
one now (the hypothesis machines call them directly, through the Simulator)."""

from __future__ import annotations

import math
from typing import Any

from ...core import ChargeRestartOp, CloseOp, ExcludeOp, LeaveOp, Settings
from ..model.lifecycle import Name, Phase
from .agent import SimAgent
from .events import EventLoop
from .node import SimNode

__all__ = ["Fault", "FaultInjector"]


class Fault(Name):
    """A fault the simulator injects at a rate per node (see SimConfig)."""

    CRASH = "crash"
    PARTITION = "partition"
    LEAVE = "leave"
    #: a training node's workers fail
    WORKER_FAILURE = "worker-failure"
    #: a node fails its health check
    HEALTH_CHECK = "health-check"


class FaultInjector:
    """Fault injection: scheduled at the configured rates, or called directly.
    A fault reaches a node through its agent (which stops it, or starts the
    operation the agent starts on such a failure) or its network (partitions).

    Args:
        loop: the run's event loop; the injector registers ``fault`` and
            ``heal`` there.
        agents: the agent of each node slot.
        settings: the rendezvous settings of the run.
    """

    def __init__(self, loop: EventLoop, agents: list[SimAgent], settings: Settings) -> None:
        self.loop = loop
        self.config = loop.config
        self.report = loop.report
        self.settings = settings
        self.agents = agents
        loop.on("fault", self._on_fault)
        loop.on("heal", self._on_heal)

    def _exp(self, per_minute: float) -> float:
        return self.loop.rng.expovariate(per_minute / 60.0) if per_minute > 0 else math.inf

    def schedule_faults(self, node: SimNode) -> None:
        """Schedule the first fault of each kind of ``node`` (at its rate)."""
        for fault in Fault:
            self._schedule_fault(node, fault, self._exp(self._fault_rate(fault)))

    def _fault_rate(self, fault: Fault) -> float:
        c = self.config
        if fault is Fault.CRASH:
            return c.crash_rate
        if fault is Fault.WORKER_FAILURE:
            return c.worker_failure_rate
        if fault is Fault.HEALTH_CHECK:
            return c.health_failure_rate
        return c.partition_rate if fault is Fault.PARTITION else c.leave_rate

    def _schedule_fault(self, node: SimNode, fault: Fault, delay: float) -> None:
        """The next ``fault`` of ``node`` after ``delay``, if within the run."""
        now = self.loop.now
        if now + delay < self.config.duration:
            self.loop.at(now + delay, "fault", node.slot, -1, fault)

    # -- faults (also called directly by the hypothesis machines) ----------------

    def crash(self, slot: int) -> None:
        """Kill node ``slot``'s process now; it restarts after ``restart_delay``."""
        agent = self.agents[slot]
        node = agent.node
        if not node.alive:
            return
        self.loop.log(node, "crashes")
        self.report.crashes += 1
        agent.stop()
        self.loop.at(self.loop.now + self.config.restart_delay, "arrive", slot)

    def partition(self, slot: int, duration: float | None = None) -> None:
        """Cut node ``slot`` off the backend (for ``duration``, or until healed)."""
        node = self.agents[slot].node
        if node.partitioned:
            return
        node.partitioned = True
        self.report.partitions += 1
        self.loop.log(node, "partitioned from the backend")
        if duration is not None:
            self.loop.at(self.loop.now + duration, "heal", slot)

    def heal(self, slot: int) -> None:
        """Reconnect node ``slot`` to the backend."""
        node = self.agents[slot].node
        if node.partitioned:
            node.partitioned = False
            node.healed_at = self.loop.now
            self.loop.log(node, "reconnected")

    def leave(self, slot: int) -> None:
        """Node ``slot`` leaves gracefully (the handler's ``leave()``: stop the
        heartbeats, exit) and its process stays down for ``restart_delay``."""
        agent = self.agents[slot]
        node = agent.node
        if not node.alive or node.phase not in (Phase.TRAINING, Phase.JOINING):
            return
        self.report.leaves += 1
        self.loop.log(node, "leaves")
        deadline = node.local(self.loop.now) + self.settings.close_timeout
        agent.begin(LeaveOp(), deadline, Phase.EXITING, fresh=False)
        node.leaving = True
        agent.drive()

    def fail_workers(self, slot: int) -> None:
        """The workers of node ``slot`` fail while it trains: as the agent does, it
        counts the failure in the restart budget for the round it trained in,
        then exits that round and joins the next (the failure after the budget is
        spent closes the rendezvous, and the node stops)."""
        agent = self.agents[slot]
        node = agent.node
        if not node.alive or node.phase is not Phase.TRAINING or node.joined is None:
            return
        self.report.worker_failures += 1
        round_ = node.joined.round
        self.loop.log(node, f"workers failed in round {round_}: charges the restart budget")
        deadline = node.local(self.loop.now) + self.settings.join_timeout
        agent.begin(ChargeRestartOp(round_), deadline, Phase.JOINING, fresh=False)
        agent.drive()

    def fail_health_check(self, slot: int) -> None:
        """Node ``slot`` fails its health check while it trains or joins: it
        excludes itself (leaves its round, sits out ``exclusion_rounds`` rounds),
        then joins again, standing by as a spare while excluded."""
        agent = self.agents[slot]
        node = agent.node
        if not node.alive or node.phase not in (Phase.TRAINING, Phase.JOINING):
            return
        if isinstance(node.op, (ChargeRestartOp, ExcludeOp)):
            return  # the agent finishes what it does for a failure first
        self.report.health_failures += 1
        self.loop.log(node, "fails its health check: excludes itself")
        deadline = node.local(self.loop.now) + self.settings.join_timeout
        agent.begin(ExcludeOp(), deadline, Phase.JOINING, fresh=False)
        agent.drive()

    def arrive(self, slot: int) -> None:
        """Start node ``slot`` now if it is down (a new process joins)."""
        self.agents[slot].on_arrive(None)

    def close(self, slot: int) -> None:
        """Node ``slot`` closes the rendezvous (the handler's ``shutdown()``)."""
        agent = self.agents[slot]
        node = agent.node
        if node.alive and node.phase in (Phase.TRAINING, Phase.JOINING):
            deadline = node.local(self.loop.now) + self.settings.close_timeout
            agent.begin(CloseOp(), deadline, Phase.CLOSING, fresh=False)
            agent.drive()

    def _on_fault(self, node: SimNode, fault: Fault) -> None:
        """A fault of ``node`` is due: inject it, and schedule the next one (a
        partition's after it heals)."""
        if fault is Fault.CRASH:
            self.crash(node.slot)
        elif fault is Fault.PARTITION:
            self.partition(node.slot, self.config.partition_duration)
        elif fault is Fault.WORKER_FAILURE:
            self.fail_workers(node.slot)
        elif fault is Fault.HEALTH_CHECK:
            self.fail_health_check(node.slot)
        else:
            self.leave(node.slot)
        delay = self._exp(self._fault_rate(fault))
        if fault is Fault.PARTITION:
            delay += self.config.partition_duration
        self._schedule_fault(node, fault, delay)

    def _on_heal(self, node: SimNode, data: Any) -> None:
        self.heal(node.slot)
