"""core/dispatch.py: what each instruction asks of the store, in order, and the
policy between instructions (backoff, retries, wait timeouts)."""

from __future__ import annotations

import random
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import pytest
from helpers.core_scenarios import joined, node, settings

from rallypoint.core import (
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
    RendezvousState,
    Verdict,
    Wait,
    WaitResult,
    Write,
    WriteResult,
)
from rallypoint.core.dispatch import (
    CARRY_OUT,
    MAX_BACKOFF,
    WAKE_EPSILON,
    AppendIntent,
    BumpHeartbeat,
    GetHeartbeats,
    GetIntents,
    GetState,
    Retry,
    SetState,
    Steps,
    WaitForPhase,
    backoff_delay,
    carry_out,
    run_steps,
    wait_timeout,
)

S = settings(2, 4)
ME, PEER = node(0), node(1)
STATE = joined([ME, PEER], S)


class Objects:
    """A store that holds the objects themselves."""

    def decode(self, stored: RendezvousState) -> RendezvousState:
        return stored

    def encode(self, state: RendezvousState) -> RendezvousState:
        return state

    def counter_keys(self, nodes: Collection[NodeDesc]) -> list[NodeDesc]:
        return sorted(nodes)

    def counters(
        self, nodes: Collection[NodeDesc], raw: Mapping[NodeDesc, int]
    ) -> dict[NodeDesc, int]:
        return {n: raw.get(n, 0) for n in nodes}

    def heartbeat_key(self, node: NodeDesc) -> NodeDesc:
        return node

    def intent_entry(self, node: NodeDesc) -> NodeDesc:
        return node

    def intents(self, round_: int, raw: Sequence[NodeDesc]) -> list[NodeDesc]:
        return list(raw)


def script(steps: Steps, answers: list[Any]) -> tuple[list[Any], Any]:
    """Answer ``steps``' operations from ``answers`` in order: (operations, result)."""
    asked: list[Any] = []
    pending = iter(answers)

    def perform(op: Any) -> Any:
        asked.append(op)
        return next(pending)

    return asked, run_steps(steps, perform)


def steps_of(instruction: object, state: RendezvousState = STATE, token: object = 7) -> Steps:
    return carry_out(instruction, Objects(), node=ME, state=state, token=token)


def test_every_instruction_is_carried_out_here_or_is_the_callers() -> None:
    callers = {Done, Verdict, Joined, Regroup}
    instructions = set(typing.get_args(NodeInstruction))
    assert set(CARRY_OUT) == instructions - callers
    verdict = Verdict(0, frozenset())
    with pytest.raises(TypeError, match="not an instruction to carry out"):
        carry_out(verdict, Objects(), node=ME, state=STATE, token=None)


def test_a_read_asks_for_the_state_then_the_counters_then_the_log() -> None:
    side = {ME: 3, PEER: 5}
    asked, result = script(steps_of(Read(True, intents=True)), [(STATE, 9), side, [PEER]])
    assert asked == [GetState(), GetHeartbeats(sorted(STATE.heartbeats)), GetIntents(STATE.round)]
    assert result == ReadResult(STATE, 9, side, [PEER])


def test_a_read_of_nothing_stored_reads_no_counters() -> None:
    asked, result = script(steps_of(Read(True, intents=True)), [None, []])
    assert asked == [GetState(), GetIntents(0)]
    assert result == ReadResult(None, None, {}, [])


def test_a_read_without_the_state_keeps_the_held_one_and_its_token() -> None:
    asked, result = script(steps_of(Read(False, intents=True, state=False)), [[]])
    assert asked == [GetIntents(STATE.round)]
    assert result == ReadResult(STATE, 7, None, [])


def test_a_write_is_set_over_the_held_token() -> None:
    write = Write(STATE, None, frozenset(), phase=4)
    asked, result = script(steps_of(write), [(STATE, 8, True)])
    assert asked == [SetState(STATE, 7, 4)]
    assert result == WriteResult(True, STATE, 8)
    assert script(steps_of(write), [None])[1] == WriteResult(False, None, None)


def test_beat_announce_and_wait() -> None:
    assert script(steps_of(Beat()), [4]) == ([BumpHeartbeat(ME)], BeatResult(4))
    assert script(steps_of(Announce(2)), [None]) == ([AppendIntent(2, ME)], AnnounceResult())
    assert script(steps_of(Wait(3.5, 1)), [1]) == ([WaitForPhase(1, 3.5)], WaitResult(True))


def test_backoff_and_wait_timeouts() -> None:
    rng = random.Random(0)
    for losses in (0, 1, 5, 16, 2_000):
        cap = min(MAX_BACKOFF, 0.001 * 2 ** min(losses, 16))
        assert all(0 <= backoff_delay(losses, rng) <= cap for _ in range(20))
        assert all(backoff_delay(losses, rng, 0.0) == 0.0 for _ in range(5))
    assert wait_timeout(None, 0.0, 1.0) == 1.0
    assert wait_timeout(5.0, 4.9, 1.0) == pytest.approx(0.1 + WAKE_EPSILON)
    assert wait_timeout(5.0, 4.9, 1.0, 0.25) == pytest.approx(0.35)
    assert wait_timeout(50.0, 0.0, 1.0) == 1.0


def test_retry_gives_up_after_the_window_or_the_deadline() -> None:
    assert Retry().gives_up(now=5.0, deadline=4.0)
    assert not Retry().gives_up(now=5.0, deadline=6.0, down_for=1e9)
    assert Retry(window=0.0).gives_up(now=5.0, deadline=float("inf"))
    assert not Retry(window=2.0).gives_up(now=5.0, deadline=float("inf"), down_for=1.0)
    rng = random.Random(1)
    assert all(0.05 <= Retry().unreachable_pause(rng) <= 0.15 for _ in range(50))
    assert all(Retry(max_backoff=0.0).backoff(3, rng) == 0.0 for _ in range(5))
