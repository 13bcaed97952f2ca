"""The live round switch's decisions: when the ranks check, what they agree on, when
they leave, what a worker does wherever a newer round finds it, and how long its
agent waits for it."""

from __future__ import annotations

import pytest

from rallypoint.core.errors import InvalidTransitionError
from rallypoint.core.live_switch import (
    EMPTY_GRACE,
    MAX_CHECK_INTERVAL,
    SWITCH_RULE,
    Act,
    Agreement,
    Cause,
    CheckOutcome,
    Place,
    agreement,
    at_check,
    check_due,
    check_interval,
    holds_state,
    offered,
    react,
    takeover_timeout,
)


def test_a_check_is_due_at_the_agreed_step_and_after_it() -> None:
    assert not check_due(4, 5)
    assert check_due(5, 5)
    assert check_due(6, 5)


def test_a_rank_offers_a_switch_only_for_a_round_newer_than_its_own() -> None:
    assert offered(3, 2)
    assert not offered(2, 2)
    assert not offered(None, 2)


@pytest.mark.parametrize(
    ("step_seconds", "interval"),
    [(0.2, 1), (0.05, 4), (1.0, 1), (1e-9, MAX_CHECK_INTERVAL), (0.0, MAX_CHECK_INTERVAL)],
    ids=["one step per period", "four", "slower than the period", "tiny steps", "untimed"],
)
def test_the_interval_fits_one_check_period_of_steps(step_seconds: float, interval: int) -> None:
    assert check_interval(step_seconds, 0.2) == interval


def test_the_ranks_agree_on_any_pending_round_and_the_longest_interval() -> None:
    parts = [Agreement(False, 1), Agreement(True, 2), Agreement(False, 5)]
    assert agreement(parts) == Agreement(True, 5)
    assert agreement([Agreement(False, 3)] * 3) == Agreement(False, 3)
    with pytest.raises(ValueError, match="at least one"):
        agreement([])


def test_a_pending_agreement_switches_after_the_step_just_committed() -> None:
    assert at_check(Agreement(True, 3), 7).switch
    assert at_check(Agreement(False, 3), 7) == CheckOutcome(False, 10)
    # An interval below one step would read the next agreement before it is started.
    assert at_check(Agreement(False, 0), 7).next_check == 8


@pytest.mark.parametrize(
    ("place", "cause", "act", "then"),
    [
        (Place.TRAINING, Cause.NEWER_ROUND, Act.OFFER, Place.TRAINING),
        (Place.TRAINING, Cause.NEWER_ROUND_LOST, Act.ABORT, Place.BETWEEN),
        (Place.TRAINING, Cause.AGREED_SWITCH, Act.LEAVE, Place.BETWEEN),
        (Place.TRAINING, Cause.PEER_LOST, Act.LEAVE, Place.BETWEEN),
        (Place.FORMING, Cause.NEWER_ROUND, Act.BREAK_AND_TAKE, Place.FORMING),
        (Place.SYNCING, Cause.NEWER_ROUND_LOST, Act.ABORT, Place.BETWEEN),
        (Place.OUTSIDE, Cause.NEWER_ROUND, Act.TAKE, Place.FORMING),
        (Place.BETWEEN, Cause.WAIT_TIMED_OUT, Act.FAIL, Place.GONE),
    ],
    ids=[
        "a planned round is offered to the agreement",
        "a lost member's round breaks the old one at once",
        "the agreed switch leaves the round",
        "a failed collective leaves the round",
        "a superseded forming takes the newer round at once",
        "a sync with a lost member is aborted",
        "a newcomer takes its first round",
        "no round within the live timeout ends the process",
    ],
)
def test_the_switch_rule_says_what_a_worker_does(
    place: Place, cause: Cause, act: Act, then: Place
) -> None:
    assert react(place, cause) == (act, then)


def test_a_newer_round_finds_an_answer_wherever_a_live_worker_is() -> None:
    for place in Place:
        if place is Place.GONE:
            continue
        for cause in (Cause.NEWER_ROUND, Cause.NEWER_ROUND_LOST):
            act, _ = react(place, cause)
            assert act is not Act.FAIL, (place, cause)


def test_a_pair_outside_the_rule_is_a_protocol_error() -> None:
    assert (Place.OUTSIDE, Cause.AGREED_SWITCH) not in SWITCH_RULE
    with pytest.raises(InvalidTransitionError, match="AGREED_SWITCH at OUTSIDE"):
        react(Place.OUTSIDE, Cause.AGREED_SWITCH)
    with pytest.raises(InvalidTransitionError):
        react(Place.GONE, Cause.NEWER_ROUND)


def test_only_leaving_a_round_breaks_its_communication() -> None:
    breaking = {(p, c) for (p, c), (a, _) in SWITCH_RULE.items() if a in (Act.ABORT, Act.LEAVE)}
    assert all(then is Place.BETWEEN for (_, then) in (SWITCH_RULE[k] for k in breaking))
    # A planned round never breaks the round in training: that is the agreement's job.
    assert (Place.TRAINING, Cause.NEWER_ROUND) not in breaking


@pytest.mark.parametrize(
    ("step", "group_formed", "outside", "holds"),
    [
        (0, False, True, False),
        (5, False, True, True),
        (0, True, True, True),
        (0, False, False, True),
    ],
    ids=[
        "a fresh worker or a newcomer before its first group",
        "a survivor forming the next round",
        "left a round whose group it formed",
        "in a round",
    ],
)
def test_a_worker_holds_state_once_it_committed_a_step_or_formed_a_group(
    step: int, group_formed: bool, outside: bool, holds: bool
) -> None:
    assert holds_state(step=step, group_formed=group_formed, outside_a_round=outside) is holds


def test_the_agent_waits_the_live_timeout_only_for_a_worker_that_may_hold_state() -> None:
    assert takeover_timeout(30.0, holds_state=True) == 30.0
    assert takeover_timeout(30.0, holds_state=False) == EMPTY_GRACE
    assert takeover_timeout(1.0, holds_state=False) == 1.0
