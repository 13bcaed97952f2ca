"""The live round switch (:mod:`rallypoint.core.live_switch`), model-checked.

An explicit-state model of one live job: ``ranks`` workers training ``steps`` steps
in lockstep (every step is a collective, as under DDP), their agents, and, with
``newcomer``, one more node's worker that starts outside the group and is taken in
once the core's admission rule says so (:func:`rallypoint.core.newcomers.admission`).
A breadth-first search runs every interleaving of:

* each worker's moves: form the round's group (every member at once, as
  ``init_process_group`` does), gather positions and move the state (the core's
  :func:`~rallypoint.core.state_sources.plan_sync` picks the source), enter and
  finish each step's collective, read the agreement at the agreed check steps and
  start the next one with its own offer (two step times, so two intervals), react
  to a handed round (:func:`~rallypoint.core.live_switch.react`), take it;
* the agent's moves: open a round after a worker died (the dead ones started
  afresh, the live ones handed the round with ``lost``), take the newcomer in (not
  once a member finished: its agent left for the exit barrier), start a handed
  worker again when its takeover timeout runs out, or when its script finished in
  a round that can no longer finish whole
  (:func:`~rallypoint.core.live_switch.takeover`);
* faults, up to ``max_faults``: a worker crashes anywhere (before its group forms,
  inside a collective, while the state moves, while it waits), or its forming
  sits in a connect that nothing breaks when a newer round comes (only its agent's
  timeout ends it);
* timeouts as events that fire only when nothing else can move (a timeout is long
  next to a protocol step): the agent's takeover timeout, the worker's
  ``--live-timeout`` wait for a round, and the abort timer of an offered round.

Collectives fail as gloo's do (a peer gone before it finished its part fails the
others' wait; one gone after may or may not) or, with ``backend="nccl"``, hang
until the waiting rank aborts (the agreement's CPU side group is gloo in both).

Every decision is the core's, looked up at call time through its module, so a test
can plant a bug there and see it found. The invariants, checked on every state and
transition (:data:`RULES` names them):

* **no wait forever**: every state that is not the end has a move; from every
  state the job can still finish; no cycle;
* **no timeout without a fault**: when only a timeout can move the job on, some
  process hangs (a fault) that the timeout is for;
* **short wait for an empty worker**: a hung worker that holds no state is started
  again within :data:`~rallypoint.core.live_switch.EMPTY_GRACE`, not after
  ``--live-timeout``;
* **same step**: every rank that leaves a round by the agreement leaves it after
  the same step, and no rank of it commits a step past that one;
* **planned switch is clean**: in a run without faults, no collective fails;
* **no step lost**: a round starts from the highest step its members hold (the
  state source holds it), and no process holding a step nobody else holds is
  ended by the protocol (only a fault may lose work);
* **admitted when ready**: the newcomer is taken into a round only once ready.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ...core import live_switch as core_switch
from ...core import newcomers as core_newcomers
from ...core import state_sources as core_sources
from ...core.live_switch import Act, Agreement, Cause, Place, Takeover
from ...core.newcomers import Admission, NewcomerView
from ...core.state_sources import Position

__all__ = [
    "RULES",
    "LiveCheckResult",
    "LiveSwitchConfig",
    "LiveViolation",
    "check_live_switch",
]

#: The invariants, by the name a violation carries.
RULES = {
    "waits-forever": "a state that is not the end has no move",
    "cannot-finish": "a state from which the job can no longer finish",
    "cycle": "a cycle of moves without progress",
    "timeout-without-fault": "only a timeout moves the job on, though no process hangs",
    "long-wait-for-empty": "the job waits --live-timeout for a hung worker that holds no state",
    "same-step": "ranks of one round leave it by the agreement after different steps",
    "collective-failed": "a collective failed in a run without any fault",
    "state-source": "a round starts from a lower step than one of its members holds",
    "step-lost": "the protocol ended the only process that held a committed step",
    "admitted-unready": "the newcomer was taken into a round before it was ready",
}


@dataclass(frozen=True)
class LiveSwitchConfig:
    """The bounds of one search.

    Attributes:
        ranks: workers of the first round (2 to 4).
        steps: the script's total steps.
        newcomer: one more worker starts outside the group and asks to be taken in.
        max_faults: crashes and unbreakable connects, all told. The agents may open
            a round for each fault and one for the newcomer (:attr:`max_rounds`).
        backend: ``gloo`` (a collective fails once a peer is gone) or ``nccl`` (it
            waits until this rank aborts).
        live_timeout: ``--live-timeout``, seconds.
        step_seconds: the step times a rank may measure (each gives an interval).
        check_period: seconds between two checks (``CHECK_PERIOD``).
        max_states: stop after this many states.
    """

    ranks: int = 3
    steps: int = 2
    newcomer: bool = True
    max_faults: int = 1
    backend: str = "gloo"
    live_timeout: float = 30.0
    step_seconds: tuple[float, ...] = (0.2,)
    check_period: float = 0.2
    max_states: int = 2_000_000

    def __post_init__(self) -> None:
        if not 2 <= self.ranks <= 4:
            raise ValueError(f"ranks must be 2 to 4, got {self.ranks}")
        if not 1 <= self.steps <= 6:
            raise ValueError(f"steps must be 1 to 6, got {self.steps}")
        if not 0 <= self.max_faults <= 3:
            raise ValueError(f"max_faults must be 0 to 3, got {self.max_faults}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if not self.step_seconds or min(self.step_seconds) <= 0:
            raise ValueError(f"step_seconds must be positive times, got {self.step_seconds}")
        if self.max_states < 1:
            raise ValueError(f"max_states must be at least 1, got {self.max_states}")

    @property
    def max_rounds(self) -> int:
        """Rounds the agents may open, the first included: every fault and the
        newcomer's admission may need one; a bound below that would strand a job
        the protocol could recover."""
        return 1 + self.max_faults + int(self.newcomer)

    def describe(self) -> str:
        return (
            f"ranks={self.ranks} steps={self.steps} newcomer={self.newcomer} "
            f"max_faults={self.max_faults} backend={self.backend}"
        )


class Phase(enum.Enum):
    """Where one worker process is."""

    STANDBY = "standby"  # a newcomer starting outside the group
    READY = "ready"  # a newcomer that reported ready, waiting for its first round
    FORMING = "forming"  # forming the group of its round
    SYNCING = "syncing"  # group formed, positions gathered: the state moves
    STEPPING = "stepping"  # inside the collective of its next step
    CHECKING = "checking"  # committed a check step: reading the agreement in flight
    BETWEEN = "between"  # left its round, waiting for the next
    DONE = "done"  # its script finished
    DEAD = "dead"  # the process is gone


#: The core's place for each phase (a live process's).
PLACE = {
    Phase.STANDBY: Place.OUTSIDE,
    Phase.READY: Place.OUTSIDE,
    Phase.FORMING: Place.FORMING,
    Phase.SYNCING: Place.SYNCING,
    Phase.STEPPING: Place.TRAINING,
    Phase.CHECKING: Place.TRAINING,
    Phase.BETWEEN: Place.BETWEEN,
}
ALIVE = frozenset(PLACE)
#: Where a worker is outside any round, as its agent reads its status.
OUTSIDE_A_ROUND = frozenset({Phase.STANDBY, Phase.READY, Phase.FORMING, Phase.BETWEEN})


class Proc(NamedTuple):
    """One worker slot's process."""

    phase: Phase
    #: the round it reported (is in, forms, or left last)
    round: int
    step: int
    holds: bool
    #: the newest round its agent handed it (its round when none newer)
    inbox: int
    #: that round was opened because a member of the old one was lost
    lost: bool
    #: it reacted to ``inbox`` already (an offer armed, a sync carried on)
    reacted: bool
    #: the agent's takeover timeout, seconds (None: the agent does not watch it)
    timer: float | None
    #: stuck in a connect nothing breaks (a fault): only its agent ends it
    hung: bool
    #: inside an NCCL collective a peer left mid-way: only its own abort ends it
    wedged: bool = False
    #: the round whose group it formed last (-1: none); the fields below are of it
    formed: int = -1
    #: the collectives of that round it entered and finished: 0 the state's
    #: transfer, s + 1 the collective of step s (-1: none)
    entered: int = -1
    finished: int = -1
    #: the agreements it contributed to and read (-1: none)
    agree_in: int = -1
    agree_out: int = -1
    #: its contributions to agreements agree_in - 1 and agree_in
    offers: tuple[Agreement, ...] = ()
    #: the step after which it reads the next agreement
    check_at: int = 0


