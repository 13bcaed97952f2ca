"""Whether a local worker failure spends the restart budget (pure: no clock, no IO).

When a peer node dies, the survivors' workers usually fail first, on a collective
that lost its peer, before the agent has seen the peer's heartbeat stop (that takes
up to about two liveness windows). Charging those failures to ``--max-restarts``
would end a job that still has enough healthy nodes: with the default budget of 0,
losing one node of three would stop the other two. The rule here:

* a local failure that coincides with a membership change of the round (a peer
  declared dead, a peer that left, a node waiting to join) is **free**: the agent
  regroups without spending its budget;
* without such evidence, an agent with restarts left spends one at once and
  regroups (a genuine crash is not delayed); the charge is **refunded** when the
  round it joins next lacks a participant of the failed round (the peer was gone:
  the failure was its death seen early);
* an agent with no restart left waits for the evidence before it gives up, at most
  :func:`evidence_window` after the failure (bounded by the liveness window), and
  gives up when none comes.

Every round in which a genuine failure occurs still charges at least one agent: the
first agent to leave the round cannot have seen anybody else leave it, and nobody
is declared dead while its heartbeat moves. So a failure that repeats on every
attempt still exhausts a budget and ends the job.

The agent calls :func:`judge` in a loop, with fresh evidence and time each call,
and keeps its budget in a :class:`RestartBudget`, which applies :func:`refund` once
the next round has formed.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Set
from dataclasses import dataclass

__all__ = ["Charge", "FailureCase", "RestartBudget", "evidence_window", "judge", "refund"]


class Charge(enum.Enum):
    """What to do with a local worker failure."""

    #: a membership change coincides: regroup, the budget untouched
    FREE = "free"
    #: a local failure: spend one restart, or give up when none is left
    CHARGE = "charge"
    #: no restart left and no evidence yet: look again (until the case's deadline)
    WAIT = "wait"


def evidence_window(keep_alive_interval: float, keep_alive_max_attempt: int) -> float:
    """How long after a local failure a peer's death can still explain it.

    A peer is declared dead once its heartbeat counter has stood still for the
    liveness window (``keep_alive_interval * keep_alive_max_attempt``) on the
    observer's clock; the observer reads the counters every half window, so it may
    first see the last beat up to half a window after the peer died, and declare the
    death up to a window and a half after that: two windows after the death in all.
    The peer died before the survivors' workers failed on it; one keep-alive
    interval more covers the agent's cached view of the rendezvous.
    """
    if keep_alive_interval <= 0 or keep_alive_max_attempt <= 0:
        return 0.0
    return 2.0 * keep_alive_interval * keep_alive_max_attempt + keep_alive_interval


@dataclass(frozen=True)
class FailureCase:
    """One local failure, as the agent saw it.

    Attributes:
        failed_at: when the agent saw its workers fail (its monotonic clock).
        peers: the other agents in the failed round (0: nobody whose loss could
            explain the failure).
        window: :func:`evidence_window` of the rendezvous (0: the rendezvous cannot
            report dead peers, so no evidence will come).
    """

    failed_at: float
    peers: int
    window: float

    @property
    def deadline(self) -> float:
        """The last moment evidence is waited for (an agent with no restart left)."""
        return self.failed_at + self.window


def judge(case: FailureCase, *, now: float, membership_changed: bool, remaining: int) -> Charge:
    """Decide about ``case`` at time ``now``.

    Args:
        case: the failure.
        now: the current time on the clock of ``case.failed_at``.
        membership_changed: the rendezvous reports a peer of the failed round dead
            or gone, or a node waiting to join, now.
        remaining: restarts left in the budget.
    """
    if membership_changed:
        return Charge.FREE
    if remaining > 0 or case.peers <= 0 or case.window <= 0:
        return Charge.CHARGE
    if now < case.deadline:
        return Charge.WAIT
    return Charge.CHARGE


def refund(failed_round: Set[Hashable] | None, next_round: Set[Hashable] | None) -> bool:
    """Whether a charged failure is paid back: the round formed after it lacks a
    participant of the round that failed (that participant died or left, and the
    failure was its loss seen early). Unknown memberships (None) refund nothing."""
    if failed_round is None or next_round is None:
        return False
    return not set(failed_round) <= set(next_round)


class RestartBudget:
    """An agent's ``--max-restarts`` budget, with the refund of a charge that the
    next round shows was a peer's loss seen early.

    Attributes:
        max_restarts: the whole budget.
        remaining: restarts left.
    """

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.remaining = max_restarts
        #: the members of the failed round whose failure was charged, until settled
        self._charged: frozenset[Hashable] | None = None

    @property
    def spent(self) -> int:
        """Restarts spent (torch's ``TORCHELASTIC_RESTART_COUNT``)."""
        return self.max_restarts - self.remaining

    def spend(self, members: Set[Hashable] | None) -> bool:
        """Spend a restart on a failure of the round of ``members`` (None: not known);
        False: none was left (the job gives up)."""
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        self._charged = frozenset(members) if members is not None else None
        return True

    def settle(self, members: Set[Hashable] | None) -> frozenset[Hashable]:
        """A new round of ``members`` formed: refund the last charge if that round
        lacks a participant of the charged one. Returns the participants it lacks
        (empty: nothing refunded)."""
        charged, self._charged = self._charged, None
        if members is None or charged is None or not refund(charged, members):
            return frozenset()
        if self.remaining >= self.max_restarts:
            return frozenset()
        self.remaining += 1
        return charged - frozenset(members)
