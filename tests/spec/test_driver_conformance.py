"""Driver conformance: the simulator executes the driver exactly as StateSync does.

VOPR's rule is that the simulator runs the production code path. Both executors
here run one scripted scenario on the same clock, with zero latency and no CAS
backoff: node A (the node under test) joins a rendezvous of min 2, max 4 while
other nodes' writes, beats and intent-log entries are scripted:

* round 0: X1's write beats A's first compare-and-set, so A joins through the
  intent log (Announce, a read of the log, one write that admits A and X2, which
  announced itself earlier) and the last call arms; A completes the round when it
  passes (a Wait ended by its timeout);
* X1 and X2 beat a while, fall silent, and A declares both dead (a keep-alive tick
  publishes the removal; the agent's monitor, woken by that phase, reports them
  lost); A regroups (exit, then join) and waits alone in round 1, keeping alive by
  Beat (Waits ended by their timeouts);
* Y joins (the last call arms: a Wait ended by a phase) and leaves again (disarmed:
  another); PEER joins (armed again), and PEER2 joins during A's last-call Wait:
  an admission publishes no phase, so A sleeps on until the last call passes and
  completes round 1;
* X3 joins the wait list: a phase; A's monitor wakes on it, reports a waiting node,
  and A regroups into the wait list.

StateSync runs against a scripted in-memory backend with an injected clock, driven
the way the handler and the agent drive it (exit then join, a keep-alive every
keep_alive_interval / 4 on the current view, a monitor pass with a fresh read after
each wait_for_change(monitor_interval), which a published phase ends early); the
simulator runs its own node. The two instruction sequences must be identical,
field by field.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import pytest

from rallypoint.adapters.backend import BackendStats, RendezvousBackend, Token
from rallypoint.adapters.sync import StateSync
from rallypoint.core import (
    Action,
    Announce,
    Beat,
    Done,
    ExitOp,
    Instruction,
    JoinOp,
    KeepAliveOp,
    NodeDesc,
    NodeView,
    Operator,
    Read,
    RendezvousState,
    Verdict,
    Wait,
    Write,
    decode_state,
    dispatch,
    driver,
    encode_state,
)
from rallypoint.spec.simulator import SimConfig, Simulator

#: A's clock is the simulation's (no offset, no drift); keep-alive ticks every 1 s
#: and monitor timers every 2.3 s never fall on the same instant as each other or
#: as a scripted event in this scenario.
CONFIG = SimConfig(
    nodes=1,
    min_nodes=2,
    max_nodes=4,
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
    wake_epsilon=dispatch.WAKE_EPSILON,
    max_backoff=0.0,
)
SETTINGS = CONFIG.settings()
X1 = NodeDesc("10.9.9.1", 1, 0)
X2 = NodeDesc("10.9.9.2", 1, 0)
X3 = NodeDesc("10.9.9.3", 1, 0)
Y = NodeDesc("10.9.9.4", 1, 0)
PEER = NodeDesc("10.9.9.5", 1, 0)
PEER2 = NodeDesc("10.9.9.6", 1, 0)
END = 50.0

Change = Callable[[RendezvousState], "RendezvousState | None"]


def peer_runs(peer: NodeDesc, op: Operator) -> Change:
    """The write of a peer running ``op``: its own driver's decision on the state."""

    def change(state: RendezvousState) -> RendezvousState:
        counters = dict.fromkeys(state.heartbeats, 0)
        view = driver.after_read(NodeView(), peer, state, counters, 0.0)
        instruction = driver.decide(view, peer, SETTINGS, op, math.inf, 0.0)
        assert isinstance(instruction, Write), instruction
        return instruction.state

    return change


class Event(NamedTuple):
    at: float
    #: "write", "race" (a write that beats the first compare-and-set at or after
    #: ``at``), "beat" or "announce" (payload: (node, round))
    kind: str
    payload: Any


def _beats(node: NodeDesc, start: float, stop: float, every: float = 3.0) -> list[Event]:
    times = [start + i * every for i in range(int((stop - start) / every) + 1)]
    return [Event(t, "beat", node) for t in times]


#: The outside world (see the module docstring); times never coincide with A's
#: timers (A's keep-alive ticks fall on whole seconds plus what its waits added).
SCRIPT = (
    Event(0.0, "announce", (X2, 0)),
    Event(0.0, "race", peer_runs(X1, JoinOp())),
    *_beats(X1, 1.55, 8.0),
    *_beats(X2, 1.65, 8.0),
    Event(28.3, "write", peer_runs(Y, JoinOp())),
    Event(28.9, "write", peer_runs(Y, ExitOp())),
    Event(33.7, "write", peer_runs(PEER, JoinOp())),
    Event(34.15, "write", peer_runs(PEER2, JoinOp())),
    *_beats(PEER, 34.35, END),
    *_beats(PEER2, 34.45, END),
    Event(43.9, "write", peer_runs(X3, JoinOp())),
)


