"""Driver conformance: the simulator executes the driver exactly as StateSync does.

VOPR's rule is that the simulator runs the production code path. Both executors
here run one scripted scenario on the same clock, with zero latency: node A (the
node under test) joins a rendezvous of min = max = 2 while a peer's writes and beats
are injected at scripted times. A waits alone (a Wait that ends by its timeout);
the peer completes the round (a Wait that ends by a change), beats a while, falls
silent and is declared dead by A (a keep-alive tick publishes the removal, the next
monitor pass reports the peer lost); A regroups (exit, then join), keeps alive by
Beat while it waits alone, and a new peer completes the next round.

StateSync runs against a scripted in-memory backend with an injected clock, driven
the way the handler and the agent drive it (exit then join, a keep-alive every
keep_alive_interval / 4 on the current view, a monitor pass with a fresh read every
monitor_interval); the simulator runs its own node. The two instruction sequences
must be identical, field by field.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import pytest

from rallypoint.adapters import sync as sync_module
from rallypoint.adapters.backend import BackendStats, RendezvousBackend, Token
from rallypoint.adapters.sync import StateSync
from rallypoint.core import (
    Action,
    Beat,
    Done,
    ExitOp,
    Instruction,
    JoinOp,
    KeepAliveOp,
    NodeDesc,
    NodeView,
    Read,
    RendezvousState,
    Verdict,
    Wait,
    Write,
    decode_state,
    driver,
    encode_state,
)
from rallypoint.spec.simulator import SimConfig, Simulator

#: A's clock is the simulation's (no offset, no drift); keep-alive ticks every 1 s
#: and monitor passes every 2.3 s never fall on the same instant in this scenario.
CONFIG = SimConfig(
    nodes=1,
    min_nodes=2,
    max_nodes=2,
    duration=60.0,
    arrival_spread=0.0,
    latency=0.0,
    jitter=0.0,
    keep_alive_interval=4.0,
    keep_alive_max_attempt=3,
    heartbeat_timeout=4.0,
    last_call_timeout=1.0,
    poll_interval=5.0,
    monitor_interval=2.3,
    wake_epsilon=sync_module._WAKE_EPSILON,
)
SETTINGS = CONFIG.settings()
PEER = NodeDesc("10.9.9.9", 1, 0)
PEER_AGAIN = NodeDesc("10.9.9.9", 2, 0)
END = 50.0

Change = Callable[[RendezvousState], "RendezvousState | None"]


def peer_joins(peer: NodeDesc) -> Change:
    """The write of a peer that joins: its own driver's decision on the blob."""

    def change(blob: RendezvousState) -> RendezvousState:
        view = driver.after_read(NodeView(), blob, dict.fromkeys(blob.heartbeats, 0), 0.0)
        decision = driver.decide(view, peer, SETTINGS, JoinOp(), math.inf, 0.0)
        assert isinstance(decision.instruction, Write), decision
        return decision.instruction.state

    return change


class Event(NamedTuple):
    at: float
    kind: str  # "write" or "beat"
    payload: Any


#: The outside world: PEER completes round 0 at 6.1 (A's first Wait ended by a
#: timeout at 4.002 before that), beats twice, then falls silent; PEER_AGAIN
#: completes the next round at 38.7, ending A's Wait by a change.
SCRIPT = (
    Event(6.1, "write", peer_joins(PEER)),
    Event(7.55, "beat", PEER),
    Event(11.45, "beat", PEER),
    Event(38.7, "write", peer_joins(PEER_AGAIN)),
)


class ScenarioOver(Exception):
    """The scripted clock reached END."""


