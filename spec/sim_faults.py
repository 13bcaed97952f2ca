"""The faults the simulator injects (:class:`Faults`): crashes, partitions from
the backend, graceful leaves, workers' failures and failed health checks, each at
a rate per node per minute (:class:`Fault`), and the methods that inject one now
(the hypothesis machines call them directly)."""

from __future__ import annotations

import math
from typing import Any

from ..core import ChargeRestartOp, CloseOp, ExcludeOp, LeaveOp
from .lifecycle import Name, Phase
from .sim_executor import Executor
from .sim_node import SimNode

__all__ = ["Fault", "Faults"]


class Fault(Name):
    """A fault the simulator injects at a rate per node (see SimConfig)."""

    CRASH = "crash"
    PARTITION = "partition"
    LEAVE = "leave"
    #: a training node's workers fail
    WORKER_FAILURE = "worker-failure"
    #: a node fails its health check
    HEALTH_CHECK = "health-check"


class Faults(Executor):
    """Fault injection: scheduled at the configured rates, or called directly."""

    def _exp(self, per_minute: float) -> float:
        return self.rng.expovariate(per_minute / 60.0) if per_minute > 0 else math.inf

    def _schedule_faults(self, node: SimNode) -> None:
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
        if self.now + delay < self.config.duration:
            self._at(self.now + delay, "fault", node.slot, -1, fault)

    # -- faults (also called directly by the hypothesis machines) ----------------

    def crash(self, slot: int) -> None:
        """Kill node ``slot``'s process now; it restarts after ``restart_delay``."""
        node = self.nodes[slot]
        if not node.alive:
            return
        self._log(node, "crashes")
        self.report.crashes += 1
        self._stop(node)
        self._at(self.now + self.config.restart_delay, "arrive", slot)

    def partition(self, slot: int, duration: float | None = None) -> None:
        """Cut node ``slot`` off the backend (for ``duration``, or until healed)."""
        node = self.nodes[slot]
        if node.partitioned:
            return
        node.partitioned = True
        self.report.partitions += 1
        self._log(node, "partitioned from the backend")
        if duration is not None:
            self._at(self.now + duration, "heal", slot)

    def heal(self, slot: int) -> None:
        """Reconnect node ``slot`` to the backend."""
        node = self.nodes[slot]
        if node.partitioned:
            node.partitioned = False
            node.healed_at = self.now
            self._log(node, "reconnected")

    def leave(self, slot: int) -> None:
        """Node ``slot`` leaves gracefully (the handler's ``leave()``: stop the
        heartbeats, exit) and its process stays down for ``restart_delay``."""
        node = self.nodes[slot]
        if not node.alive or node.phase not in (Phase.TRAINING, Phase.JOINING):
            return
        self.report.leaves += 1
        self._log(node, "leaves")
        deadline = node.local(self.now) + self.settings.close_timeout
        self._begin(node, LeaveOp(), deadline, Phase.EXITING, fresh=False)
        node.leaving = True
        self._drive(node)

    def fail_workers(self, slot: int) -> None:
        """The workers of node ``slot`` fail while it trains: as the agent does, it
        counts the failure in the restart budget for the round it trained in,
        then exits that round and joins the next (the failure after the budget is
        spent closes the rendezvous, and the node stops)."""
        node = self.nodes[slot]
        if not node.alive or node.phase is not Phase.TRAINING or node.joined is None:
            return
        self.report.worker_failures += 1
        round_ = node.joined.round
        self._log(node, f"workers failed in round {round_}: charges the restart budget")
        deadline = node.local(self.now) + self.settings.join_timeout
        self._begin(node, ChargeRestartOp(round_), deadline, Phase.JOINING, fresh=False)
        self._drive(node)

    def fail_health_check(self, slot: int) -> None:
        """Node ``slot`` fails its health check while it trains or joins: it
        excludes itself (leaves its round, sits out ``exclusion_rounds`` rounds),
        then joins again, standing by as a spare while excluded."""
        node = self.nodes[slot]
        if not node.alive or node.phase not in (Phase.TRAINING, Phase.JOINING):
            return
        if isinstance(node.op, (ChargeRestartOp, ExcludeOp)):
            return  # the agent finishes what it does for a failure first
        self.report.health_failures += 1
        self._log(node, "fails its health check: excludes itself")
        deadline = node.local(self.now) + self.settings.join_timeout
        self._begin(node, ExcludeOp(), deadline, Phase.JOINING, fresh=False)
        self._drive(node)

    def arrive(self, slot: int) -> None:
        """Start node ``slot`` now if it is down (a new process joins)."""
        self._on_arrive(self.nodes[slot], None)

    def close(self, slot: int) -> None:
        """Node ``slot`` closes the rendezvous (the handler's ``shutdown()``)."""
        node = self.nodes[slot]
        if node.alive and node.phase in (Phase.TRAINING, Phase.JOINING):
            deadline = node.local(self.now) + self.settings.close_timeout
            self._begin(node, CloseOp(), deadline, Phase.CLOSING, fresh=False)
            self._drive(node)

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
