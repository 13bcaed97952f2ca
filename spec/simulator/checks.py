"""What the simulator checks: the safety properties of every committed write
(whole, or on the entries it touched: see ``SimConfig.check_every``), agreement
of returned joins, removals of live nodes (false and unfenced deaths), live
regroup's admission of newcomers, and the completed rounds' timings (:class:`Checks`)."""

from __future__ import annotations

from ...core import Done, Membership, NodeDesc, RendezvousState, Settings
from ...core.newcomers import Admission, NewcomerView
from ..model.invariants import (
    AgreementTracker,
    RoundResult,
    check_budget,
    check_budget_step,
    check_exclusions,
    check_exclusions_kept,
    check_state,
    check_transition,
    others_may_train_on,
)
from ..model.lifecycle import Phase
from .config import SimConfig
from .events import EventLoop
from .node import SimNode
from .report import JoinReturn, RoundStat

__all__ = ["Checks"]


class Checks:
    """The checks of writes, joins and removals, and the rounds' accounting.

    The backend hands it every committed write (:meth:`check`,
    :meth:`account_round`) and every node a write removed as dead
    (:meth:`judge_death`); the agents every join that returned
    (:meth:`join_returned`). What it finds goes to the loop's report.

    Args:
        loop: the run's event loop (its clock, trace and report).
        settings: the rendezvous settings of the run.
        initial: the backend's state before the first write.
        by_desc: the simulated node of each current process (kept up to date by
            the agents as processes restart).
    """

    def __init__(
        self,
        loop: EventLoop,
        settings: Settings,
        initial: RendezvousState,
        by_desc: dict[NodeDesc, SimNode],
    ) -> None:
        self.loop = loop
        self.config: SimConfig = loop.config
        self.settings = settings
        self.report = loop.report
        self._by_desc = by_desc
        self._check_every = self.config.check_interval()
        self._unchecked = 0
        self._checked = initial
        # Agreement of returned joins, per round: the world size, rank -> node, the
        # union of the memberships, and the memberships already united (by the
        # identity of the participants they were made from, kept alive).
        self.agreement = AgreementTracker()
        self._round_opened: dict[int, float] = {}
        self._round_pending: dict[int, set[NodeDesc]] = {}
        self._round_size: dict[int, int] = {}

    def check(
        self, old: RendezvousState, new: RendezvousState, touched: tuple[NodeDesc, ...]
    ) -> list[str]:
        """The safety properties of the write ``old -> new`` (see check_every)."""
        self._unchecked += 1
        if (
            self._unchecked >= self._check_every
            or old.complete != new.complete
            or old.round != new.round
            or old.closed != new.closed
        ):
            problems = check_state(new, self.settings) + check_transition(old, new)
            if self._checked is not old:
                # Over every write since the last whole check (each property is
                # one that holds across several steps when it holds across each,
                # the failures counted per write aside: see check_transition).
                span = check_transition(self._checked, new, steps=self._unchecked)
                problems += [p for p in span if p not in problems]
            self._unchecked = 0
            self._checked = new
            return problems
        return self.check_touched(old, new, touched)

    def check_touched(
        self, old: RendezvousState, new: RendezvousState, touched: tuple[NodeDesc, ...]
    ) -> list[str]:
        """check_state and check_transition on the entries ``touched`` (the write
        neither completed, closed nor advanced a round), in their words."""
        problems: list[str] = []
        s = self.settings
        participants = new.participants
        if len(participants) > s.max_nodes:
            problems.append(f"{len(participants)} participants exceed max_nodes {s.max_nodes}")
        if new.complete and len(participants) > new.world_size:
            problems.append(f"complete round {new.round} has more participants than world size")
        if not new.complete and new.world_size != 0:
            problems.append(f"incomplete round {new.round} has world size {new.world_size}")
        if new.complete and new.world_size != old.world_size:
            problems.append(f"world size of complete round {new.round} changed")
        waiting, redundant = new.wait_list, new.redundancy_list
        for node in touched:
            member = node in participants
            if member and (node in waiting or node in redundant):
                problems.append(f"nodes {[str(node)]} are participants and waiting/redundant")
            if node in waiting and node in redundant:
                problems.append("a node is both waiting and redundant")
            if new.complete and member:
                rank = old.participants.get(node)
                if rank is None:
                    problems.append(f"{node} joined complete round {new.round}")
                elif rank != participants[node]:
                    problems.append(f"rank of {node} changed within complete round {new.round}")
        # The restart budget (a few numbers) and the exclusions of the entries touched.
        if new.restarts != old.restarts or new.charged_through != old.charged_through:
            problems += check_budget_step(old, new) + check_budget(new, s)
        if new.excluded or old.excluded:
            problems += check_exclusions(new, touched)
            problems += check_exclusions_kept(old, new, touched)
        return problems

    def account_round(
        self, old: RendezvousState, new: RendezvousState, touched: tuple[NodeDesc, ...]
    ) -> None:
        """Time the rounds the write ``old -> new`` opened, completed, or let
        complete (its last pending members left or died)."""
        now = self.loop.now
        if new.participants and not new.complete and new.round not in self._round_opened:
            self._round_opened[new.round] = now
        if new.complete and not old.complete:
            self._waits_for_no_newcomer(new)
            self._round_pending[new.round] = set(new.participants)
            self._round_size[new.round] = new.world_size
        pending = self._round_pending.get(old.round)
        if pending is not None and len(new.participants) < len(old.participants):
            # Members that leave or die before returning no longer hold the round up.
            if new.round != old.round:
                pending.clear()
            else:
                for node in touched:
                    if node not in new.participants:
                        pending.discard(node)
            self._round_done(old.round)

    def _waits_for_no_newcomer(self, state: RendezvousState) -> None:
        """Nobody waits for a newcomer's start-up (live): a round completes with a
        node whose newcomers still start only if, on what that node knew when it
        asked, the others could not train on without it."""
        problems = []
        for desc in state.participants:
            node = self._by_desc.get(desc)
            if node is None or node.desc != desc or node.newcomers is None:
                continue
            if others_may_train_on(node.newcomers):
                problems.append(
                    f"round {state.round} waits for the start-up of {desc}'s newcomers"
                    f" (ready at t={node.newcomers_ready_at:.3f}) though the others could"
                    f" train on without it: {node.newcomers}"
                )
        if problems:
            self.loop.violate(problems)

    def newcomers_ready(self, node: SimNode, view: NewcomerView, answer: Admission) -> None:
        """A ready newcomer is taken in (live): a node out of the rendezvous whose
        newcomers are ready joins."""
        if node.outside and answer is not Admission.JOIN:
            self.loop.violate(
                [f"{node.desc}'s newcomers are ready but it stays out ({answer.name}): {view}"]
            )

    def _round_done(self, round_: int) -> None:
        pending = self._round_pending.get(round_)
        if pending is not None and not pending:
            del self._round_pending[round_]
            now = self.loop.now
            opened = self._round_opened.get(round_, now)
            self.report.rounds.append(RoundStat(round_, self._round_size[round_], opened, now))

    def judge_death(self, observer: SimNode, gone: NodeDesc) -> None:
        """Count a removal by a peer; a false one if the node was alive, reachable
        and heartbeating on schedule (docs/design.md, decision 2)."""
        self.report.deaths += 1
        self.loop.log(observer, f"declares {gone} dead")
        node = self._by_desc.get(gone)
        if node is None or node.desc != gone:
            return
        if node.alive and node.phase is Phase.TRAINING:
            # Its lease ran out on its peer's clock while its workers still ran: it
            # should have fenced itself first (core.driver.must_fence).
            self.report.unfenced_deaths += 1
            problem = f"unfenced death: {observer.desc} declared {gone} dead while it trained"
            self.report.unfenced_log.append(self.loop.finding([problem]))
        if node.alive and node.phase in (Phase.JOINING, Phase.TRAINING, Phase.EXITING):
            grace = self.settings.liveness_window + self.config.request_timeout * 2
            if not node.partitioned and self.loop.now - node.healed_at > grace:
                self.report.false_deaths += 1
                problem = f"false death: {observer.desc} declared live {gone} dead"
                self.report.false_death_log.append(self.loop.finding([problem]))

    def join_returned(self, desc: NodeDesc, done: Done, joined: Membership) -> None:
        """A node's join returned: check that it agrees with the others of its
        round, and count the node out of the round's pending members."""
        problems = self._agree(desc, done, joined)
        if problems:
            self.loop.violate(problems)
        pending = self._round_pending.get(joined.round)
        if pending is not None:
            pending.discard(desc)
            self._round_done(joined.round)

    def _agree(self, desc: NodeDesc, done: Done, joined: Membership) -> list[str]:
        """Agreement of one returned join with the others of its round, and the
        join's entry in the report's ``returns``. The round's node -> rank map is
        shared by every node that returned on the same state, so the tracker
        merges it once."""
        self.report.returns.append(
            JoinReturn(self.loop.now, self._by_desc[desc].slot, desc, joined)
        )
        result = RoundResult(joined.round, joined.rank, joined.world_size, joined.participants)
        return self.agreement.add(desc, result)
