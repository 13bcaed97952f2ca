"""The safety properties of docs/design.md, as plain functions over states.

One module, used by the model checker, the simulator, the hypothesis machines and
the tests. Each check returns a list of human-readable violations (empty: the
property holds), so a checker can print every broken property of a state at once.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ...core import NodeDesc, RendezvousState, Settings
from ...core.newcomers import NewcomerView

__all__ = [
    "AgreementTracker",
    "RoundResult",
    "check_admissions",
    "check_agreement",
    "check_budget",
    "check_budget_step",
    "check_exclusions",
    "check_exclusions_kept",
    "check_removal_published",
    "check_return",
    "check_state",
    "check_transition",
    "others_may_train_on",
]


def check_state(state: RendezvousState, settings: Settings) -> list[str]:
    """Properties of a single shared state.

    * complete => min_nodes <= world size <= max_nodes, every remaining participant
      has a distinct rank in 0..world-1, and if none has left yet the ranks are
      exactly 0..n-1;
    * a node is never both participant and waiting (or redundant), nor both
      participant and returning;
    * every participant is within max_nodes;
    * nobody waits beside a full complete round (no round could take it in
      without a participant leaving: see :func:`check_transition`);
    * an excluded node is never a participant (nor waiting) while excluded;
    * with a restart budget, the restarts never overspend it by more than the
      failure that ends the job, and that failure closed the rendezvous.
    """
    problems: list[str] = []
    participants = state.participants
    if state.complete:
        world = state.world_size
        if not settings.min_nodes <= world <= settings.max_nodes:
            problems.append(
                f"complete round {state.round} has world size {world}, "
                f"outside [{settings.min_nodes}, {settings.max_nodes}]"
            )
        ranks = sorted(participants.values())
        if len(set(ranks)) != len(ranks):
            problems.append(f"complete round {state.round} has duplicate ranks {ranks}")
        if any(not 0 <= r < world for r in ranks):
            problems.append(
                f"complete round {state.round} has ranks {ranks} outside 0..{world - 1}"
            )
        if len(participants) == world and ranks != list(range(world)):
            problems.append(f"complete round {state.round} has ranks {ranks}, not 0..{world - 1}")
        if len(participants) > world:
            problems.append(f"complete round {state.round} has more participants than world size")
    elif state.world_size != 0:
        problems.append(f"incomplete round {state.round} has world size {state.world_size}")
    if len(participants) > settings.max_nodes:
        problems.append(f"{len(participants)} participants exceed max_nodes {settings.max_nodes}")
    both = set(participants) & (state.wait_list | state.redundancy_list)
    if both:
        problems.append(f"nodes {sorted(map(str, both))} are participants and waiting/redundant")
    if state.wait_list & state.redundancy_list:
        problems.append("a node is both waiting and redundant")
    if state.returning and not state.returning.isdisjoint(participants):
        problems.append("a node is both a participant and returning")
    if state.complete and state.wait_list and len(participants) >= settings.max_nodes:
        problems.append(
            f"nodes {sorted(map(str, state.wait_list))} wait beside full complete round "
            f"{state.round}"
        )
    if state.excluded:
        problems.extend(check_exclusions(state))
    if state.restarts or state.charged_through:
        problems.extend(check_budget(state, settings))
    return problems


def _exclusions(
    state: RendezvousState, nodes: Iterable[NodeDesc] | None
) -> list[tuple[NodeDesc, int]]:
    """(node, first round back) of every node ``state`` excludes, or of ``nodes`` only."""
    excluded = state.excluded
    if nodes is None:
        return list(excluded.items())
    return [(n, excluded[n]) for n in nodes if n in excluded]


def check_exclusions(state: RendezvousState, nodes: Iterable[NodeDesc] | None = None) -> list[str]:
    """An excluded node is never a participant (nor waiting) while excluded: of
    every excluded node, or of ``nodes`` only (a simulator checking the entries
    a write touched)."""
    problems: list[str] = []
    for node, until in _exclusions(state, nodes):
        if until > state.round and (node in state.participants or node in state.wait_list):
            problems.append(f"{node} is excluded until round {until} but is a member")
    return problems


def check_budget(state: RendezvousState, settings: Settings) -> list[str]:
    """The job-wide restart budget of one state: the restarts never overspend it
    by more than the failure that ends the job, and that failure closed the
    rendezvous; the restarts are counted through a round no later than the next."""
    problems: list[str] = []
    budget = settings.restart_budget
    if budget is not None and state.restarts > budget and not state.closed:
        problems.append(f"{state.restarts} restarts spent a budget of {budget}; still open")
    if budget is not None and state.restarts > budget + 1:
        problems.append(f"{state.restarts} restarts overspend the budget of {budget}")
    if state.charged_through > state.round + 1:
        problems.append(
            f"the restarts are counted through round {state.charged_through - 1}, "
            f"after round {state.round}"
        )
    return problems


def check_budget_step(before: RendezvousState, after: RendezvousState, steps: int = 1) -> list[str]:
    """The restart budget never grows back: the count of restarts never
    decreases, nor does the round they are counted through; and one step counts
    one failure at most (``steps`` steps, ``steps`` failures)."""
    problems: list[str] = []
    if after.restarts < before.restarts or after.charged_through < before.charged_through:
        problems.append(
            f"the restart count went back from {before.restarts} (through round "
            f"{before.charged_through}) to {after.restarts} (through {after.charged_through})"
        )
    counted = after.restarts - before.restarts
    if counted > steps:
        if steps == 1:
            problems.append(f"one step counted {counted} failures")
        else:
            problems.append(f"{steps} steps counted {counted} failures")
    return problems


def check_exclusions_kept(
    before: RendezvousState, after: RendezvousState, nodes: Iterable[NodeDesc] | None = None
) -> list[str]:
    """An exclusion is never cut short: a node excluded until a round after
    ``after``'s stays excluded until then (of every node excluded in ``before``,
    or of ``nodes`` only)."""
    problems: list[str] = []
    for node, until in _exclusions(before, nodes):
        if until > after.round and after.excluded.get(node, 0) < until:
            problems.append(f"{node}'s exclusion until round {until} was cut short")
    return problems


def check_transition(
    before: RendezvousState, after: RendezvousState, *, steps: int = 1
) -> list[str]:
    """Properties of one step: closed never reverts, round never decreases, a
    complete round stays complete until the round advances, and its world size and
    ranks never change and nobody joins it; the restart budget never grows back
    (the count of restarts never decreases, nor does the round they are counted
    through), one step counts one failure at most, and an exclusion is never cut
    short.

    And one round per arrival (no restart storm): a step that completes a round
    leaves nobody waiting. A node still waiting then did not join the round
    that formed without it; left waiting, it would make the participants regroup
    at once, and again after every round it does not join (a node stuck after
    announcing itself, its heartbeat still moving, costs a round each time). So
    the participants regroup for waiting nodes only for one that asked to join
    after their round formed: a bounded number of rounds per real arrival.

    With ``steps``, ``before -> after`` spans that many steps (a simulator that
    checks a state whole every few writes): each property above holds across
    several steps when it holds across each, but for the count of failures, of
    which ``steps`` steps may count ``steps``, and the one about completions,
    checked for one step only (a node may wait once the round formed).
    """
    problems: list[str] = []
    if after.restarts != before.restarts or after.charged_through != before.charged_through:
        problems.extend(check_budget_step(before, after, steps))
    if before.excluded:
        problems.extend(check_exclusions_kept(before, after))
    if before.closed and not after.closed:
        problems.append("a closed rendezvous was reopened")
    if after.round < before.round:
        problems.append(f"round went back from {before.round} to {after.round}")
    if steps == 1 and after.complete and after.wait_list and not before.complete:
        problems.append(
            f"round {after.round} completed with {sorted(map(str, after.wait_list))} still "
            "waiting: they would make it regroup at once for nodes it formed without"
        )
    if before.complete and not after.complete and before.round == after.round:
        problems.append(f"complete round {after.round} became incomplete without advancing")
    if before.complete and after.complete and before.round == after.round:
        if before.world_size != after.world_size:
            problems.append(f"world size of complete round {after.round} changed")
        for node, rank in after.participants.items():
            if before.participants.get(node, rank) != rank:
                problems.append(f"rank of {node} changed within complete round {after.round}")
            if node not in before.participants:
                problems.append(f"{node} joined complete round {after.round}")
    return problems


def check_return(
    node: NodeDesc,
    state: RendezvousState,
    round_: int,
    rank: int,
    world_size: int,
    membership: Collection[NodeDesc],
) -> list[str]:
    """A join that returns on ``state`` tells what ``state`` holds: its complete
    round, world size, ``node``'s rank and the participants.

    Where every return is read atomically off the shared state (the model
    checker), this and :func:`check_transition` together imply
    :func:`check_agreement` for any two returns of one round: a complete round
    keeps its world size and ranks, and only loses participants, until it
    advances, so every view returned in it is a part of the participants it
    completed with, ranked as they were.
    """
    problems: list[str] = []
    if not state.complete:
        problems.append(f"{node} returned from round {state.round}, which is not complete")
    if round_ != state.round or world_size != state.world_size:
        problems.append(
            f"{node} returned round {round_} of world size {world_size} on round "
            f"{state.round} of world size {state.world_size}"
        )
    if rank != state.participants.get(node):
        problems.append(
            f"{node} returned rank {rank}; the state gives it {state.participants.get(node)}"
        )
    if frozenset(membership) != frozenset(state.participants):
        problems.append(
            f"{node} returned members {sorted(map(str, membership))}; the round's "
            f"participants are {sorted(map(str, state.participants))}"
        )
    return problems


def check_removal_published(
    node: NodeDesc,
    before: RendezvousState,
    silent: Iterable[NodeDesc],
    declared: Iterable[NodeDesc],
    written: RendezvousState,
) -> list[str]:
    """A node that finds members dead publishes their removal in the same step.

    ``node`` stepped on the shared state ``before``, its view showing the members
    ``silent`` silent for longer than the liveness window, on heartbeat counters
    read at that instant; ``declared`` is what its step declared dead, ``written``
    the shared state after the step. (The core never declares the observer itself
    dead, so the model checker passes only the peers as ``silent``.) Then:

    * exactly the silent members are declared dead (no live one, none left over);
    * none of them is still in ``written``: the removal is published at once, even
      when the node's own operation would only wait or return, so every node
      converges on it instead of each waiting out the window. The node itself may
      be back as a new entry (its heartbeat counter moved): it removed its stale
      entry and joined again in one write.
    """
    if not silent and not declared:
        return []  # (most steps: nobody silent, nobody declared)
    members = before.heartbeats
    silent = frozenset(n for n in silent if n in members)
    declared = frozenset(declared)
    if not silent and not declared:
        return []
    problems: list[str] = []
    if silent - declared:
        problems.append(
            f"{node} saw {sorted(map(str, silent - declared))} silent too long "
            "but did not declare them dead"
        )
    if declared - silent:
        problems.append(
            f"{node} declared {sorted(map(str, declared - silent))} dead, "
            "whose heartbeats it saw move"
        )
    still = written.members().union(written.heartbeats)
    kept = sorted(
        str(n)
        for n in silent
        if n in still and not (n == node and written.heartbeats.get(n) not in (None, members[n]))
    )
    if kept:
        problems.append(
            f"{node} found {kept} dead but did not publish their removal: "
            "the state after its step still holds them"
        )
    return problems


def _admitted_by(writer: NodeDesc, before: RendezvousState, after: RendezvousState) -> bool:
    """Whether ``writer`` became a member, or went from waiting to participant."""
    return (writer not in before.members() and writer in after.members()) or (
        writer in before.wait_list and writer in after.participants
    )


def _cursor_problems(
    round_: int, same_round: bool, entries: Sequence[NodeDesc], start: int, cursor: int
) -> list[str]:
    """The intent cursor only grows within a round and stays within its log."""
    problems = []
    if same_round and cursor < start:
        problems.append(f"the intent cursor of round {round_} went back from {start} to {cursor}")
    if cursor > len(entries):
        problems.append(
            f"the intent cursor of round {round_} is {cursor}, past the end of "
            f"its log ({len(entries)} entries)"
        )
    return problems


def check_admissions(
    writer: NodeDesc,
    before: RendezvousState,
    sanitized: RendezvousState,
    written: RendezvousState,
    admitted: Sequence[NodeDesc],
    log: Sequence[NodeDesc],
    new_log: Sequence[NodeDesc] = (),
) -> list[str]:
    """Batched admission: one write by ``writer`` of ``written`` over the shared
    state ``before``, decided on ``sanitized`` (``before`` with the nodes the writer
    declared dead removed), naming ``admitted`` as the other nodes it admits.

    ``log`` is the intent log of ``before``'s round as the step saw it; ``new_log``
    the log of the next round, for a write that starts it. Then:

    * the cursor only grows within a round and never passes the end of its log (a
      new round's cursor counts that round's log, from 0);
    * every node the write made a member (or moved from the wait list to the
      participants), other than the writer, is named in ``admitted``, once, and
      nobody else is;
    * an admitted node had announced itself in the log of the round it is admitted
      to (an entry past the cursor), a waiting node too: a node is never admitted
      from the wait list alone, or one that never acts again would hold a place in
      the round;
    * a node admitted (the writer included) while it has an entry past the cursor
      has that entry consumed: the cursor moves past it, so every entry admits its
      node at most once.
    """
    same_round = written.round == before.round
    entries, start = (log, before.intent_cursor) if same_round else (new_log, 0)
    cursor = written.intent_cursor
    problems = _cursor_problems(written.round, same_round, entries, start, cursor)
    pending = frozenset(entries[start:])
    left = frozenset(entries[max(cursor, start) :])
    # Members of the written state that were not members before, or that went from
    # the wait list to the participants (_admitted_by, for every member at once).
    members = written.members()
    joined = set(members - sanitized.members())
    joined.update(sanitized.wait_list & frozenset(written.participants))
    joined.discard(writer)
    named = list(admitted)
    if len(set(named)) != len(named):
        problems.append(f"{writer} admitted a node twice in one write: {[str(n) for n in named]}")
    if set(named) != joined:
        problems.append(
            f"{writer}'s write admitted {sorted(map(str, joined))} but names "
            f"{sorted(map(str, named))} as admitted"
        )
    for n in sorted(joined):
        if n not in pending:
            problems.append(
                f"{writer} admitted {n} to round {written.round}, which did not announce "
                "itself in that round's intent log (past the cursor)"
            )
    newly = sorted(joined | ({writer} if _admitted_by(writer, sanitized, written) else set()))
    for n in newly:
        if n in pending and n in left:
            problems.append(
                f"{n} was admitted to round {written.round} but its intent log entry stays "
                "past the cursor: a later batch would admit it again"
            )
    return problems


@dataclass(frozen=True)
class RoundResult:
    """What one node was told when its join returned."""

    round: int
    rank: int
    world_size: int
    #: the nodes of the round as the node saw them (any collection of nodes)
    membership: Collection[NodeDesc]


def check_agreement(results: Mapping[NodeDesc, RoundResult]) -> list[str]:
    """No split brain: nodes returning from the same round agree on the world size,
    hold distinct ranks within it, and saw memberships of one group.

    Participants may leave a complete round one by one (an exit, or a peer declared
    dead), so a node that returns later may see a subset of what an earlier one saw;
    that is not a disagreement. Two views of one round disagree when together they
    name more nodes than the world size, or a node returned without being a member
    of its own view.
    """
    problems: list[str] = []
    by_round: dict[int, dict[NodeDesc, RoundResult]] = {}
    for node, result in results.items():
        by_round.setdefault(result.round, {})[node] = result
    for round_, members in sorted(by_round.items()):
        sizes = {r.world_size for r in members.values()}
        if len(sizes) > 1:
            problems.append(f"round {round_}: nodes disagree on the world size: {sorted(sizes)}")
        union = frozenset().union(*(r.membership for r in members.values()))
        world = max(sizes)
        if len(union) > world:
            problems.append(
                f"round {round_}: nodes disagree on membership: their views name "
                f"{len(union)} nodes for a world of {world}"
            )
        ranks = [r.rank for r in members.values()]
        if len(set(ranks)) != len(ranks):
            problems.append(f"round {round_}: two nodes returned with the same rank")
        if any(not 0 <= r < world for r in ranks):
            problems.append(f"round {round_}: a rank in {sorted(ranks)} is outside 0..{world - 1}")
        for node, r in members.items():
            if node not in r.membership:
                problems.append(f"round {round_}: {node} returned but is not a member")
    return problems


class AgreementTracker:
    """:func:`check_agreement`, fed one returned join at a time.

    For long simulations: a membership is merged into the round's union once per
    distinct object (nodes that returned on the same state share it), so an
    :meth:`add` costs O(1) unless it brings a membership nobody returned with yet.
    ``membership`` may be any collection of nodes (a set, or the round's
    node -> rank map).
    """

    def __init__(self) -> None:
        self._world: dict[int, int] = {}
        self._ranks: dict[int, dict[int, NodeDesc]] = {}
        self._union: dict[int, set[NodeDesc]] = {}
        #: per round: id -> membership object already merged (kept alive, so an
        #: id is never reused for another object while it is here)
        self._merged: dict[int, dict[int, object]] = {}

    def add(self, node: NodeDesc, result: RoundResult) -> list[str]:
        """Record that ``node`` returned ``result``; the properties it breaks."""
        problems: list[str] = []
        round_ = result.round
        world = self._world.setdefault(round_, result.world_size)
        if result.world_size != world:
            sizes = sorted({world, result.world_size})
            problems.append(f"round {round_}: nodes disagree on the world size: {sizes}")
        ranks = self._ranks.setdefault(round_, {})
        holder = ranks.setdefault(result.rank, node)
        if holder != node:
            problems.append(f"round {round_}: two nodes returned with the same rank")
        if not 0 <= result.rank < max(world, result.world_size):
            problems.append(f"round {round_}: a rank in [{result.rank}] is outside 0..{world - 1}")
        union = self._union.setdefault(round_, set())
        merged = self._merged.setdefault(round_, {})
        if merged.get(id(result.membership)) is not result.membership:
            merged[id(result.membership)] = result.membership
            union.update(result.membership)
        if len(union) > max(world, result.world_size):
            problems.append(
                f"round {round_}: nodes disagree on membership: their views name "
                f"{len(union)} nodes for a world of {world}"
            )
        if node not in result.membership:
            problems.append(f"round {round_}: {node} returned but is not a member")
        return problems


def others_may_train_on(view: NewcomerView) -> bool:
    """The properties' own reading of a view (not the rule's): the others are enough
    for a round without the node, and the node is not in their round or the
    script lets their world shrink. The admission sweep and the simulator judge by it."""
    return view.others >= view.min_nodes and (view.may_shrink or not view.member)
