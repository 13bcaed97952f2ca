"""The executor of the core's nodes (:class:`Executor`): each simulated node steps
its :class:`~rallypoint.core.RendezvousNode`, carries the instruction out against
the simulated backend as StateSync does, with the IO turned into events, and
feeds the result back to the node."""

from __future__ import annotations

from typing import Any

from ..core import (
    Announce,
    AnnounceResult,
    Beat,
    BeatResult,
    Done,
    Read,
    ReadResult,
    Unreachable,
    Verdict,
    Wait,
    WaitResult,
    Write,
    WriteResult,
)
from .sim_agent import Agent
from .sim_node import SimNode, Task

__all__ = ["Executor"]


class Executor(Agent):
    """The nodes' driving loop, their requests and waits, and the results coming
    back."""

    # -- carrying out instructions ---------------------------------------------------

    def _drive(self, node: SimNode) -> None:
        """Decide and carry out instructions until one needs the backend or time
        (StateSync._drive, with the IO turned into events)."""
        report = self.report
        stats = report.stats[node.slot]
        while node.task is not None:
            instruction = node.core.next(node.local(self.now))
            report.node_steps += 1
            stats.steps += 1
            if self._on_instruction is not None:
                self._on_instruction(node.slot, instruction)
            if type(instruction) is Read:
                data = (instruction.counters, instruction.intents, instruction.state)
                self._request(node, "backend_read", data)
                return
            if type(instruction) is Write:
                if instruction.action is not None or instruction.dead:
                    what = "publish" if instruction.action is None else instruction.action.name
                    self._log(node, f"{self._task_name(node)} -> {what}")
                self._request(node, "backend_cas", (node.core.token, instruction))
                return
            if type(instruction) is Beat:
                self._request(node, "backend_beat")
                return
            if type(instruction) is Announce:
                self._request(node, "backend_announce", instruction.round)
                return
            if type(instruction) is Wait:
                self._wait(node, instruction.until, instruction.phase, node.local(self.now))
                return
            if type(instruction) is Done:
                if not self._done(node, instruction):
                    return
                continue
            assert type(instruction) is Verdict
            if not self._verdict(node, instruction):
                return

    @staticmethod
    def _task_name(node: SimNode) -> str:
        return "monitor" if node.task is Task.MONITOR else type(node.op).__name__

    def _request(self, node: SimNode, kind: str, data: Any = None) -> None:
        node.req += 1
        if node.partitioned:
            self._at(self.now + self.config.request_timeout, "request_timeout", node.slot, node.req)
            return
        self._at(self.now + self._delay(), kind, node.slot, node.req, data)

    def _wait(self, node: SimNode, until: float | None, phase: int, now: float) -> None:
        """StateSync._wait: wait_for_phase(phase), with a wake at ``until`` (just
        past it) or after poll_interval, whichever comes first."""
        timeout = self.config.poll_interval
        if until is not None:
            timeout = min(timeout, max(0.0, until - now) + self.config.wake_epsilon)
        node.req += 1
        node.waiting = True
        self._at(node.global_time(now + timeout), "wake", node.slot, node.req)
        self._watch(node, phase)

    def _end_wait(self, node: SimNode) -> None:
        node.waiting = False
        node.req += 1  # drop the other of notification and wake
        self._unwatch(node)
        self.report.stats[node.slot].wakeups += 1
        node.core.feed(WaitResult(), node.local(self.now))

    def _on_notify(self, node: SimNode, data: Any) -> None:
        node.watch_q = None
        self.report.stats[node.slot].notifications += 1
        if node.waiting:
            self._end_wait(node)
            self._drive(node)
        elif node.mwait:
            self._end_monitor_wait(node)
            if node.task is None and self._idle(node):
                self._drive(node)

    # -- results coming back -------------------------------------------------------------

    def _on_response(self, node: SimNode, data: Any) -> None:
        now = node.local(self.now)
        what = data[0]
        if what == "read":
            # (state None: Read(state=False), the node keeps its state and token)
            _, state, version, side, log = data
            node.core.feed(ReadResult(state, version, side, log), now)
        elif what == "cas":
            _, won, stored, version, _write = data
            node.core.feed(WriteResult(won, stored, version), now)
            if not won:
                node.losses += 1
                # StateSync's jittered, capped exponential backoff before deciding again.
                cap = min(self.config.max_backoff, 0.001 * 2 ** min(node.losses, 16))
                self._at(self.now + self.rng.uniform(0, cap), "retry", node.slot, node.req)
                return
            node.losses = 0
        elif what == "announce":
            node.core.feed(AnnounceResult(), now)
        else:  # a beat
            node.core.feed(BeatResult(data[1]), now)
        self._drive(node)

    def _on_retry(self, node: SimNode, data: Any) -> None:
        self._drive(node)

    def _on_wake(self, node: SimNode, data: Any) -> None:
        if not node.waiting:
            return
        self._end_wait(node)
        self._drive(node)

    def _on_request_timeout(self, node: SimNode, data: Any) -> None:
        self.report.stats[node.slot].timeouts += 1
        self._log(node, "request timed out")
        if node.task is Task.OP:
            # An operation retries (StateSync within its retry window): read again.
            node.core.feed(Unreachable(), node.local(self.now))
            self._drive(node)
            return
        if node.task is Task.MONITOR:
            # The agent's monitor pass failed: it waits and checks again.
            self._monitor_wait(node)
        # A heartbeat or monitor pass gives up until its next tick.
        if self._idle(node):
            self._drive(node)
