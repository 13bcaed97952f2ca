"""The live round switch: when a worker leaves its round, and what it does then.

In a live regroup (docs/design.md, decision 11) the agent hands each live worker the
next round's variables over a pipe, and every rank must leave the old round after
the same committed step, so that no rank trains a step its peers never see. The
ranks agree on it every few steps: at an agreed *check* step each rank reads the
result of one small all-reduce (``MAX`` of every rank's :class:`Agreement`: is a
round pending anywhere, and how many steps until the next check) and starts the
next one in the background. A collective that fails because a peer is gone ends the
round too, and a worker that does not take the new round in time is stopped and
started again by its agent, so that no path waits forever.

Every decision of the switch is here, as small pure functions and one table; the
worker (:mod:`rallypoint.agent.worker.live`) and the agent (:mod:`rallypoint.agent.handover`)
carry them out, and the model checker (:mod:`rallypoint.spec.check.live_switch`)
explores every interleaving of them:

* :func:`check_due`, :func:`offered`, :func:`check_interval`, :func:`agreement` and
  :func:`at_check`: the agreement at check steps;
* :data:`SWITCH_RULE` (:func:`react`): what a worker does, wherever it is, when a
  newer round comes, the agreement says a round is pending, a collective fails for a
  lost peer, or its wait for a round times out;
* :func:`holds_state`, :func:`takeover_timeout` and :func:`takeover`: how long the
  agent waits for a handed worker before it starts it again (a worker that holds
  nothing is cheaper to start again than to wait for; one that ended is started
  again at once);
* which rank's state a round starts from is :func:`rallypoint.core.state_sources.plan_sync`'s
  decision (the lowest rank with the highest step), and when a newcomer is taken in
  is :func:`rallypoint.core.newcomers.admission`'s.

No clock is read here: time comes in as numbers (seconds per step, the live timeout).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .errors import InvalidTransitionError

__all__ = [
    "EMPTY_GRACE",
    "MAX_CHECK_INTERVAL",
    "SWITCH_RULE",
    "Act",
    "Agreement",
    "Cause",
    "CheckOutcome",
    "Place",
    "Takeover",
    "agreement",
    "at_check",
    "check_due",
    "check_interval",
    "holds_state",
    "offered",
    "react",
    "takeover",
    "takeover_timeout",
]

#: Seconds a handed worker that holds no state has to take the new round before its
#: agent starts it again: starting it costs less than waiting for it (its forming
#: may sit in a connect to a peer of a round that will never form).
EMPTY_GRACE = 3.0
#: Most steps between two checks, however short a step is.
MAX_CHECK_INTERVAL = 10_000


class Place(enum.Enum):
    """Where a worker is, as far as the switch is concerned."""

    #: a newcomer started outside the group, waiting for its first round
    OUTSIDE = "outside"
    #: forming the process group of its round (waiting for the store, connecting)
    FORMING = "forming"
    #: the group formed; the ranks compare their positions and move the state
    SYNCING = "syncing"
    #: stepping in its round
    TRAINING = "training"
    #: left a round (its groups closed), waiting for the next one from its agent
    BETWEEN = "between"
    #: the process ends; its agent starts the worker again the classic way
    GONE = "gone"


class Cause(enum.Enum):
    """What makes a worker move."""

    #: the agent handed a newer round, and every member of the old one is alive
    NEWER_ROUND = "newer_round"
    #: the agent handed a newer round because a member of the old one is gone: a
    #: collective of the old round may never finish by itself (NCCL)
    NEWER_ROUND_LOST = "newer_round_lost"
    #: the agreement read at a check says a round is pending (:func:`at_check`)
    AGREED_SWITCH = "agreed_switch"
    #: a collective of the round failed because a peer is gone or aborted it
    PEER_LOST = "peer_lost"
    #: no newer round came within ``--live-timeout`` after the worker left its round
    WAIT_TIMED_OUT = "wait_timed_out"


class Act(enum.Enum):
    """What the worker does (the order inside one act is the order named)."""

    #: take the newer round now: report it, then form its group
    TAKE = "take"
    #: shut the connections the forming opened and stop waiting for the store, then
    #: take the newer round: a peer of the superseded round may never come
    BREAK_AND_TAKE = "break_and_take"
    #: nothing now: the sync in progress finishes or fails by itself, and the round
    #: is offered at the first check of the round
    CARRY_ON = "carry_on"
    #: offer the round at the next agreement (:func:`offered`), and arm a timer that
    #: aborts the round if the loop has not left it well after the agreement was due
    OFFER = "offer"
    #: break the round's communication now (abort its NCCL communicators, shut its
    #: sockets: the peers' collectives fail too), then leave it and wait for the next
    ABORT = "abort"
    #: leave the round: break its communication (as ABORT: no peer may keep waiting
    #: on this rank), close its groups, and wait for the next round
    LEAVE = "leave"
    #: end the process the classic way (raise); its agent starts it again
    FAIL = "fail"


#: (where the worker is, what happened) -> (what it does, where it is then). A pair
#: that is not here cannot happen in the protocol (:func:`react` raises).
SWITCH_RULE: Mapping[tuple[Place, Cause], tuple[Act, Place]] = {
    (Place.OUTSIDE, Cause.NEWER_ROUND): (Act.TAKE, Place.FORMING),
    (Place.OUTSIDE, Cause.NEWER_ROUND_LOST): (Act.TAKE, Place.FORMING),
    # A round superseded before its group formed: taking the newer one at once is
    # the only way out that does not wait out a timeout for a peer that went on.
    (Place.FORMING, Cause.NEWER_ROUND): (Act.BREAK_AND_TAKE, Place.FORMING),
    (Place.FORMING, Cause.NEWER_ROUND_LOST): (Act.BREAK_AND_TAKE, Place.FORMING),
    (Place.FORMING, Cause.PEER_LOST): (Act.LEAVE, Place.BETWEEN),
    (Place.SYNCING, Cause.NEWER_ROUND): (Act.CARRY_ON, Place.SYNCING),
    (Place.SYNCING, Cause.NEWER_ROUND_LOST): (Act.ABORT, Place.BETWEEN),
    (Place.SYNCING, Cause.PEER_LOST): (Act.LEAVE, Place.BETWEEN),
    # Leaving at once would leave the peers inside the next step's collective:
    # every rank leaves at the agreed check instead.
    (Place.TRAINING, Cause.NEWER_ROUND): (Act.OFFER, Place.TRAINING),
    (Place.TRAINING, Cause.NEWER_ROUND_LOST): (Act.ABORT, Place.BETWEEN),
    (Place.TRAINING, Cause.AGREED_SWITCH): (Act.LEAVE, Place.BETWEEN),
    (Place.TRAINING, Cause.PEER_LOST): (Act.LEAVE, Place.BETWEEN),
    (Place.BETWEEN, Cause.NEWER_ROUND): (Act.TAKE, Place.FORMING),
    (Place.BETWEEN, Cause.NEWER_ROUND_LOST): (Act.TAKE, Place.FORMING),
    (Place.BETWEEN, Cause.WAIT_TIMED_OUT): (Act.FAIL, Place.GONE),
}


def react(place: Place, cause: Cause) -> tuple[Act, Place]:
    """What a worker at ``place`` does on ``cause``, and where it is then
    (:data:`SWITCH_RULE`).

    Raises:
        InvalidTransitionError: the pair cannot happen in the protocol.
    """
    try:
        return SWITCH_RULE[(place, cause)]
    except KeyError:
        message = f"no live switch rule for {cause.name} at {place.name}"
        raise InvalidTransitionError(message) from None


@dataclass(frozen=True)
class Agreement:
    """One rank's part of an agreement, or the agreement itself.

    Attributes:
        pending: a newer round is pending (at this rank; agreed: at some rank).
        interval: steps from the check at which it is read to the next check (this
            rank's wish; agreed: the longest wish).
    """

    pending: bool
    interval: int


def check_due(step: int, check_at: int) -> bool:
    """Whether the rank reads the agreement in flight after committing ``step``:
    ``check_at`` is the agreed step of the next check (the same on every rank)."""
    return step >= check_at


def offered(newest_round: int | None, round_: int) -> bool:
    """The ``pending`` a rank of round ``round_`` contributes: whether its agent has
    handed it a newer round (``newest_round``: the newest round it was handed, None:
    none)."""
    return newest_round is not None and newest_round > round_


def check_interval(step_seconds: float, period: float) -> int:
    """The ``interval`` a rank contributes: as many steps as fit in ``period``
    seconds at ``step_seconds`` per step (1 to :data:`MAX_CHECK_INTERVAL`), so that
    a switch waits about ``period`` whatever a step costs."""
    return max(1, min(MAX_CHECK_INTERVAL, round(period / max(step_seconds, 1e-6))))


def agreement(contributions: Iterable[Agreement]) -> Agreement:
    """What the ranks agree on: the ``MAX`` of each field over every rank's
    contribution (the worker runs it as one all-reduce with ``ReduceOp.MAX`` of
    ``[pending, interval]``; every rank reads the same result).

    Raises:
        ValueError: no contribution.
    """
    parts = list(contributions)
    if not parts:
        raise ValueError("an agreement needs at least one rank's contribution")
    return Agreement(any(p.pending for p in parts), max(p.interval for p in parts))


@dataclass(frozen=True)
class CheckOutcome:
    """What a rank does with the agreement it read at a check.

    Attributes:
        switch: leave the round after the step just committed (the same step on
            every rank: every rank reads the same agreement at the same step); then
            :func:`react` with :attr:`Cause.AGREED_SWITCH`.
        next_check: otherwise, the step after which the next agreement is read;
            the rank then starts that agreement with its own :func:`offered` and
            :func:`check_interval`.
    """

    switch: bool
    next_check: int


def at_check(agreed: Agreement, step: int) -> CheckOutcome:
    """The outcome of the agreement ``agreed`` read after committing ``step`` (a
    check step: :func:`check_due`)."""
    return CheckOutcome(agreed.pending, step + max(1, agreed.interval))


def holds_state(*, step: int, group_formed: bool, outside_a_round: bool) -> bool:
    """Whether a handed worker may hold training state, as its agent sees its status.

    Args:
        step: the steps it reported committed.
        group_formed: it formed the process group of the round it reported.
        outside_a_round: it is in no round: it left one (joining the next) or is a
            newcomer waiting for its first.

    A worker that committed no step and formed no group in a round it is outside of
    never held anything a peer lacks: starting it again loses nothing.
    """
    return step > 0 or group_formed or not outside_a_round


def takeover_timeout(live_timeout: float, *, holds_state: bool) -> float:
    """Seconds the agent gives a handed worker to take the new round (to report it)
    before it stops the worker and starts it again into that round:
    ``live_timeout`` for one that may hold state (starting it again loses that
    state), at most :data:`EMPTY_GRACE` for one that holds nothing."""
    return live_timeout if holds_state else min(live_timeout, EMPTY_GRACE)


class Takeover(enum.Enum):
    """What the agent does about a worker it handed a round."""

    #: it reported the round: stop watching it
    TOOK = "took"
    #: keep waiting for it
    WAIT = "wait"
    #: stop it if it still runs, and start it again into the round
    RESTART = "restart"


def takeover(
    *, reported_round: int, round_: int, running: bool, waited: float, timeout: float
) -> Takeover:
    """The agent's look at a worker it handed ``round_`` ``waited`` seconds ago
    with ``timeout`` (:func:`takeover_timeout`): ``reported_round`` is the round its
    status shows, ``running`` whether its process still runs. A worker whose process
    ended without taking the round (its script finished its last step meanwhile)
    never will: waiting out its timeout would only hold the round up."""
    if reported_round >= round_:
        return Takeover.TOOK
    if not running or waited >= timeout:
        return Takeover.RESTART
    return Takeover.WAIT
