"""Watching a round: this node's workers and, through the rendezvous handler, the
rest of the group.

:meth:`GroupWatch.wait_for_outcome` returns once something calls for action, as a
:class:`RoundOutcome`; :meth:`GroupWatch.judge_failure` then decides, with fresh
evidence, whether a local failure spends a restart (the rule is
:mod:`rallypoint.agent.charging`'s).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence

from torch.distributed.elastic.rendezvous.api import RendezvousError

from ..core.driver import MemberResponse
from .charging import Charge, FailureCase, evidence_window, judge
from .config import LaunchConfig
from .errors import ProcessFailure
from .rendezvous import HandlerView
from .workers import WorkerGroup

__all__ = ["GroupWatch", "RoundOutcome"]


def _why(waiting: int, lost: frozenset[object]) -> str:
    """A regroup's reason, for the log."""
    if waiting > 0:
        return f"{waiting} node(s) waiting to join"
    names = ", ".join(sorted(map(str, lost)))
    return f"peer(s) left the round or stopped heartbeating: {names}"


logger = logging.getLogger("rallypoint.agent")

#: How often the handler is asked whether the rendezvous was closed elsewhere.
_CLOSED_CHECK_PERIOD = 1.0


class RoundOutcome(enum.Enum):
    """How a round ended, as :meth:`GroupWatch.wait_for_outcome` saw it (the agent's loop
    turns it into its next step; how the whole run ended is
    :class:`rallypoint.agent.agent.AgentState`)."""

    #: every local worker exited 0
    SUCCEEDED = "succeeded"
    #: a local worker exited non-zero or was killed
    FAILED = "failed"
    #: a node waits to join, or a peer left the round or stopped heartbeating
    MEMBERSHIP = "membership"
    #: another agent closed the rendezvous (the job ended elsewhere)
    CLOSED = "closed"


