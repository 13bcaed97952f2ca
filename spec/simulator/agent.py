"""A simulated agent (:class:`SimAgent`, one per node slot): what the handler and
the agent do around the driver -- a node's process starting and stopping,
starting operations, acting on an operation's end (Done) and on the monitor's
Verdict, a training node's heartbeats and monitor passes -- and the loop that
steps the node's :class:`~rallypoint.core.RendezvousNode`, handing each
instruction for the store to its :class:`~.executor.SimExecutor` (the core's
dispatch, as StateSync and AsyncRendezvous carry instructions out)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ...core import (
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
    NodeInstruction,
    Operator,
    RendezvousNode,
    RendezvousState,
    Settings,
    Verdict,
    Write,
    keep_alive_period,
)
from ...core.driver import MemberResponse, member_response
from ...core.newcomers import Admission, NewcomerView, admission
from ..model.lifecycle import Phase
from .backend import Backend
from .checks import Checks
from .events import EventLoop
from .executor import SimExecutor
from .node import SimNode, Task

__all__ = ["AGENT_EVENTS", "SimAgent"]

#: The events a node's agent handles (each by its method ``on_<kind>``; its
#: executor's are in :data:`~.executor.EXECUTOR_EVENTS`).
AGENT_EVENTS = (
    "arrive",
    "tick",
    "notify",
    "request_timeout",
    "newcomers_ready",
)


class SimAgent:
    """The agent and handler of one node slot, stepping its core.

    Args:
        node: the slot it drives (its clock, its core, its tokens).
        loop: the run's event loop (its clock, random numbers, trace, report).
        backend: the simulated backend its requests go to.
        checks: what checks the joins that return.
        settings: the rendezvous settings of the run.
        by_desc: the simulated node of each current process (a restarted
            process is entered under its new name).
        on_instruction: called with ``(slot, instruction)`` for every
            instruction the node is about to carry out.
    """

    def __init__(
        self,
        node: SimNode,
        loop: EventLoop,
        backend: Backend,
        checks: Checks,
        settings: Settings,
        by_desc: dict[NodeDesc, SimNode],
        on_instruction: Callable[[int, NodeInstruction], None] | None = None,
    ) -> None:
        self.node = node
        self.loop = loop
        self.backend = backend
        self.checks = checks
        self.settings = settings
        self.config = loop.config
        self.report = loop.report
        self.stats = loop.report.stats[node.slot]
        self._by_desc = by_desc
        self._on_instruction = on_instruction
        #: carries the node's instructions out against the backend
        self.executor = SimExecutor(node, loop, backend, self.drive)

    # -- lifecycle ---------------------------------------------------------------

    def stop(self) -> None:
        """The node's process stops: whatever it drives, waits for or trains ends
        (its pending events are dropped)."""
        node = self.node
        node.alive = False
        node.phase = Phase.DOWN
        self._cancel()
        node.ticks += 1
        node.task = None
        node.joined = None
        node.queued_beat = node.queued_monitor = False
        node.newcomers = None
        node.newcomers_ready_at = -math.inf
        node.outside = False

    def _cancel(self) -> None:
        """Forget the request, wait, watch or backoff in flight (their events are
        dropped)."""
        node = self.node
        self.executor.cancel()
        node.mwait = False
        self.backend.unwatch(node)

    def on_arrive(self, data: Any) -> None:
        """A process starts in the slot, if none runs there (after a crash or a
        stop: a new one, with a new pid), and regroups: exit, then join."""
        node = self.node
        if node.alive or node.phase is Phase.CLOSED:
            return
        node.alive = True
        if node.incarnation:
            self._by_desc.pop(node.desc, None)
            node.desc = NodeDesc(node.desc.addr, 1000 + node.incarnation, 0)
            self._by_desc[node.desc] = node
        node.incarnation += 1
        node.core = RendezvousNode(node.desc, self.settings)
        self.loop.log(node, f"starts as {node.desc}")
        if self._start_outside():
            return
        self._regroup()
        self.drive()

    # -- live: newcomers start outside the group (the core's admission rule) --------

    def _start_outside(self) -> bool:
        """Live: a starting node's workers start now. Ask the admission rule, as the
        agent does before its first round; True: the node stays out of the
        rendezvous until they are ready, because a round runs without it."""
        if self.config.newcomer_startup is None:
            return False
        # What the agent's first read tells it (running_round_size).
        state = self.backend.state
        running = len(state.participants) if state.complete and not state.closed else 0
        view = NewcomerView(
            ready=False,
            member=False,
            may_shrink=False,
            others=running,
            min_nodes=self.settings.min_nodes,
        )
        if not self._newcomers_start(view):
            return False
        node = self.node
        node.phase = Phase.IDLE
        self.loop.log(node, f"joins once its workers are ready ({running} nodes train)")
        return True

    def _replace_outside(self, state: RendezvousState) -> bool:
        """Live: the failed workers' replacements start now. Ask the admission rule,
        as the agent does; True: the node steps out of its round (a leave that keeps
        its process) until they are ready, so that the others train on."""
        if self.config.newcomer_startup is None:
            return False
        node = self.node
        others = len(set(state.participants) - {node.desc})
        view = NewcomerView(
            ready=False,
            member=True,
            may_shrink=self.config.may_shrink,
            others=others,
            min_nodes=self.settings.min_nodes,
        )
        if not self._newcomers_start(view):
            return False
        self.loop.log(node, f"steps out while its workers are replaced ({others} others)")
        self.begin(LeaveOp(), node.deadline, Phase.JOINING, fresh=True)
        return True

    def _newcomers_start(self, view: NewcomerView) -> bool:
        """Newcomers start, ready after ``newcomer_startup``; True: the rule says
        to be out of the rendezvous meanwhile."""
        node = self.node
        assert self.config.newcomer_startup is not None
        node.newcomers = view
        node.newcomers_ready_at = self.loop.now + self.config.newcomer_startup
        self.loop.at(node.newcomers_ready_at, "newcomers_ready", node.slot, data=node.incarnation)
        node.outside = admission(view) is Admission.STEP_OUT
        if node.outside:
            self.report.stepped_out += 1
        else:
            self.report.joined_unready += 1
        return node.outside

    def on_newcomers_ready(self, incarnation: int) -> None:
        """The node's newcomers are ready: it asks the rule again, and joins if it
        was out (a node whose leave still runs joins once the leave is done)."""
        node = self.node
        view = node.newcomers
        if not node.alive or incarnation != node.incarnation or view is None:
            return  # of an earlier process
        ready = dataclasses.replace(view, ready=True)
        node.newcomers = None
        answer = admission(ready)
        self.checks.newcomers_ready(node, ready, answer)
        if not node.outside or answer is not Admission.JOIN:
            return
        node.outside = False
        self.loop.log(node, "its workers are ready: joins")
        if node.task is None:
            self._regroup()
            self.drive()

    def begin(self, op: Operator, deadline: float, phase: Phase, fresh: bool) -> None:
        """Start an operation (StateSync.run): stop the heartbeats, the monitor and
        whatever the node was doing; unless ``fresh``, the first decision reads."""
        node = self.node
        self._cancel()
        node.ticks += 1
        node.queued_beat = node.queued_monitor = False
        node.task = Task.OP
        node.core.start(op, node.local(self.loop.now), deadline, fresh=fresh)
        node.phase = phase
        node.losses = 0
        node.leaving = False

    def _regroup(self) -> None:
        """The handler's next_rendezvous: exit the current round, then join."""
        node = self.node
        deadline = node.local(self.loop.now) + self.settings.join_timeout
        self.begin(ExitOp(), deadline, Phase.JOINING, fresh=False)

    # -- what the handler and the agent do with Done and Verdict -----------------------

    def _done(self, done: Done) -> bool:
        """Act on an operation's end; True: the node drives on (a next operation)."""
        node = self.node
        if node.task is Task.BEAT:
            return self._idle()  # a failed keep-alive is only logged
        op, action = node.op, done.action
        if isinstance(op, (ChargeRestartOp, ExcludeOp)) and action is Action.FINISH:
            if done.state.closed:
                # The budget is spent (this charge closed it) or the job ended.
                self.loop.log(node, f"{type(op).__name__} -> the rendezvous is closed: stops")
                self._stop_closed()
                return False
            # Charged: leave the round (live: maybe out of the rendezvous while the
            # replacements start), then join the next; excluded (out of its
            # round already): join again, as a spare while excluded. Either
            # decides on the view its write left (fresh).
            if isinstance(op, ChargeRestartOp) and self._replace_outside(done.state):
                return True
            after = ExitOp() if isinstance(op, ChargeRestartOp) else JoinOp()
            self.begin(after, node.deadline, Phase.JOINING, fresh=True)
            return True
        if isinstance(op, (ExitOp, LeaveOp)) and action is Action.FINISH:
            if node.leaving:
                self.stop()
                self.loop.at(self.loop.now + self.config.restart_delay, "arrive", node.slot)
                return False
            if node.outside:
                # Out of the rendezvous until its newcomers are ready (then it joins).
                node.task = None
                node.phase = Phase.EXITED
                return False
            # next_rendezvous: the join decides on the exit's view (fresh).
            self.begin(JoinOp(), node.deadline, Phase.JOINING, fresh=True)
            return True
        if isinstance(op, JoinOp) and action is Action.FINISH:
            if done.rejoin:
                self.loop.log(node, f"round {done.state.round} lost its rank 0: rejoins")
                self.begin(ExitOp(), node.deadline, Phase.JOINING, fresh=False)
                return True
            self._joined(done)
            return False
        self.loop.log(node, f"{type(op).__name__} -> {action.name}")
        if (action is Action.FINISH and isinstance(op, CloseOp)) or action in (
            Action.ERROR_CLOSED,
            Action.ERROR_GRACEFUL_EXIT,
        ):
            self._stop_closed()
            return False
        # ERROR_TIMEOUT: the agent gives up on this attempt and starts over.
        self.report.timeouts += 1
        self.stop()
        self.loop.at(self.loop.now + self.config.restart_delay, "arrive", node.slot)
        return False

    def _stop_closed(self) -> None:
        """The rendezvous is closed: the node stops for good."""
        node = self.node
        self.stop()
        node.phase = Phase.CLOSED

    def _joined(self, done: Done) -> None:
        """The join returned: check agreement, then train (heartbeats and monitor)."""
        node = self.node
        joined = done.joined
        assert joined is not None
        self.loop.log(node, f"joined round {joined.round} as rank {joined.rank}")
        self.checks.join_returned(node.desc, done, joined)
        node.phase = Phase.TRAINING
        node.joined = joined
        node.task = None
        node.next_beat = node.local(self.loop.now) + keep_alive_period(self.settings)
        self._monitor_wait()

    def _verdict(self, verdict: Verdict) -> bool:
        """The agent's monitor: stop once the rendezvous is closed (elsewhere: the
        budget spent, or the job ended), regroup on waiting nodes or lost
        participants, else wait for the next phase (or monitor_interval) and
        check again."""
        node = self.node
        response = member_response(verdict, node.view.state)
        if response is MemberResponse.CLOSED:
            self.loop.log(node, "the rendezvous is closed: stops its workers")
            self._stop_closed()
            return False
        if response is MemberResponse.REGROUP:
            reason = "peer lost" if verdict.lost else "nodes waiting"
            self.loop.log(node, f"re-rendezvous: {reason}")
            self._regroup()
            return True
        self._monitor_wait()
        return self._idle()

    # -- training: heartbeats and the agent's monitor -----------------------------

    def _monitor_wait(self) -> None:
        """The agent's ``wait_for_change(monitor_interval)``: a phase watch on the
        view's phase, and the monitor's timer."""
        node = self.node
        node.mwait = True
        node.next_monitor = node.local(self.loop.now) + self.config.monitor_interval
        self.backend.watch(node, node.view.state.phase)
        self._schedule_tick()

    def _end_monitor_wait(self) -> None:
        """The monitor's wait ended (a phase, or its timer): a pass is due."""
        node = self.node
        node.mwait = False
        self.backend.unwatch(node)
        self.stats.wakeups += 1
        node.queued_monitor = True
        node.next_monitor = math.inf
        self._schedule_tick()

    def _schedule_tick(self) -> None:
        node = self.node
        node.ticks += 1  # one pending tick per node
        due = min(node.next_beat, node.next_monitor)
        if due < math.inf:
            self.loop.at(node.global_time(due), "tick", node.slot, node.ticks, due)

    def on_tick(self, due: float) -> None:
        """A training timer is due (local time ``due``): fence if the lease ran
        out, else queue the heartbeat or monitor pass it is for."""
        node = self.node
        if node.phase is Phase.TRAINING and node.core.must_fence(due):
            # The agent's lease check: its workers stop, and it rejoins (it cannot
            # reach the store to leave first).
            self.report.fences += 1
            self.loop.log(node, "lease ran out: fences (stops its workers) and rejoins")
            self._regroup()
            self.drive()
            return
        if node.next_beat <= due:
            node.queued_beat = True
            node.next_beat += keep_alive_period(self.settings)
        if node.next_monitor <= due and node.mwait:
            self._end_monitor_wait()
        self._schedule_tick()
        if node.task is None and self._idle():
            self.drive()

    def _idle(self) -> bool:
        """A training node's task ended: start a queued one. True: drive it now."""
        node = self.node
        node.task = None
        if node.queued_beat:
            # The handler's heartbeat loop: KeepAliveOp on the current view (fresh).
            node.queued_beat = False
            node.task = Task.BEAT
            now = node.local(self.loop.now)
            node.core.start(KeepAliveOp(), now, now + self.settings.heartbeat_timeout, fresh=True)
            node.losses = 0
            return True
        if node.queued_monitor:
            # The agent's num_nodes_waiting / dead_participants (StateSync.watch):
            # the view is stale, so the driver's monitor reads first (with the
            # counters when they are due).
            node.queued_monitor = False
            node.task = Task.MONITOR
            node.losses = 0
            node.core.watch(node.joined)
            return True
        return False

    # -- stepping the node ---------------------------------------------------------

    def drive(self) -> None:
        """Decide and carry out instructions until one needs the backend or time
        (StateSync._drive, with the IO turned into events by the executor)."""
        node = self.node
        report = self.report
        stats = self.stats
        carry_out = self.executor.carry_out
        while node.task is not None:
            instruction = node.core.next(node.local(self.loop.now))
            report.node_steps += 1
            stats.steps += 1
            if self._on_instruction is not None:
                self._on_instruction(node.slot, instruction)
            if type(instruction) is Done:
                if not self._done(instruction):
                    return
                continue
            if type(instruction) is Verdict:
                if not self._verdict(instruction):
                    return
                continue
            if type(instruction) is Write and (instruction.action is not None or instruction.dead):
                what = "publish" if instruction.action is None else instruction.action.name
                self.loop.log(node, f"{self._task_name()} -> {what}")
            if not carry_out(instruction):
                return

    def _task_name(self) -> str:
        node = self.node
        return "monitor" if node.task is Task.MONITOR else type(node.op).__name__

    def on_notify(self, data: Any) -> None:
        """A phase above the watched one was published: a Wait or the
        monitor's wait ends."""
        node = self.node
        node.watch_q = None
        self.stats.notifications += 1
        if node.waiting:
            self.executor.end_wait(True)
            self.drive()
        elif node.mwait:
            self._end_monitor_wait()
            if node.task is None and self._idle():
                self.drive()

    def on_request_timeout(self, data: Any) -> None:
        """The request in flight was lost (the node is partitioned)."""
        node = self.node
        self.stats.timeouts += 1
        self.loop.log(node, "request timed out")
        if node.task is Task.OP:
            # An operation retries (StateSync within its retry window): read again.
            self.executor.unreachable()
            self.drive()
            return
        if node.task is Task.MONITOR:
            # The agent's monitor pass failed: it waits and checks again.
            self._monitor_wait()
        # A heartbeat or monitor pass gives up until its next tick.
        if self._idle():
            self.drive()