class ScenarioOver(Exception):
    """The scripted clock reached END."""


class ScriptedBackend:
    """A RendezvousBackend holding the state, the side counters, the published
    phase and the intent logs, whose clock moves only while a node waits (zero
    latency) and which applies the script's events when the clock reaches their
    times (before any operation at that instant, as the simulator orders them)."""

    def __init__(self, script: tuple[Event, ...], end: float) -> None:
        self.now = 0.0
        self._events = sorted((e for e in script if e.kind != "race"), key=lambda e: e.at)
        self._races = sorted((e for e in script if e.kind == "race"), key=lambda e: e.at)
        self._end = end
        self._blob: bytes | None = None
        self._version = 0
        self._side: dict[str, int] = {}
        self.published = -1
        self._intents: dict[int, list[bytes]] = {}
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

    def _write(self, change: Change) -> None:
        old = self.state()
        new = change(old)
        if new is None:
            return
        self._blob = encode_state(new)
        self._version += 1
        if new.phase > old.phase:  # the writer publishes the phase it moved to
            self.published = max(self.published, new.phase)

    def _apply(self, event: Event) -> None:
        if event.kind == "beat":
            key = str(event.payload)
            self._side[key] = self._side.get(key, 0) + 1
        elif event.kind == "announce":
            node, round_ = event.payload
            self._intents.setdefault(round_, []).append(str(node).encode("ascii"))
        else:
            self._write(event.payload)

    def _catch_up(self) -> None:
        while self._events and self._events[0].at <= self.now:
            self._apply(self._events.pop(0))

    def advance(self, t: float) -> None:
        """Let time pass up to ``t``, applying the script on the way."""
        while self._events and self._events[0].at <= t:
            event = self._events.pop(0)
            self._move_to(event.at)
            self._apply(event)
        self._move_to(t)

    # -- the RendezvousBackend protocol ---------------------------------------------

    def get_state(self) -> tuple[bytes, Token] | None:
        self._catch_up()
        return None if self._blob is None else (self._blob, self._version)

    def set_state(
        self, state: bytes, token: Token | None, phase: int | None = None
    ) -> tuple[bytes, Token, bool] | None:
        self._catch_up()
        while self._races and self._races[0].at <= self.now:
            self._write(self._races.pop(0).payload)
        expected = 0 if token is None else token
        if expected != self._version:
            return None if self._blob is None else (self._blob, self._version, False)
        self._blob = bytes(state)
        self._version += 1
        if phase is not None:
            self.published = max(self.published, phase)
        return self._blob, self._version, True

    def wait_for_phase(self, phase: int, timeout: float) -> bool:
        self._catch_up()
        if self.published > phase:
            return True
        deadline = self.now + max(0.0, timeout)
        while self._events and self._events[0].at <= deadline:
            event = self._events.pop(0)
            self._move_to(event.at)
            self._apply(event)
            if self.published > phase:
                return True
        self._move_to(deadline)
        return False

    def announce(self, round: int, entry: bytes) -> None:
        self._catch_up()
        self._intents.setdefault(round, []).append(bytes(entry))

    def intents(self, round: int) -> list[bytes]:
        self._catch_up()
        return list(self._intents.get(round, ()))

    def beat(self, node: str) -> int:
        self._catch_up()
        self._side[node] = self._side.get(node, 0) + 1
        return self._side[node]

    def get_heartbeats(self, nodes: Collection[str]) -> dict[str, int]:
        self._catch_up()
        return {n: self._side.get(n, 0) for n in nodes}

    def close(self) -> None:
        pass


@contextmanager
def _no_backoff() -> Iterator[None]:
    """StateSync backs off as the simulator does with max_backoff=0: not at all."""
    saved = dispatch.MAX_BACKOFF
    dispatch.MAX_BACKOFF = CONFIG.max_backoff
    try:
        yield
    finally:
        dispatch.MAX_BACKOFF = saved


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

    with _no_backoff():
        try:
            joined = next_rendezvous().joined
            next_beat = backend.clock() + quarter
            # The agent's monitor: wait_for_change(monitor_interval) on the view's
            # phase, then a pass; the heartbeat thread ticks beside it.
            watched, next_monitor = sync.view.state.phase, backend.clock() + CONFIG.monitor_interval
            while True:
                if backend.published > watched:  # a phase the watch is told at once
                    beat, check = False, True
                else:
                    due = min(next_beat, next_monitor)
                    changed = backend.wait_for_phase(watched, due - backend.clock())
                    beat = next_beat <= backend.clock()
                    check = changed or next_monitor <= backend.clock()
                if beat:
                    next_beat += quarter
                    sync.run(
                        KeepAliveOp(), backend.clock() + SETTINGS.heartbeat_timeout, fresh=True
                    )
                if check:
                    # max_age=0: a fresh read with the counters, as the simulated
                    # agent reads (no other read happens at the same instant here).
                    verdict = sync.watch(joined, max_age=0.0)
                    if verdict.waiting or verdict.lost:
                        joined = next_rendezvous().joined
                        next_beat = backend.clock() + quarter
                    watched = sync.view.state.phase
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
        if event.kind in ("write", "race"):
            sim.inject_write(event.at, event.payload, race=event.kind == "race")
        elif event.kind == "beat":
            sim.inject_beat(event.at, event.payload)
        else:
            sim.inject_announce(event.at, *event.payload)
    sim.run_until(END)
    assert not sim.report.violations, sim.report.format()
    return Simulated(record, times, sim.state, sim.nodes[0].desc)