class ScriptedBackend:
    """A RendezvousBackend holding the blob and the side counters, whose clock
    moves only while a node waits (zero latency) and which applies the script's
    writes and beats when the clock passes their times."""

    def __init__(self, script: tuple[Event, ...], end: float) -> None:
        self.now = 0.0
        self._events = sorted(script, key=lambda e: e.at)
        self._end = end
        self._blob: bytes | None = None
        self._version = 0
        self._side: dict[str, int] = {}
        self._stats = BackendStats()

    name = "scripted"
    endpoint = "script"

    @property
    def stats(self) -> BackendStats:
        return self._stats

    def clock(self) -> float:
        return self.now

    def state(self) -> RendezvousState:
        return RendezvousState() if self._blob is None else decode_state(self._blob)

    def _move_to(self, t: float) -> None:
        if t > self._end:
            raise ScenarioOver
        self.now = max(self.now, t)

    def _apply(self, event: Event) -> None:
        if event.kind == "beat":
            key = str(event.payload)
            self._side[key] = self._side.get(key, 0) + 1
            return
        new = event.payload(self.state())
        if new is not None:
            self._blob = encode_state(new)
            self._version += 1

    def advance(self, t: float) -> None:
        """Let time pass up to ``t``, applying the script on the way."""
        while self._events and self._events[0].at <= t:
            event = self._events.pop(0)
            self._move_to(event.at)
            self._apply(event)
        self._move_to(t)

    # -- the RendezvousBackend protocol ---------------------------------------------

    def get_state(self) -> tuple[bytes, Token] | None:
        return None if self._blob is None else (self._blob, self._version)

    def set_state(self, state: bytes, token: Token | None) -> tuple[bytes, Token, bool] | None:
        expected = 0 if token is None else token
        if expected != self._version:
            return None if self._blob is None else (self._blob, self._version, False)
        self._blob = bytes(state)
        self._version += 1
        return self._blob, self._version, True

    def wait_for_change(self, token: Token | None, timeout: float) -> bool:
        seen = 0 if token is None else token
        if self._version != seen:
            return True
        deadline = self.now + max(0.0, timeout)
        while self._events and self._events[0].at <= deadline:
            event = self._events.pop(0)
            self._move_to(event.at)
            self._apply(event)
            if self._version != seen:
                return True
        self._move_to(deadline)
        return False

    def beat(self, node: str) -> int:
        self._side[node] = self._side.get(node, 0) + 1
        return self._side[node]

    def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]:
        return {n: self._side.get(n, 0) for n in nodes}

    def close(self) -> None:
        pass


def run_state_sync(node: NodeDesc) -> tuple[list[Instruction], RendezvousState]:
    """Drive StateSync as the handler and the agent do, on the scripted backend."""
    backend = ScriptedBackend(SCRIPT, END)
    assert isinstance(backend, RendezvousBackend)
    record: list[Instruction] = []
    sync = StateSync(
        backend,
        node,
        SETTINGS,
        clock=backend.clock,
        rng=random.Random(0),
        poll_interval=CONFIG.poll_interval,
        on_instruction=record.append,
    )
    quarter = SETTINGS.keep_alive_interval / 4

    def next_rendezvous() -> Done:
        deadline = backend.clock() + SETTINGS.join_timeout
        while True:
            left = sync.run(ExitOp(), deadline)
            assert left.action is Action.FINISH
            done = sync.run(JoinOp(), deadline, fresh=True)
            assert done.action is Action.FINISH
            if not done.rejoin:
                return done

    try:
        joined = next_rendezvous().joined
        next_beat = backend.clock() + quarter
        next_monitor = backend.clock() + CONFIG.monitor_interval
        while True:
            due = min(next_beat, next_monitor)
            backend.advance(due)
            beat, check = next_beat <= due, next_monitor <= due
            if beat:
                next_beat += quarter
            if check:
                next_monitor += CONFIG.monitor_interval
            if beat:
                sync.run(KeepAliveOp(), backend.clock() + SETTINGS.heartbeat_timeout, fresh=True)
            if check:
                # max_age=0: a fresh read, as the simulated agent always reads
                # (no other read happens at the same instant in this scenario).
                verdict = sync.monitor(joined, max_age=0.0)
                if verdict.waiting or verdict.lost:
                    joined = next_rendezvous().joined
                    next_beat = backend.clock() + quarter
                    next_monitor = backend.clock() + CONFIG.monitor_interval
    except ScenarioOver:
        pass
    return record, backend.state()


class Simulated(NamedTuple):
    instructions: list[Instruction]
    #: simulated time of each instruction
    times: list[float]
    state: RendezvousState
    node: NodeDesc


