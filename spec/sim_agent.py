"""What the handler and the agent do around the driver (:class:`Agent`): a
node's process starting and stopping, starting operations, acting on an
operation's end (Done) and on the monitor's Verdict, and a training node's
heartbeats and monitor passes."""

from __future__ import annotations

import math
from typing import Any

from ..core import (
    Action,
    ChargeRestartOp,
    CloseOp,
    Done,
    ExcludeOp,
    ExitOp,
    JoinOp,
    KeepAliveOp,
    LeaveOp,
    NodeDesc,
    Operator,
    RendezvousNode,
    Verdict,
    keep_alive_period,
)
from .lifecycle import Phase
from .sim_backend import Backend
from .sim_node import SimNode, Task

__all__ = ["Agent"]


class Agent(Backend):
    """A node's lifecycle, its operations' ends and its training."""

    #: the node that saw the rendezvous closed first (None: open)
    closed_by: NodeDesc | None = None

    def _drive(self, node: SimNode) -> None:
        """Decide and carry out ``node``'s instructions (:class:`.sim_executor.Executor`)."""
        raise NotImplementedError

    # -- lifecycle ---------------------------------------------------------------

    def _stop(self, node: SimNode) -> None:
        node.alive = False
        node.phase = Phase.DOWN
        self._cancel(node)
        node.ticks += 1
        node.task = None
        node.joined = None
        node.queued_beat = node.queued_monitor = False

    def _cancel(self, node: SimNode) -> None:
        """Forget the request, wait, watch or backoff in flight (their events are
        dropped)."""
        node.req += 1
        node.waiting = False
        node.mwait = False
        self._unwatch(node)

    def _on_arrive(self, node: SimNode, data: Any) -> None:
        if node.alive or node.phase is Phase.CLOSED:
            return
        node.alive = True
        if node.incarnation:
            self._by_desc.pop(node.desc, None)
            node.desc = NodeDesc(node.desc.addr, 1000 + node.incarnation, 0)
            self._by_desc[node.desc] = node
        node.incarnation += 1
        node.core = RendezvousNode(node.desc, self.settings)
        self._log(node, f"starts as {node.desc}")
        self._regroup(node)
        self._drive(node)

    def _begin(
        self, node: SimNode, op: Operator, deadline: float, phase: Phase, fresh: bool
    ) -> None:
        """Start an operation (StateSync.run): stop the heartbeats, the monitor and
        whatever the node was doing; unless ``fresh``, the first decision reads."""
        self._cancel(node)
        node.ticks += 1
        node.queued_beat = node.queued_monitor = False
        node.task = Task.OP
        node.core.start(op, node.local(self.now), deadline, fresh=fresh)
        node.phase = phase
        node.losses = 0
        node.leaving = False

    def _regroup(self, node: SimNode) -> None:
        """The handler's next_rendezvous: exit the current round, then join."""
        deadline = node.local(self.now) + self.settings.join_timeout
        self._begin(node, ExitOp(), deadline, Phase.JOINING, fresh=False)

    # -- what the handler and the agent do with Done and Verdict -----------------------

    def _done(self, node: SimNode, done: Done) -> bool:
        """Act on an operation's end; True: the node drives on (a next operation)."""
        if node.task is Task.BEAT:
            return self._idle(node)  # a failed keep-alive is only logged
        op, action = node.op, done.action
        if isinstance(op, (ChargeRestartOp, ExcludeOp)) and action is Action.FINISH:
            if done.state.closed:
                # The budget is spent (this charge closed it) or the job ended.
                self._log(node, f"{type(op).__name__} -> the rendezvous is closed: stops")
                self._stop_closed(node)
                return False
            # Charged: leave the round, then join the next; excluded (out of its
            # round already): join again, as a spare while excluded. Either
            # decides on the view its write left (fresh).
            after = ExitOp() if isinstance(op, ChargeRestartOp) else JoinOp()
            self._begin(node, after, node.deadline, Phase.JOINING, fresh=True)
            return True
        if isinstance(op, (ExitOp, LeaveOp)) and action is Action.FINISH:
            if node.leaving:
                self._stop(node)
                self._at(self.now + self.config.restart_delay, "arrive", node.slot)
                return False
            # next_rendezvous: the join decides on the exit's view (fresh).
            self._begin(node, JoinOp(), node.deadline, Phase.JOINING, fresh=True)
            return True
        if isinstance(op, JoinOp) and action is Action.FINISH:
            if done.rejoin:
                self._log(node, f"round {done.state.round} lost its rank 0: rejoins")
                self._begin(node, ExitOp(), node.deadline, Phase.JOINING, fresh=False)
                return True
            self._joined(node, done)
            return False
        self._log(node, f"{type(op).__name__} -> {action.name}")
        if (action is Action.FINISH and isinstance(op, CloseOp)) or action in (
            Action.ERROR_CLOSED,
            Action.ERROR_GRACEFUL_EXIT,
        ):
            self._stop_closed(node)
            return False
        # ERROR_TIMEOUT: the agent gives up on this attempt and starts over.
        self.report.timeouts += 1
        self._stop(node)
        self._at(self.now + self.config.restart_delay, "arrive", node.slot)
        return False

    def _stop_closed(self, node: SimNode) -> None:
        """The rendezvous is closed: the node stops for good."""
        self.closed_by = self.closed_by or node.desc
        self._stop(node)
        node.phase = Phase.CLOSED

    def _joined(self, node: SimNode, done: Done) -> None:
        """The join returned: check agreement, then train (heartbeats and monitor)."""
        joined = done.joined
        assert joined is not None
        self._log(node, f"joined round {joined.round} as rank {joined.rank}")
        problems = self._agree(node.desc, done, joined)
        if problems:
            self._violate(problems)
        pending = self._round_pending.get(joined.round)
        if pending is not None:
            pending.discard(node.desc)
            self._round_done(joined.round)
        node.phase = Phase.TRAINING
        node.joined = joined
        node.task = None
        node.next_beat = node.local(self.now) + keep_alive_period(self.settings)
        self._monitor_wait(node)

    def _verdict(self, node: SimNode, verdict: Verdict) -> bool:
        """The agent's monitor: stop once the rendezvous is closed (elsewhere: the
        budget spent, or the job ended), regroup on waiting nodes or lost
        participants, else wait for the next phase (or monitor_interval) and
        check again."""
        if node.view.state.closed:
            self._log(node, "the rendezvous is closed: stops its workers")
            self._stop_closed(node)
            return False
        if verdict.waiting or verdict.lost:
            reason = "peer lost" if verdict.lost else "nodes waiting"
            self._log(node, f"re-rendezvous: {reason}")
            self._regroup(node)
            return True
        self._monitor_wait(node)
        return self._idle(node)

    # -- training: heartbeats and the agent's monitor -----------------------------

    def _monitor_wait(self, node: SimNode) -> None:
        """The agent's ``wait_for_change(monitor_interval)``: a phase watch on the
        view's phase, and the monitor's timer."""
        node.mwait = True
        node.next_monitor = node.local(self.now) + self.config.monitor_interval
        self._watch(node, node.view.state.phase)
        self._schedule_tick(node)

    def _end_monitor_wait(self, node: SimNode) -> None:
        """The monitor's wait ended (a phase, or its timer): a pass is due."""
        node.mwait = False
        self._unwatch(node)
        self.report.stats[node.slot].wakeups += 1
        node.queued_monitor = True
        node.next_monitor = math.inf
        self._schedule_tick(node)

    def _schedule_tick(self, node: SimNode) -> None:
        node.ticks += 1  # one pending tick per node
        due = min(node.next_beat, node.next_monitor)
        if due < math.inf:
            self._at(node.global_time(due), "tick", node.slot, node.ticks, due)

    def _on_tick(self, node: SimNode, due: float) -> None:
        if node.phase is Phase.TRAINING and node.core.must_fence(due):
            # The agent's lease check: its workers stop, and it rejoins (it cannot
            # reach the store to leave first).
            self.report.fences += 1
            self._log(node, "lease ran out: fences (stops its workers) and rejoins")
            self._regroup(node)
            self._drive(node)
            return
        if node.next_beat <= due:
            node.queued_beat = True
            node.next_beat += keep_alive_period(self.settings)
        if node.next_monitor <= due and node.mwait:
            self._end_monitor_wait(node)
        self._schedule_tick(node)
        if node.task is None and self._idle(node):
            self._drive(node)

    def _idle(self, node: SimNode) -> bool:
        """A training node's task ended: start a queued one. True: drive it now."""
        node.task = None
        if node.queued_beat:
            # The handler's heartbeat loop: KeepAliveOp on the current view (fresh).
            node.queued_beat = False
            node.task = Task.BEAT
            now = node.local(self.now)
            node.core.start(KeepAliveOp(), now, now + self.settings.heartbeat_timeout, fresh=True)
            node.losses = 0
            return True
        if node.queued_monitor:
            # The agent's num_nodes_waiting / dead_participants (StateSync.monitor):
            # the view is stale, so the driver's monitor reads first (with the
            # counters when they are due).
            node.queued_monitor = False
            node.task = Task.MONITOR
            node.losses = 0
            node.core.watch(node.joined)
            return True
        return False