def key(instruction: Instruction) -> tuple[object, ...]:
    """What must agree: the instruction's type and its fields that matter."""
    if isinstance(instruction, Read):
        return ("Read", instruction.counters, instruction.intents, instruction.state)
    if isinstance(instruction, Write):
        dead = tuple(sorted(instruction.dead))
        return (
            "Write",
            instruction.action,
            dead,
            instruction.phase,
            instruction.deadline,
            instruction.admitted,
            instruction.state,
        )
    if isinstance(instruction, Beat):
        return ("Beat",)
    if isinstance(instruction, Announce):
        return ("Announce", instruction.round)
    if isinstance(instruction, Wait):
        return ("Wait", instruction.until, instruction.phase)
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


def _waits(simulated: Simulated) -> list[tuple[Wait, float, float, bool]]:
    """Each Wait: (wait, when it began, when it ended, ended by its timeout)."""
    run, times = simulated.instructions, simulated.times
    eps = CONFIG.wake_epsilon
    waits = []
    for index, instruction in enumerate(run[:-1]):
        if isinstance(instruction, Wait):
            assert instruction.until is not None and isinstance(run[index + 1], Read)
            woke = times[index + 1]
            by_timeout = woke == pytest.approx(instruction.until + eps)
            assert by_timeout or woke < instruction.until
            waits.append((instruction, times[index], woke, by_timeout))
    return waits


def test_the_scenario_covers_what_it_claims() -> None:
    """Waits that end by a timeout and by a phase (and one that a write without a
    phase does not end), a batched admission through the intent log, a keep-alive
    by Beat, silent peers declared dead, the monitor woken by a phase, regroups,
    two completed rounds."""
    simulated = run_simulator()
    run = simulated.instructions
    waits = _waits(simulated)
    by_timeout = sum(timeout for *_, timeout in waits)
    by_phase = len(waits) - by_timeout
    assert by_timeout >= 3 and by_phase >= 3, (by_timeout, by_phase)
    # PEER2's admission (34.15) published no phase: the last-call Wait slept through it.
    assert any(start < 34.15 < end and timeout for _, start, end, timeout in waits)
    node = simulated.node
    # The batched admission: a lost CAS, Announce, the log read, one write for two.
    assert Announce(0) in run
    assert Read(False, intents=True) in run
    batch = [i for i in run if isinstance(i, Write) and i.admitted]
    assert [w.admitted for w in batch] == [(X2,)] and batch[0].phase is not None
    assert set(batch[0].state.participants) == {node, X1, X2}
    assert any(isinstance(i, Beat) for i in run)
    # (by the keep-alive or the monitor, whichever finds them silent first)
    assert any(isinstance(i, Write) and i.dead == {X1, X2} for i in run)
    assert Verdict(0, frozenset({X1, X2})) in run
    assert Verdict(1, frozenset()) in run  # the monitor saw X3 waiting
    removals = [
        i for i in run if isinstance(i, Write) and i.action is Action.REMOVE_FROM_PARTICIPANTS
    ]
    assert len(removals) == 2
    joins = [i.joined for i in run if isinstance(i, Done) and i.joined is not None]
    assert [j.round for j in joins] == [0, 1]
    assert joins[0].members == {node, X1, X2} and joins[1].members == {node, PEER, PEER2}
    state = simulated.state
    assert state.complete and set(state.participants) == {PEER, PEER2}
    assert state.wait_list == {node, X3}
    # Heartbeat ticks that found nothing due: Done(FINISH) of a keep-alive, no IO.
    idle = [i for i in run if isinstance(i, Done) and i.action is Action.FINISH and not i.joined]
    assert len(idle) > 5


def test_the_comparison_catches_a_divergent_executor() -> None:
    """The same comparison with a simulator that wakes later than StateSync fails."""
    late = SimConfig(**{**CONFIG.__dict__, "wake_epsilon": 0.25})
    simulated = run_simulator(late)
    executed, _ = run_state_sync(simulated.node)
    assert [key(i) for i in simulated.instructions] != [key(i) for i in executed]