def run_simulator(config: SimConfig = CONFIG) -> Simulated:
    record: list[Instruction] = []
    times: list[float] = []

    def on_instruction(slot: int, instruction: Instruction) -> None:
        assert slot == 0
        record.append(instruction)
        times.append(sim.now)

    sim = Simulator(config, on_instruction=on_instruction)
    for event in SCRIPT:
        if event.kind == "write":
            sim.inject_write(event.at, event.payload)
        else:
            sim.inject_beat(event.at, event.payload)
    sim.run_until(END)
    assert not sim.report.violations, sim.report.format()
    return Simulated(record, times, sim.state, sim.nodes[0].desc)


def key(instruction: Instruction) -> tuple[object, ...]:
    """What must agree: the instruction's type and its fields that matter."""
    if isinstance(instruction, Read):
        return ("Read", instruction.counters)
    if isinstance(instruction, Write):
        dead = tuple(sorted(instruction.dead))
        return ("Write", instruction.action, dead, instruction.deadline, instruction.state)
    if isinstance(instruction, Beat):
        return ("Beat",)
    if isinstance(instruction, Wait):
        return ("Wait", instruction.until)
    if isinstance(instruction, Done):
        return ("Done", instruction.action, instruction.joined, instruction.rejoin)
    assert isinstance(instruction, Verdict)
    return ("Verdict", instruction.waiting, instruction.lost)


def test_the_simulator_and_state_sync_carry_out_the_same_instructions() -> None:
    simulated = run_simulator()
    executed, sync_state = run_state_sync(simulated.node)
    sim_keys = [key(i) for i in simulated.instructions]
    sync_keys = [key(i) for i in executed]
    for index, (a, b) in enumerate(zip(sim_keys, sync_keys, strict=False)):
        assert a == b, f"instruction {index} differs: simulator {a} != StateSync {b}"
    assert len(sim_keys) == len(sync_keys), (len(sim_keys), len(sync_keys))
    assert simulated.state == sync_state


def test_the_scenario_covers_what_it_claims() -> None:
    """Waits that end by a timeout and by a change, a keep-alive by Beat, a silent
    peer declared dead, a regroup, two completed rounds."""
    simulated = run_simulator()
    run, times = simulated.instructions, simulated.times
    eps = CONFIG.wake_epsilon
    by_timeout = by_change = 0
    for index, instruction in enumerate(run[:-1]):
        if isinstance(instruction, Wait):
            assert instruction.until is not None and isinstance(run[index + 1], Read)
            woke = times[index + 1]
            if woke == pytest.approx(instruction.until + eps):
                by_timeout += 1
                by_timeout += isinstance(run[index + 2], Beat)  # a keep-alive was due
            else:
                assert woke < instruction.until
                by_change += 1
    assert by_timeout >= 3 and by_change >= 2, (by_timeout, by_change)
    node = simulated.node
    assert any(isinstance(i, Write) and i.dead == {PEER} and i.action is None for i in run)
    assert Verdict(0, frozenset({PEER})) in run
    assert any(isinstance(i, Write) and i.action is Action.REMOVE_FROM_PARTICIPANTS for i in run)
    joins = [i.joined for i in run if isinstance(i, Done) and i.joined is not None]
    assert [j.round for j in joins] == [0, 1]
    assert joins[0].members == {node, PEER} and joins[1].members == {node, PEER_AGAIN}
    state = simulated.state
    assert state.complete and set(state.participants) == {node, PEER_AGAIN}
    # Heartbeat ticks that found nothing due: Done(FINISH) of a keep-alive, no IO.
    idle = [i for i in run if isinstance(i, Done) and i.action is Action.FINISH and not i.joined]
    assert len(idle) > 5


def test_the_comparison_catches_a_divergent_executor() -> None:
    """The same comparison with a simulator that wakes later than StateSync fails."""
    late = SimConfig(**{**CONFIG.__dict__, "wake_epsilon": 0.25})
    simulated = run_simulator(late)
    executed, _ = run_state_sync(simulated.node)
    assert [key(i) for i in simulated.instructions] != [key(i) for i in executed]