class GroupWatch:
    """What the agent learns of the group through the rendezvous handler, and its
    one write there: closing the rendezvous.

    Attributes:
        closed: this agent closed the rendezvous.
    """

    def __init__(self, view: HandlerView, config: LaunchConfig) -> None:
        self.view = view
        self.handler = view.handler
        self._role = config.role
        self.interval = config.monitor_interval
        self._next_closed_check = 0.0
        self.closed = False

    def wait_for_outcome(
        self, group: WorkerGroup, look: Callable[[], None] | None = None
    ) -> tuple[RoundOutcome, list[ProcessFailure]]:
        """Watch ``group`` and the rendezvous until something calls for action; the
        failures come with :attr:`RoundOutcome.FAILED`, root cause first. ``look`` is
        called before each look at the workers (live regroup's checks)."""
        while True:
            if look is not None:
                look()
            exits = group.poll()
            failed = [rank for rank, code in exits.items() if code not in (None, 0)]
            if failed:
                return RoundOutcome.FAILED, group.failures(self._role, failed)
            if all(code == 0 for code in exits.values()):
                logger.debug("[%s] all local workers succeeded", self._role)
                return RoundOutcome.SUCCEEDED, []
            response, reason = self.look_at_group()
            if response is MemberResponse.REGROUP:
                logger.info("[%s] %s; starting a new round", self._role, reason)
                return RoundOutcome.MEMBERSHIP, []
            if response is MemberResponse.CLOSED:
                return RoundOutcome.CLOSED, []
            self.view.wait(self.interval)

    def judge_failure(
        self, failures: Sequence[ProcessFailure], case: FailureCase, remaining: int
    ) -> Charge | None:
        """Whether a local failure spends the restart budget (:mod:`.charging`): FREE
        when the round's membership changes around it, else CHARGE; with no restart
        ``remaining``, first wait, until ``case.deadline``, for that evidence.
        None: the rendezvous was closed meanwhile."""
        what = failures[0].message if failures else "?"
        announced = False
        while True:
            response, reason = self.look_at_group()
            if response is MemberResponse.CLOSED:
                return None
            changed = response is MemberResponse.REGROUP
            now = time.monotonic()
            charge = judge(case, now=now, membership_changed=changed, remaining=remaining)
            if charge is Charge.FREE:
                logger.warning(
                    "[%s] worker group failed (%s) as the round changed (%s); "
                    "starting a new round without spending a restart",
                    self._role,
                    what,
                    reason,
                )
            if charge is not Charge.WAIT:
                return charge
            if not announced:
                logger.warning(
                    "[%s] worker group failed (%s) and no restart is left; waiting up to "
                    "%.1f s for a lost peer that would explain it before giving up",
                    self._role,
                    what,
                    case.deadline - time.monotonic(),
                )
                announced = True
            left = case.deadline - time.monotonic()
            self.view.wait(max(0.0, min(self.interval, left)))

    def evidence_window(self) -> float:
        """:func:`.charging.evidence_window` of the handler's keep-alive settings;
        0 for handlers that do not report dead peers (torch's)."""
        keep_alive = self.view.keep_alive
        if not self.view.detects_dead_peers or keep_alive is None:
            return 0.0
        return evidence_window(*keep_alive)

    def round_members(self) -> frozenset[str] | None:
        """The nodes of the round just joined, where the handler shows them
        (rallypoint's: the state its join returned on); None elsewhere."""
        state = getattr(getattr(self.handler, "sync", None), "state", None)
        participants = getattr(state, "participants", None)
        if participants is None or getattr(state, "round", None) != getattr(
            self.handler, "round", None
        ):
            return None
        return frozenset(str(node) for node in participants)

    def look_at_group(self) -> tuple[MemberResponse, str]:
        """What this node does about its group now, and why (for REGROUP). With
        rallypoint's handlers it is the core's checked rule
        (:func:`rallypoint.core.driver.member_response`), the one the node's member
        lifecycle and the simulator's agent follow; torch's handlers are asked
        torch's questions (nodes waiting, dead peers where told, closed, at most
        every second), in the same order of precedence."""
        if self.view.follows_core:
            response, verdict = self.view.member_response()
            regroup = response is MemberResponse.REGROUP
            return response, _why(verdict.waiting, verdict.lost) if regroup else ""
        waiting = self.handler.num_nodes_waiting()
        dead = self.view.dead_participants()
        if self.closed_elsewhere():
            return MemberResponse.CLOSED, ""
        if waiting > 0 or dead:
            return MemberResponse.REGROUP, _why(waiting, dead)
        return MemberResponse.CARRY_ON, ""

    def peers_gone(self, where: str) -> bool:
        """Whether a peer of the round is gone for good (dead, left, or the
        rendezvous closed elsewhere); logs it, saying ``where``."""
        dead = self.view.dead_participants()
        if dead:
            logger.warning(
                "%s: peer(s) %s left the round or stopped heartbeating; not waiting for them",
                where,
                ", ".join(sorted(map(str, dead))),
            )
            return True
        return self.closed_elsewhere()

    def closed_elsewhere(self) -> bool:
        """Whether the rendezvous is closed (asked at most every second)."""
        now = time.monotonic()
        if now < self._next_closed_check:
            return False
        self._next_closed_check = now + _CLOSED_CHECK_PERIOD
        try:
            return bool(self.handler.is_closed())
        except RendezvousError:
            return False

    def close_rendezvous(self) -> None:
        """Close the rendezvous (the job is over); a failure is logged, not raised."""
        started = time.monotonic()
        try:
            # torch declares RendezvousHandler.set_closed without annotations.
            self.handler.set_closed()  # type: ignore[no-untyped-call]
            self.closed = True
        except Exception as exc:
            logger.debug("closing the rendezvous: %s: %s", type(exc).__name__, exc)
        logger.debug("rendezvous closed in %.3f s", time.monotonic() - started)
