"""The live round switch's model: every interleaving of ranks training in lockstep,
their agents opening rounds, a newcomer getting ready, crashes and connects that
nothing breaks keeps every invariant with gloo's and NCCL's collectives; and each
likely bug planted in the core's decisions is found, with a trace from the first
state."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from rallypoint.core import live_switch as core_switch
from rallypoint.core import newcomers as core_newcomers
from rallypoint.core import state_sources as core_sources
from rallypoint.core.live_switch import Act, Cause, Place
from rallypoint.core.newcomers import Admission
from rallypoint.core.state_sources import Position, SyncPlan
from rallypoint.spec.check.live_switch import (
    LiveCheckResult,
    LiveSwitchConfig,
    check_live_switch,
)
from rallypoint.spec.cli import spec_main

#: Small enough for a test (about a second), large enough for every planted bug: 2
#: ranks, 2 steps, one fault, a newcomer (so that a round can be superseded before
#: its group forms, and a crash in it leaves two survivors at different steps).
SMALL = LiveSwitchConfig(ranks=2, steps=2)
#: Two faults (a crash, then a connect nothing breaks), one step: about 5 s.
TWO_FAULTS = LiveSwitchConfig(ranks=2, steps=1, max_faults=2)


def _found(result: LiveCheckResult, rule: str) -> str:
    """The violation of ``rule``, formatted (fails the test when it is missing)."""
    assert rule in result.rules(), result.summary()
    return next(v.format() for v in result.violations if v.rule == rule)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_switch_keeps_every_invariant(backend: str) -> None:
    result = check_live_switch(dataclasses.replace(SMALL, backend=backend))
    assert result.ok, result.summary()
    assert result.complete and result.states > 1_000 and result.depth > 10


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_three_ranks_keep_every_invariant(backend: str) -> None:
    result = check_live_switch(LiveSwitchConfig(ranks=3, steps=2, backend=backend))
    assert result.ok, result.summary()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_two_faults_keep_every_invariant(backend: str) -> None:
    result = check_live_switch(dataclasses.replace(TWO_FAULTS, backend=backend))
    assert result.ok, result.summary()


def test_the_summary_counts_what_was_explored() -> None:
    result = check_live_switch(LiveSwitchConfig(ranks=2, steps=1, newcomer=False))
    assert result.ok
    assert f"{result.states:,} states, {result.transitions:,} transitions" in result.summary()
    assert "violations: 0" in result.summary()


def test_a_rank_leaving_before_the_agreed_step_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It leaves at once instead of offering the round: its peers are left inside
    # the next step's collective.
    monkeypatch.setitem(
        core_switch.SWITCH_RULE,  # type: ignore[arg-type]
        (Place.TRAINING, Cause.NEWER_ROUND),
        (Act.LEAVE, Place.BETWEEN),
    )
    text = _found(check_live_switch(SMALL), "collective-failed")
    assert "the newcomer joins" in text and "leaves round 0" in text


def test_a_state_source_with_a_lower_step_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    real = core_sources.plan_sync

    def lowest_step(positions: Sequence[Position]) -> SyncPlan:
        plan = real(positions)
        holders = [(p.step, rank) for rank, p in enumerate(positions) if p.holds]
        if plan.restore or not holders:
            return plan
        step, rank = min(holders)
        behind = frozenset(r for r, p in enumerate(positions) if r != rank)
        return dataclasses.replace(plan, sources={0: rank}, receivers={0: behind}, step=step)

    monkeypatch.setattr(core_sources, "plan_sync", lowest_step)
    text = _found(check_live_switch(SMALL), "state-source")
    # A crash left the survivors at different steps (a collective that finished on
    # some ranks only): the round starts from the lower one.
    assert "(fault)" in text and "but one of its members holds step 1" in text


def test_a_superseded_first_round_waiting_for_its_timeout_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for cause in (Cause.NEWER_ROUND, Cause.NEWER_ROUND_LOST):
        monkeypatch.setitem(
            core_switch.SWITCH_RULE,  # type: ignore[arg-type]
            (Place.FORMING, cause),
            (Act.CARRY_ON, Place.FORMING),
        )
    text = _found(check_live_switch(SMALL), "timeout-without-fault")
    assert "only a timeout moves the job on" in text and "handed r" in text


def test_the_live_timeout_for_a_worker_that_holds_nothing_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        core_switch, "takeover_timeout", lambda live_timeout, *, holds_state: live_timeout
    )
    # A crash and a connect nothing breaks: a cold worker's first round superseded.
    text = _found(check_live_switch(TWO_FAULTS), "long-wait-for-empty")
    assert "sits in a connect nothing breaks" in text and "waits 30 s" in text


def test_a_newcomer_admitted_before_it_is_ready_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        core_newcomers.ADMISSION_RULE,  # type: ignore[arg-type]
        (False, True),
        Admission.JOIN,
    )
    text = _found(check_live_switch(SMALL), "admitted-unready")
    assert "n2 (newcomer) is taken into round 1 before it reported ready" in text


def test_a_rank_that_exits_on_a_failed_collective_loses_a_committed_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The classic reaction to a lost peer: the survivors end; a step one of them
    # committed alone goes with it.
    monkeypatch.setitem(
        core_switch.SWITCH_RULE,  # type: ignore[arg-type]
        (Place.TRAINING, Cause.PEER_LOST),
        (Act.FAIL, Place.GONE),
    )
    text = _found(check_live_switch(SMALL), "step-lost")
    assert "which no other process holds" in text


def test_a_sync_a_lost_member_does_not_abort_hangs_under_nccl_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(
        core_switch.SWITCH_RULE,  # type: ignore[arg-type]
        (Place.SYNCING, Cause.NEWER_ROUND_LOST),
        (Act.CARRY_ON, Place.SYNCING),
    )
    assert check_live_switch(SMALL).ok  # gloo: the transfer fails by itself
    text = _found(
        check_live_switch(dataclasses.replace(SMALL, backend="nccl")), "timeout-without-fault"
    )
    assert "crashes while round" in text


def test_a_bound_the_search_stops_at_is_reported_not_passed() -> None:
    result = check_live_switch(dataclasses.replace(SMALL, max_states=50))
    assert not result.complete and not result.ok
    assert "stopped at 50 states" in result.summary()


def test_spec_check_live_prints_one_summary_per_backend(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert spec_main(["check", "--live", "--nodes", "2", "--max-crashes", "1"]) == 0
    out = capsys.readouterr().out
    assert "backend=gloo" in out and "backend=nccl" in out and "violations: 0" in out


def test_spec_check_live_refuses_a_bound_outside_the_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert spec_main(["check", "--live", "--nodes", "9", "--live-backend", "gloo"]) == 2
    assert "ranks must be 2 to 4" in capsys.readouterr().err
