"""RendezvousNode: the one entry point. A pure executor here (a dict store, a shared
simulated clock, no IO) steps nodes as an embedder would, knowing nothing of the
keep-alive cadence, KeepAliveOp or a watch of its round: the node asks for all of it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.core import (
    Action,
    Announce,
    AnnounceResult,
    Beat,
    BeatResult,
    Done,
    Joined,
    NodeDesc,
    NodeInstruction,
    Read,
    ReadResult,
    Regroup,
    RendezvousNode,
    RendezvousState,
    Result,
    Settings,
    Unreachable,
    Wait,
    WaitResult,
    Write,
    WriteResult,
)

SETTINGS = Settings("node", min_nodes=2, max_nodes=2, keep_alive_interval=1.0, join_timeout=60)


class Store:
    """The reference store, in a dict: a state under a version token, a side counter
    per node, the published phase and the intent logs."""

    def __init__(self) -> None:
        self.state: RendezvousState | None = None
        self.version = 0
        self.side: dict[NodeDesc, int] = {}
        self.phase = -1
        self.logs: dict[int, list[NodeDesc]] = {}

    @property
    def token(self) -> int | None:
        return self.version or None

    def carry_out(self, node: RendezvousNode, instruction: NodeInstruction) -> Result:
        if isinstance(instruction, Read):
            state, token = (self.state, self.token) if instruction.state else (None, None)
            seen = state or node.state
            side = {n: self.side.get(n, 0) for n in seen.heartbeats}
            log = self.logs.get(seen.round, [])
            return ReadResult(
                state,
                token,
                side if instruction.counters else None,
                list(log) if instruction.intents else None,
            )
        if isinstance(instruction, Write):
            if node.token != self.token:
                return WriteResult(False, self.state, self.token)
            self.state, self.version = instruction.state, self.version + 1
            if instruction.phase is not None:
                self.phase = max(self.phase, instruction.phase)
            return WriteResult(True, self.state, self.token)
        if isinstance(instruction, Beat):
            self.side[node.desc] = self.side.get(node.desc, 0) + 1
            return BeatResult(self.side[node.desc])
        assert isinstance(instruction, Announce), instruction
        self.logs.setdefault(instruction.round, []).append(node.desc)
        return AnnounceResult()


def drive(
    nodes: list[RendezvousNode],
    store: Store,
    end: float,
    *,
    silent: Callable[[RendezvousNode, float], bool] = lambda node, now: False,
) -> list[tuple[float, NodeDesc, NodeInstruction]]:
    """Step every node until simulated time ``end``; a node waits until its Wait's
    ``until`` or a new phase. ``silent(node, now)``: the node's store is
    unreachable (its instructions fail) at ``now``. Returns every outcome and
    instruction with its time and node."""
    now, seen = 0.0, []
    results: dict[NodeDesc, Result | None] = {n.desc: None for n in nodes}
    waits: dict[NodeDesc, Wait] = {}
    while now <= end:
        for node in nodes:
            wait = waits.get(node.desc)
            if wait is not None:
                published = store.phase > wait.phase
                if not published and (wait.until is None or now <= wait.until):
                    continue
                del waits[node.desc]
                results[node.desc] = WaitResult(published)
            if not node.busy:
                continue
            instruction = node.step(results[node.desc], now)
            seen.append((now, node.desc, instruction))
            if isinstance(instruction, Wait):
                waits[node.desc] = instruction
                results[node.desc] = None
            elif isinstance(instruction, (Joined, Regroup, Done)):
                results[node.desc] = None
            elif silent(node, now):
                results[node.desc] = Unreachable()
            else:
                results[node.desc] = store.carry_out(node, instruction)
        now = round(now + 0.01, 6)
    return seen


def outcomes(seen: list[tuple[float, NodeDesc, NodeInstruction]], node: NodeDesc) -> list[object]:
    return [i for _, n, i in seen if n == node and isinstance(i, (Joined, Regroup, Done))]


A, B = NodeDesc("10.0.0.1", 1, 0), NodeDesc("10.0.0.2", 1, 0)


def test_a_node_registers_its_heartbeat_key_then_reads() -> None:
    node = RendezvousNode(A, SETTINGS)
    node.join(0.0)
    assert node.step(None, 0.0) == Beat()
    first = node.step(BeatResult(1), 0.0)
    assert isinstance(first, Read) and first.state


def test_a_node_with_nothing_to_do_says_so() -> None:
    with pytest.raises(RuntimeError, match="nothing to do"):
        RendezvousNode(A, SETTINGS).step(None, 0.0)


def test_two_nodes_join_and_keep_themselves_alive_without_being_told_how() -> None:
    nodes = [RendezvousNode(A, SETTINGS), RendezvousNode(B, SETTINGS)]
    for node in nodes:
        node.join(0.0)
    seen = drive(nodes, Store(), 10.0)
    for node in nodes:
        (joined,) = outcomes(seen, node.desc)  # no regroup: keep-alive never lapsed
        assert isinstance(joined, Joined) and joined.membership.world_size == 2
        beats = [t for t, n, i in seen if n == node.desc and isinstance(i, Beat) and t > 1.0]
        # a beat about every keep_alive_interval, asked for by the node
        assert 7 <= len(beats) <= 12, beats
        assert node.membership == joined.membership and not node.must_fence(10.0)


def test_a_silent_peer_is_lost_and_the_survivor_regroups() -> None:
    nodes = [RendezvousNode(A, SETTINGS), RendezvousNode(B, SETTINGS)]
    for node in nodes:
        node.join(0.0)
    # B's store stops answering at t=3: its beats stop, A must see it dead.
    seen = drive(nodes, Store(), 12.0, silent=lambda node, now: node.desc == B and now > 3.0)
    events = outcomes(seen, A)
    assert isinstance(events[0], Joined)
    regroup = events[1]
    assert isinstance(regroup, Regroup) and regroup.lost == {B} and not regroup.fenced
    at = next(t for t, n, i in seen if i is regroup)
    # declared dead a liveness window after its counter last moved, within 1.5 windows
    assert 3.0 + SETTINGS.liveness_window <= at + SETTINGS.keep_alive_interval
    assert at <= 3.0 + 2 * SETTINGS.liveness_window
    # and B, which could not renew its lease, stopped its workers first
    fenced = [i for _, n, i in seen if n == B and isinstance(i, Regroup)]
    assert fenced and fenced[0].fenced
    b_at = next(t for t, n, i in seen if i is fenced[0])
    assert b_at < at


def test_a_leave_ends_with_done_and_the_peer_regroups_at_once() -> None:
    nodes = [RendezvousNode(A, SETTINGS), RendezvousNode(B, SETTINGS)]
    for node in nodes:
        node.join(0.0)
    store = Store()
    drive(nodes, store, 2.0)
    assert all(node.membership is not None for node in nodes)
    nodes[1].leave(2.0)
    seen = drive(nodes, store, 1.0)  # (its clock restarts at 0: only durations matter)
    (done,) = outcomes(seen, B)
    assert isinstance(done, Done) and done.action is Action.FINISH and not nodes[1].busy
    (regroup,) = outcomes(seen, A)
    assert isinstance(regroup, Regroup) and regroup.lost == {B}


@settings(max_examples=15, deadline=None)
@given(
    count=st.integers(min_value=2, max_value=4),
    silent_node=st.integers(min_value=0, max_value=3),
    silent_from=st.floats(min_value=0.0, max_value=6.0),
    silent_for=st.floats(min_value=0.5, max_value=8.0),
)
def test_members_agree_and_a_cut_off_node_stops_before_a_round_forms_without_it(
    count: int, silent_node: int, silent_from: float, silent_for: float
) -> None:
    """Nodes run the member lifecycle (join, keep-alive, watch, regroup, fence) as
    the node asks; one loses the store for a while. Every round's nodes agree on
    it, and a round never completes without a node whose workers still run."""
    descs = [NodeDesc(f"10.0.0.{i + 1}", 1, 0) for i in range(count)]
    config = Settings("node", min_nodes=1, max_nodes=count, keep_alive_interval=1.0,
                      last_call_timeout=0.5, join_timeout=60)  # fmt: skip
    nodes = [RendezvousNode(desc, config) for desc in descs]
    for node in nodes:
        node.join(0.0)
    cut = descs[silent_node % count]

    def silent(node: RendezvousNode, now: float) -> bool:
        return node.desc == cut and silent_from <= now < silent_from + silent_for

    seen = drive(nodes, Store(), 16.0, silent=silent)
    rounds: dict[int, object] = {}
    for _, _, instruction in seen:
        if isinstance(instruction, Joined):
            membership = instruction.membership
            other = rounds.setdefault(membership.round, membership)
            assert membership == other._replace(rank=membership.rank)  # type: ignore[attr-defined]
    for at, _, instruction in seen:
        if not isinstance(instruction, Joined):
            continue
        for desc in descs:
            if desc in instruction.membership.members:
                continue
            before = [
                i for t, n, i in seen if n == desc and t <= at and isinstance(i, (Joined, Regroup))
            ]
            assert not before or isinstance(before[-1], Regroup), (
                f"round {instruction.membership.round} formed without {desc} at {at} "
                "while its workers ran"
            )
    # once the store is back for long enough, everybody trains together again
    last = max(rounds)
    assert all(node.membership is not None and node.membership.round == last for node in nodes)