class World(NamedTuple):
    """One state of the search."""

    procs: tuple[Proc, ...]
    #: by round: the slots of its members
    members: tuple[frozenset[int], ...]
    #: by round: the step it starts from, once its positions were gathered
    starts: tuple[int | None, ...]
    #: by round: the step after which its first rank left it by the agreement
    stops: tuple[int | None, ...]
    faults: int


class Kind(enum.Enum):
    PROGRESS = "progress"
    TIMEOUT = "timeout"
    FAULT = "fault"


class Move(NamedTuple):
    label: str
    kind: Kind
    world: World
    #: (rule, message) of the invariants the move breaks
    broken: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class LiveViolation:
    """A broken invariant and the moves that lead to it from the first state."""

    rule: str
    message: str
    trace: tuple[str, ...]

    def format(self) -> str:
        lines = [f"violation [{self.rule}]: {self.message}", "trace:"]
        lines += [f"  {i}. {step}" for i, step in enumerate(self.trace, 1)]
        return "\n".join(lines)


@dataclass(frozen=True)
class LiveCheckResult:
    config: LiveSwitchConfig
    states: int
    transitions: int
    depth: int
    seconds: float
    complete: bool
    violations: tuple[LiveViolation, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.complete and not self.violations

    def rules(self) -> set[str]:
        return {v.rule for v in self.violations}

    def summary(self) -> str:
        scope = "full state space" if self.complete else f"stopped at {self.states} states"
        lines = [
            f"live switch: {self.config.describe()}",
            f"  {self.states:,} states, {self.transitions:,} transitions, depth {self.depth}, "
            f"{self.seconds:.2f} s ({scope})",
            f"  violations: {len(self.violations)}",
        ]
        lines += ["  " + line for v in self.violations for line in v.format().splitlines()]
        return "\n".join(lines)


# ---------------------------------------------------------------------- the model


def _name(slot: int, config: LiveSwitchConfig) -> str:
    return f"n{slot}" + (" (newcomer)" if slot == config.ranks else "")


def _latest(world: World) -> int:
    return len(world.members) - 1


def _initial(config: LiveSwitchConfig) -> World:
    """Round 0 formed and synced (the job's state at step 0 on every rank), its first
    agreement in flight; the newcomer, if any, starting outside the group."""
    first = Agreement(False, 1)
    rank = Proc(
        Phase.STEPPING, 0, 0, True, 0, False, False, None, False,
        formed=0, entered=1, finished=0, agree_in=0, offers=(first,), check_at=1,
    )  # fmt: skip
    procs = [rank] * config.ranks
    if config.newcomer:
        procs.append(Proc(Phase.STANDBY, -1, 0, False, -1, False, False, None, False))
    return World(tuple(procs), (frozenset(range(config.ranks)),), (0,), (None,), 0)


def _finished(world: World) -> bool:
    """Every member of some round finished its script in it: the job is over."""
    return any(
        all(world.procs[s].phase is Phase.DONE and world.procs[s].round == r for s in members)
        for r, members in enumerate(world.members)
    )


def _gone_from(p: Proc, r: int) -> bool:
    """``p`` takes no further part in round ``r``'s collectives."""
    return p.round != r or p.phase in (Phase.BETWEEN, Phase.DONE, Phase.DEAD)


def _outcomes(world: World, r: int, target: int, agreement: bool, backend: str) -> set[str]:
    """How a wait of a member of round ``r`` on its collective ``target`` (an
    agreement's index, or a main collective's) can end: "done", "failed"."""
    everyone_in = True
    may_fail = False
    for slot in world.members[r]:
        p = world.procs[slot]
        mine = p.formed == r
        entered = (p.agree_in if agreement else p.entered) if mine else -1
        finished = (p.agree_out if agreement else p.finished) if mine else -1
        gone = _gone_from(p, r)
        if entered < target:
            everyone_in = False
            may_fail |= gone
        elif finished < target and gone:
            may_fail = True  # it went while its part was on the way
    found = {"done"} if everyone_in else set()
    if may_fail and (agreement or backend == "gloo"):
        found.add("failed")
    elif may_fail:
        found.add("wedged")  # NCCL: it waits for the part that never comes
    return found


def _offer_of(p: Proc, k: int) -> Agreement:
    return p.offers[-1] if p.agree_in == k else p.offers[-2]


def _fresh(round_: int, before: Proc) -> Proc:
    """A worker started (again) the classic way into ``round_``: it holds nothing.
    What the process ``before`` it did in its round stays what its peers saw (the
    collectives it finished), until the new one forms a group."""
    return before._replace(
        phase=Phase.FORMING, round=round_, step=0, holds=False, inbox=round_, lost=False,
        reacted=False, timer=None, hung=False, wedged=False,
    )  # fmt: skip


class _Model:
    """The moves of one configuration (every decision asked of the core)."""

    def __init__(self, config: LiveSwitchConfig) -> None:
        self.config = config
        self.intervals = sorted(
            {core_switch.check_interval(s, config.check_period) for s in config.step_seconds}
        )

    # -- helpers that change one slot

    def _set(
        self,
        world: World,
        slot: int,
        proc: Proc,
        *,
        faults: int | None = None,
        stops: tuple[int | None, ...] | None = None,
    ) -> World:
        procs = list(world.procs)
        procs[slot] = proc
        return world._replace(
            procs=tuple(procs),
            faults=world.faults if faults is None else faults,
            stops=world.stops if stops is None else stops,
        )

    def _take(self, p: Proc) -> Proc:
        """Report the handed round and form its group (the agent stops watching)."""
        return p._replace(phase=Phase.FORMING, round=p.inbox, reacted=False, timer=None, hung=False)

    def _ended(
        self, world: World, slot: int, why: str, broken: list[tuple[str, str]], *, fault: bool
    ) -> None:
        """``slot``'s process ends (not by its script): its state is gone with it,
        which only a fault may cost when it held a step no other process holds."""
        p = world.procs[slot]
        if fault or not p.holds:
            return
        others = [
            q.step for s, q in enumerate(world.procs) if s != slot and q.holds and q.phase in ALIVE
        ]
        if not others or max(others) < p.step:
            broken.append(
                ("step-lost", f"{_name(slot, self.config)} held step {p.step}, which no other "
                 f"process holds, and {why}")
            )  # fmt: skip

    def _act(
        self,
        world: World,
        slot: int,
        act: Act,
        how: str,
        broken: list[tuple[str, str]],
    ) -> tuple[World, str]:
        """Carry out the core's ``act`` for ``slot``: the new world and the label."""
        p = world.procs[slot]
        name = _name(slot, self.config)
        if act in (Act.TAKE, Act.BREAK_AND_TAKE):
            if p.inbox <= p.round:
                return world, f"{name}: {how}: {act.value} (nothing newer to take)"
            return self._set(world, slot, self._take(p)), (
                f"{name}: {how}: {act.value}, forms round {p.inbox}"
            )
        if act in (Act.CARRY_ON, Act.OFFER):
            return self._set(world, slot, p._replace(reacted=True)), f"{name}: {how}: {act.value}"
        if act in (Act.ABORT, Act.LEAVE):
            left = p._replace(phase=Phase.BETWEEN, reacted=False, wedged=False)
            return self._set(world, slot, left), (
                f"{name}: {how}: {act.value}s round {p.round} after step {p.step}"
            )
        # FAIL: the process ends the classic way; its agent starts it afresh in the
        # next round it opens.
        self._ended(world, slot, f"{how} ended it", broken, fault=False)
        return self._set(world, slot, p._replace(phase=Phase.DEAD, timer=None)), (
            f"{name}: {how}: fails, the process ends"
        )

    # -- the moves

    def moves(self, world: World) -> list[Move]:
        if _finished(world):
            return []
        found: list[Move] = []
        for slot, p in enumerate(world.procs):
            if p.phase in ALIVE and not p.hung:
                found += self._worker_moves(world, slot, p)
        found += self._forming_moves(world)
        found += self._agent_moves(world)
        found += self._finished_but_handed(world)
        found += self._fault_moves(world)
        if not any(m.kind is Kind.PROGRESS for m in found):
            # Timeouts are long next to a protocol step: they fire when nothing else moves.
            found += self._timeouts(world)
        return found

    def _worker_moves(self, world: World, slot: int, p: Proc) -> Iterator[Move]:
        name = _name(slot, self.config)
        if p.phase is Phase.STANDBY:
            ready = p._replace(phase=Phase.READY)
            yield Move(f"{name}: reports READY", Kind.PROGRESS, self._set(world, slot, ready))
            return
        if p.inbox > p.round and not p.reacted:
            yield from self._react_to_round(world, slot, p)
        if p.phase is Phase.SYNCING:
            yield from self._collective(world, slot, p, 0, agreement=False)
        elif p.phase is Phase.STEPPING:
            yield from self._collective(world, slot, p, p.step + 1, agreement=False)
        elif p.phase is Phase.CHECKING:
            yield from self._collective(world, slot, p, p.agree_in, agreement=True)

    def _react_to_round(self, world: World, slot: int, p: Proc) -> Iterator[Move]:
        cause = Cause.NEWER_ROUND_LOST if p.lost else Cause.NEWER_ROUND
        place = PLACE[p.phase]
        act, _ = core_switch.react(place, cause)
        how = f"handed round {p.inbox}{' (lost)' if p.lost else ''} while {p.phase.value}"
        broken: list[tuple[str, str]] = []
        after, label = self._act(world, slot, act, how, broken)
        if act in (Act.ABORT, Act.LEAVE) and world.faults == 0:
            broken.append(
                ("collective-failed", f"{_name(slot, self.config)} breaks round {p.round} "
                 "on a handed round, though no process failed")
            )  # fmt: skip
        yield Move(label, Kind.PROGRESS, after, tuple(broken))
        if (
            p.phase is Phase.FORMING
            and act in (Act.TAKE, Act.BREAK_AND_TAKE)
            and world.faults < self.config.max_faults
        ):
            stuck = p._replace(hung=True, reacted=True)
            yield Move(
                f"{_name(slot, self.config)}: handed round {p.inbox}, but its forming of round "
                f"{p.round} sits in a connect nothing breaks (fault)",
                Kind.FAULT,
                self._set(world, slot, stuck, faults=world.faults + 1),
            )

    def _collective(
        self, world: World, slot: int, p: Proc, target: int, *, agreement: bool
    ) -> Iterator[Move]:
        what = (
            f"agreement {target}"
            if agreement
            else "the state transfer"
            if target == 0
            else f"step {target - 1}'s collective"
        )
        name = _name(slot, self.config)
        if p.wedged:
            return
        outcomes = _outcomes(world, p.round, target, agreement, self.config.backend)
        if "wedged" in outcomes:
            label = f"{name}: {what} in round {p.round} hangs (a peer left it mid-way)"
            yield Move(label, Kind.PROGRESS, self._set(world, slot, p._replace(wedged=True)))
        if "failed" in outcomes:
            broken: list[tuple[str, str]] = []
            if world.faults == 0:
                broken.append(
                    ("collective-failed", f"{name}'s {what} in round {p.round} failed, though "
                     "no process failed")
                )  # fmt: skip
            act, _ = core_switch.react(PLACE[p.phase], Cause.PEER_LOST)
            after, label = self._act(world, slot, act, f"{what} fails (peer lost)", broken)
            yield Move(label, Kind.PROGRESS, after, tuple(broken))
        if "done" not in outcomes:
            return
        if p.phase is Phase.SYNCING:
            yield from self._synced(world, slot, p)
        elif p.phase is Phase.STEPPING:
            yield from self._committed(world, slot, p)
        else:
            yield from self._checked(world, slot, p)

    def _synced(self, world: World, slot: int, p: Proc) -> Iterator[Move]:
        start = world.starts[p.round]
        assert start is not None
        offer = Agreement(core_switch.offered(p.inbox, p.round), 1)  # no step timed yet
        q = p._replace(
            step=start, holds=True, finished=0, agree_in=0, agree_out=-1, offers=(offer,),
            check_at=start + 1,
        )  # fmt: skip
        q = self._next_step(q)
        label = (
            f"{_name(slot, self.config)}: holds step {start} in round {p.round}, "
            f"offers {int(offer.pending)}"
        )
        yield Move(label, Kind.PROGRESS, self._set(world, slot, q))

    def _next_step(self, p: Proc) -> Proc:
        """After a commit or a check that does not switch: finish, or enter the next
        step's collective."""
        if p.step >= self.config.steps:
            return p._replace(phase=Phase.DONE)
        return p._replace(phase=Phase.STEPPING, entered=p.step + 1)

    def _committed(self, world: World, slot: int, p: Proc) -> Iterator[Move]:
        step = p.step + 1
        q = p._replace(step=step, holds=True, finished=p.step + 1)
        broken = []
        stop = world.stops[p.round]
        if stop is not None and step > stop:
            broken.append(
                ("same-step", f"{_name(slot, self.config)} commits step {step} in round "
                 f"{p.round}, which a rank left by the agreement after step {stop}")
            )  # fmt: skip
        if core_switch.check_due(step, p.check_at):
            q = q._replace(phase=Phase.CHECKING)
        else:
            q = self._next_step(q)
        label = f"{_name(slot, self.config)}: commits step {step} in round {p.round}"
        yield Move(label, Kind.PROGRESS, self._set(world, slot, q), tuple(broken))

    def _checked(self, world: World, slot: int, p: Proc) -> Iterator[Move]:
        k = p.agree_in
        agreed = core_switch.agreement(
            _offer_of(world.procs[s], k) for s in sorted(world.members[p.round])
        )
        outcome = core_switch.at_check(agreed, p.step)
        name = _name(slot, self.config)
        read = p._replace(agree_out=k)
        if outcome.switch:
            broken: list[tuple[str, str]] = []
            stop = world.stops[p.round]
            stops = world.stops
            if stop is None:
                stops = (*stops[: p.round], p.step, *stops[p.round + 1 :])
            elif stop != p.step:
                broken.append(
                    ("same-step", f"{name} leaves round {p.round} by the agreement after step "
                     f"{p.step}, another rank after step {stop}")
                )  # fmt: skip
            act, _ = core_switch.react(Place.TRAINING, Cause.AGREED_SWITCH)
            base = self._set(world, slot, read, stops=stops)
            after, label = self._act(base, slot, act, f"agreement {k} says switch", broken)
            yield Move(label, Kind.PROGRESS, after, tuple(broken))
            return
        offer = core_switch.offered(p.inbox, p.round)
        for interval in self.intervals:
            mine = Agreement(offer, interval)
            q = read._replace(
                check_at=outcome.next_check, agree_in=k + 1, offers=(p.offers[-1], mine)
            )
            q = self._next_step(q)
            label = (
                f"{name}: agreement {k} says go on; next check after step "
                f"{outcome.next_check}, offers ({int(offer)}, {interval})"
            )
            yield Move(label, Kind.PROGRESS, self._set(world, slot, q))

    def _forming_moves(self, world: World) -> Iterator[Move]:
        """A round's group forms once every member is forming it (none hung)."""
        for r, members in enumerate(world.members):
            if world.starts[r] is not None:
                continue  # a round's group forms once
            procs = [world.procs[s] for s in members]
            if not all(q.phase is Phase.FORMING and q.round == r and not q.hung for q in procs):
                continue
            ranks = sorted(members)
            positions = [Position(world.procs[s].step, world.procs[s].holds) for s in ranks]
            plan = core_sources.plan_sync(positions)
            broken: list[tuple[str, str]] = []
            if plan.restore:
                positions = [Position(0, True)] * len(ranks)  # every rank reads the checkpoint
                plan = core_sources.plan_sync(positions)
            held = [pos.step for pos in positions if pos.holds]
            best = max(held)
            sources = [src for src in plan.sources.values() if 0 <= src < len(positions)]
            start = plan.step
            if start is None:
                broken.append(("state-source", f"round {r} has no plan: {plan}"))
                start = best
            elif start < best or any(
                not positions[src].holds or positions[src].step < best for src in sources
            ):
                who = ", ".join(f"rank {src} at step {positions[src].step}" for src in sources)
                broken.append(
                    ("state-source", f"round {r} starts from step {start} ({who}), "
                     f"but one of its members holds step {best}")
                )  # fmt: skip
            procs_after = list(world.procs)
            for s in ranks:
                procs_after[s] = world.procs[s]._replace(
                    phase=Phase.SYNCING, formed=r, entered=0, finished=-1, agree_in=-1,
                    agree_out=-1, offers=(),
                )  # fmt: skip
            starts = (*world.starts[:r], start, *world.starts[r + 1 :])
            after = world._replace(procs=tuple(procs_after), starts=starts)
            label = (
                f"round {r} forms its group; positions "
                + ", ".join(f"{p.step}{'' if p.holds else ' (empty)'}" for p in positions)
                + f": state of step {start}"
                + (f" from rank {sources[0]}" if sources else "")
            )
            yield Move(label, Kind.PROGRESS, after, tuple(broken))

    def _agent_moves(self, world: World) -> Iterator[Move]:
        latest = _latest(world)
        if len(world.members) >= self.config.max_rounds:
            return
        members = world.members[latest]
        dead = any(world.procs[s].phase is Phase.DEAD for s in members)
        if dead:
            yield self._open(world, members, lost=True, why="a worker is gone")
        newcomer = self.config.ranks
        # A node whose workers finished their script leaves for the exit barrier: no
        # round opens for a newcomer once a member finished.
        ending = any(world.procs[s].phase is Phase.DONE for s in members)
        if self.config.newcomer and newcomer not in members and not ending:
            p = world.procs[newcomer]
            if p.phase in (Phase.STANDBY, Phase.READY):
                view = NewcomerView(
                    ready=p.phase is Phase.READY,
                    member=False,
                    may_shrink=True,
                    others=len(members),
                    min_nodes=1,
                )
                if core_newcomers.admission(view) is Admission.JOIN:
                    move = self._open(
                        world, members | {newcomer}, lost=dead, why="the newcomer joins"
                    )
                    if p.phase is not Phase.READY:
                        unready = (
                            f"{_name(newcomer, self.config)} is taken into round {latest + 1} "
                            "before it reported ready"
                        )
                        move = move._replace(broken=(("admitted-unready", unready),))
                    yield move

    def _open(self, world: World, members: frozenset[int], *, lost: bool, why: str) -> Move:
        """The agents open the next round: each live worker is handed it (and
        watched), each gone one is started afresh into it."""
        r = len(world.members)
        procs = list(world.procs)
        handed = []
        for s in sorted(members):
            p = procs[s]
            if p.phase is Phase.DEAD:
                procs[s] = _fresh(r, p)
                continue
            if p.phase is Phase.DONE:
                # Its process ended with its script: nothing to hand; whether it starts
                # again is the agent's look at it (_finished_but_handed).
                procs[s] = p._replace(inbox=r, lost=lost)
                continue
            holds = core_switch.holds_state(
                step=p.step,
                group_formed=p.formed == p.round and p.round >= 0,
                outside_a_round=p.phase in OUTSIDE_A_ROUND,
            )
            timeout = core_switch.takeover_timeout(self.config.live_timeout, holds_state=holds)
            # The worker reacts to every message in turn: a lost member's round it has
            # not reacted to yet still breaks its round, whatever the newer one says.
            missed = p.lost and not p.reacted and p.inbox > p.round
            handed_p = p._replace(inbox=r, lost=lost or missed, reacted=False, timer=timeout)
            procs[s] = self._react_now(handed_p)
            handed.append(f"{_name(s, self.config)} {timeout:g} s")
        after = World(
            tuple(procs),
            (*world.members, members),
            (*world.starts, None),
            (*world.stops, None),
            world.faults,
        )
        label = (
            f"agents open round {r} ({why}{', lost' if lost else ''}): members "
            + ", ".join(_name(s, self.config) for s in sorted(members))
            + (f"; handed with takeover timeouts {', '.join(handed)}" if handed else "")
        )
        return Move(label, Kind.PROGRESS, after)

    def _react_now(self, p: Proc) -> Proc:
        """A reaction that changes nothing but a timer (an offer, carrying on) is
        taken with the message, as the worker's inbox thread takes it: a move of its
        own would only multiply the interleavings."""
        if p.phase not in PLACE or p.hung:
            return p
        cause = Cause.NEWER_ROUND_LOST if p.lost else Cause.NEWER_ROUND
        act, _ = core_switch.react(PLACE[p.phase], cause)
        return p._replace(reacted=True) if act in (Act.OFFER, Act.CARRY_ON) else p

    def _fault_moves(self, world: World) -> Iterator[Move]:
        if world.faults >= self.config.max_faults:
            return
        for slot, p in enumerate(world.procs):
            in_job = any(slot in m for m in world.members)
            if p.phase not in ALIVE or not in_job or p.phase in (Phase.STANDBY, Phase.READY):
                continue
            where = {
                Phase.FORMING: f"before round {p.round}'s group forms",
                Phase.SYNCING: f"while round {p.round}'s state moves",
                Phase.STEPPING: f"inside step {p.step}'s collective of round {p.round}",
                Phase.CHECKING: f"reading agreement {p.agree_in} of round {p.round}",
                Phase.BETWEEN: f"waiting for the round after {p.round}",
            }[p.phase]
            dead = p._replace(phase=Phase.DEAD, timer=None, hung=False)
            label = f"{_name(slot, self.config)}: crashes {where} (fault)"
            yield Move(label, Kind.FAULT, self._set(world, slot, dead, faults=world.faults + 1))

    def _takeover(self, p: Proc, *, running: bool) -> Takeover:
        """The agent's look at ``p`` once its takeover timeout ran out (``running``)
        or its process ended."""
        timeout = self.config.live_timeout if p.timer is None else p.timer
        waited = timeout if running else 0.0
        return core_switch.takeover(
            reported_round=p.round, round_=p.inbox, running=running, waited=waited, timeout=timeout
        )

    def _finished_but_handed(self, world: World) -> Iterator[Move]:
        """A worker whose script finished in a round that can no longer finish whole
        (a member left it otherwise, or died), and that was handed a newer round: its
        agent decides at once (its process ended). While the round can still finish,
        the job may end there."""
        for slot, p in enumerate(world.procs):
            if p.phase is not Phase.DONE or p.inbox <= p.round:
                continue
            peers = [world.procs[s] for s in world.members[p.round]]
            if not any(_gone_from(q, p.round) and q.phase is not Phase.DONE for q in peers):
                continue
            if self._takeover(p, running=False) is not Takeover.RESTART:
                continue
            label = (
                f"{_name(slot, self.config)}: finished before it took round {p.inbox}: its "
                "agent starts it again"
            )
            yield Move(label, Kind.PROGRESS, self._set(world, slot, _fresh(p.inbox, p)))

    def _timeouts(self, world: World) -> Iterator[Move]:
        for slot, p in enumerate(world.procs):
            name = _name(slot, self.config)
            if p.phase not in ALIVE:
                continue
            if p.timer is not None and self._takeover(p, running=True) is Takeover.RESTART:
                broken: list[tuple[str, str]] = []
                self._ended(
                    world, slot, f"its agent started it again after {p.timer:g} s", broken,
                    fault=p.hung,
                )  # fmt: skip
                label = (
                    f"{name}: did not take round {p.inbox} within {p.timer:g} s (timeout): its "
                    "agent starts it again"
                )
                after = self._set(world, slot, _fresh(p.inbox, p))
                yield Move(label, Kind.TIMEOUT, after, tuple(broken))
            if p.hung:
                continue
            if p.phase is Phase.BETWEEN and p.inbox <= p.round:
                act, _ = core_switch.react(Place.BETWEEN, Cause.WAIT_TIMED_OUT)
                broken = []
                how = f"no round came within {self.config.live_timeout:g} s (timeout)"
                after, label = self._act(world, slot, act, how, broken)
                yield Move(label, Kind.TIMEOUT, after, tuple(broken))
            offered_round = p.inbox > p.round and p.reacted and not p.lost
            if p.phase in (Phase.STEPPING, Phase.CHECKING) and offered_round:
                label = f"{name}: the abort timer of offered round {p.inbox} fires (timeout)"
                left = p._replace(phase=Phase.BETWEEN, reacted=False, wedged=False)
                after = self._set(world, slot, left)
                yield Move(label, Kind.TIMEOUT, after)

    # -- invariants of a state

    def stall_problems(self, world: World, moves: Sequence[Move]) -> list[tuple[str, str]]:
        """What is wrong with a state in which nothing but a timeout or a fault moves."""
        if any(m.kind is Kind.PROGRESS for m in moves) or _finished(world):
            return []
        timeouts = [m for m in moves if m.kind is Kind.TIMEOUT]
        if not timeouts:
            return [("waits-forever", f"nothing moves and the job is not over: {describe(world)}")]
        hung = [s for s, p in enumerate(world.procs) if p.hung and p.phase in ALIVE]
        if not hung:
            return [
                ("timeout-without-fault", "only a timeout moves the job on, and no process "
                 f"hangs: {describe(world)}")
            ]  # fmt: skip
        found = []
        for s in hung:
            p = world.procs[s]
            if not p.holds and p.timer is not None and p.timer > core_switch.EMPTY_GRACE:
                found.append(
                    ("long-wait-for-empty", f"the job waits {p.timer:g} s for "
                     f"{_name(s, self.config)}, which holds no state")
                )  # fmt: skip
        return found


def describe(world: World) -> str:
    """One line: the rounds opened, then each worker."""
    procs = []
    for s, p in enumerate(world.procs):
        text = f"n{s}={p.phase.value}"
        if p.phase is not Phase.STANDBY:
            text += f" r{p.round} s{p.step}" + ("" if p.holds else " empty")
        if p.inbox > p.round:
            text += f" handed r{p.inbox}"
        if p.hung:
            text += " hung"
        if p.wedged:
            text += " wedged"
        procs.append(text)
    rounds = " ".join(
        f"r{r}{{{','.join(f'n{s}' for s in sorted(m))}}}" for r, m in enumerate(world.members)
    )
    return f"{rounds} | {'; '.join(procs)}"


# ---------------------------------------------------------------------- the search


def check_live_switch(config: LiveSwitchConfig | None = None) -> LiveCheckResult:
    """Explore every interleaving of ``config``'s model (breadth-first) and judge every
    state and move against the invariants (the module's docstring). Each rule's
    first violation comes with the shortest trace to it."""
    config = config or LiveSwitchConfig()
    model = _Model(config)
    started = time.perf_counter()
    first = _initial(config)
    index: dict[World, int] = {first: 0}
    parents: list[tuple[int, str]] = [(-1, "")]
    depths = [0]
    edges: list[list[int]] = []
    found: dict[str, tuple[str, int, str | None]] = {}
    transitions = 0
    queue = deque([first])
    complete = True
    while queue:
        world = queue.popleft()
        here = index[world]
        moves = model.moves(world)
        for rule, message in model.stall_problems(world, moves):
            found.setdefault(rule, (message, here, None))
        successors = []
        for move in moves:
            transitions += 1
            for rule, message in move.broken:
                found.setdefault(rule, (message, here, move.label))
            there = index.get(move.world)
            if there is None:
                if len(index) >= config.max_states:
                    complete = False
                    continue
                there = len(index)
                index[move.world] = there
                parents.append((here, move.label))
                depths.append(depths[here] + 1)
                queue.append(move.world)
            successors.append(there)
        while len(edges) <= here:
            edges.append([])
        edges[here] = successors
    if complete:
        _whole_space_problems(edges, index, found)
    states = {i: w for w, i in index.items()}
    violations = tuple(
        LiveViolation(rule, message, _trace(parents, at, last, states))
        for rule, (message, at, last) in sorted(found.items(), key=lambda item: item[1][1])
    )
    return LiveCheckResult(
        config,
        len(index),
        transitions,
        max(depths),
        time.perf_counter() - started,
        complete,
        violations,
    )


def _whole_space_problems(
    edges: list[list[int]], index: dict[World, int], found: dict[str, tuple[str, int, str | None]]
) -> None:
    """The invariants over the whole graph: the end stays reachable; no cycle."""
    states = {i: w for w, i in index.items()}
    back: list[list[int]] = [[] for _ in edges]
    for here, successors in enumerate(edges):
        for there in successors:
            back[there].append(here)
    can_finish = [False] * len(edges)
    todo = [i for i in range(len(edges)) if _finished(states[i])]
    for i in todo:
        can_finish[i] = True
    while todo:
        for before in back[todo.pop()]:
            if not can_finish[before]:
                can_finish[before] = True
                todo.append(before)
    stuck = next((i for i, ok in enumerate(can_finish) if not ok), None)
    if stuck is not None:
        message = f"the job can no longer finish: {describe(states[stuck])}"
        found.setdefault("cannot-finish", (message, stuck, None))
    # Kahn's algorithm: a state left with moves into it lies on a cycle or after one.
    into = [0] * len(edges)
    for successors in edges:
        for there in successors:
            into[there] += 1
    ready = [i for i, n in enumerate(into) if n == 0]
    seen = 0
    while ready:
        here = ready.pop()
        seen += 1
        for there in edges[here]:
            into[there] -= 1
            if into[there] == 0:
                ready.append(there)
    if seen < len(edges):
        on_cycle = next(i for i, n in enumerate(into) if n > 0)
        found.setdefault(
            "cycle", (f"a cycle of moves passes here: {describe(states[on_cycle])}", on_cycle, None)
        )


def _trace(
    parents: list[tuple[int, str]], at: int, last: str | None, states: dict[int, World]
) -> tuple[str, ...]:
    """The moves from the first state to state ``at``, then ``last`` (the move that
    broke the rule) or, for a rule about a state, that state."""
    labels = []
    here = at
    while here > 0:
        here, label = parents[here]
        labels.append(label)
    labels.reverse()
    labels.append(last if last is not None else f"state: {describe(states[at])}")
    return tuple(labels)
