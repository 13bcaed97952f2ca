"""Readable traces of the checker: states in one line, steps narrated, violations replayed.

The search keeps only fingerprints and parent pointers; a violation is replayed
from the initial state (:func:`replay`) with the steps narrating what they did.
Node names stay stable along a trace although the search relabels nodes.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

from ...core import Announce, Decision, Done, NodeDesc, Operator, Write
from .state import Age, Deadline, Event, Found, Global, Local, Timers, node_of

if TYPE_CHECKING:
    from .steps import Steps
    from .symmetry import Symmetry

__all__ = ["Replay", "describe", "narrate", "replay"]

_NODE_RE = re.compile(r"\bn(\d+)_(\d+)_0\b")


def describe(g: Global, names: list[str] | None = None) -> str:
    """One line per state for traces: the shared state, then every node.

    ``I{...}`` are the joiners in the round's intent log past the cursor;
    ``B{...}`` the nodes returning from the last complete round, and ``regroup``
    an open round that only they joined so far;
    ``X{node:round}`` the excluded nodes and the round each may join again; the
    restarts charged to the budget show with the round they are counted through. A node
    shows its phase, its operation (``/join``), and ``timed-out`` or
    ``past-rollback`` for its deadline. What a node's timers showed at a step is
    in that step's line of the trace.
    """
    names = names or [f"n{i}" for i in range(len(g.locals))]
    s = g.shared
    parts = [
        f"round={s.round}",
        "complete" if s.complete else "open",
        *(["closed"] if s.closed else []),
        f"world={s.world_size}" if s.complete else "",
        "P{" + ", ".join(f"{_name(n, names)}:{r}" for n, r in sorted(s.participants.items())) + "}",
    ]
    if s.wait_list:
        parts.append("W{" + ", ".join(sorted(_name(n, names) for n in s.wait_list)) + "}")
    if s.redundancy_list:
        parts.append("R{" + ", ".join(sorted(_name(n, names) for n in s.redundancy_list)) + "}")
    if s.returning:
        parts.append("B{" + ", ".join(sorted(_name(n, names) for n in s.returning)) + "}")
    if s.regroup and not s.complete:
        parts.append("regroup")
    if s.last_call is not None:
        parts.append("last-call armed")
    if s.restarts or s.charged_through:
        parts.append(f"restarts={s.restarts} through-round={s.charged_through}")
    if s.excluded:
        parts.append(
            "X{" + ", ".join(sorted(f"{_name(n, names)}:{u}" for n, u in s.excluded.items())) + "}"
        )
    if g.intents:
        parts.append("I{" + ", ".join(sorted(_name(n, names) for n in g.intents)) + "}")
    nodes = []
    for i, loc in enumerate(g.locals):
        text = f"{_display(g, i, names)}={loc.phase}" + (f"/{loc.op}" if loc.op else "")
        if loc.deadline is Deadline.TIMED_OUT:
            text += " timed-out"
        elif loc.deadline is Deadline.PAST:
            text += " past-rollback"
        if loc.round_ended:
            text += " round-ended"
        nodes.append(text)
    return " ".join(p for p in parts if p) + " | " + "; ".join(sorted(nodes))


def narrate(
    loc: Local,
    timers: Timers,
    deadline: Deadline | None,
    op: Operator,
    decision: Decision,
    g: Global | None = None,
    read_log: bool = False,
) -> list[str]:
    """What a step did, for traces: what its timers showed, then the decision."""
    lines = []
    if loc.op is not None and deadline != loc.deadline:
        lines.append("deadline passed" if deadline is Deadline.TIMED_OUT else "rollback over")
    if timers.own is not Age.FRESH:
        lines.append(f"own heartbeat {timers.own}")
    if timers.last_call_over:
        lines.append("last call over")
    if timers.expired:
        lines.append(f"sees {sorted(map(str, timers.expired))} silent too long")
    if timers.contended:
        lines.append("lost a compare-and-set since its last wait (contended)")
    if decision.dead:
        lines.append(f"declares dead {sorted(map(str, decision.dead))}")
    if read_log and g is not None:
        lines.append(f"reads the intent log {sorted(map(str, g.intents))}")
    action = "nothing" if decision.action is None else decision.action.name
    name = getattr(op, "trace_name", type(op).__name__)
    lines.append(f"{name} -> {action} ({_instruction_text(decision)})")
    return lines


def _instruction_text(decision: Decision) -> str:
    instruction = decision.instruction
    if isinstance(instruction, Write) and instruction.action is None:
        what = "publishes the removal first"
    elif isinstance(instruction, Write) and instruction.admitted:
        what = f"write, admitting {[str(n) for n in instruction.admitted]}"
    elif isinstance(instruction, Announce):
        what = f"announces itself in the intent log of round {instruction.round}"
    elif isinstance(instruction, Done) and instruction.rejoin:
        what = "done, but the round lost its rank 0: rejoin"
    else:
        what = type(instruction).__name__.lower()
    if isinstance(instruction, Write) and instruction.phase is not None:
        what += ", new phase"
    return what


class Replay(NamedTuple):
    """A replayed path: its trace, and the problems of the violation it ends in
    (in the trace's node names; None when the path's last step broke nothing)."""

    trace: list[str]
    problems: list[str] | None


def replay(steps: Steps, symmetry: Symmetry, initial: Global, events: list[Event]) -> Replay:
    """A readable trace of ``events`` from ``initial``.

    Node names stay stable along the trace although the search relabels nodes:
    ``names`` follows each canonical slot back to the slot it started as.
    """
    steps.narrate = True
    try:
        return _replay(steps, symmetry, initial, events)
    finally:
        steps.narrate = False


def _replay(steps: Steps, symmetry: Symmetry, initial: Global, events: list[Event]) -> Replay:
    g, perm, _ = symmetry.canonical(initial)
    names = [""] * len(g.locals)
    for old, new in enumerate(perm):
        names[new] = f"n{old}"
    lines = [f"  0. initial: {describe(g, names)}"]
    for k, event in enumerate(events, 1):
        who = _display(g, event.slot, names)
        try:
            succ, what = steps.successor(g, event)
        except Found as found:
            renamed = [_rename(p, names) for p in found.problems]
            text = "; ".join(renamed)
            did = "".join(f"{_rename(line, names)}; " for line in found.lines)
            lines.append(f"{k:3}. {who} {event.kind}: {did}VIOLATES {text}")
            return Replay(lines, renamed)
        succ = symmetry.normalize(succ, shift_rounds=False)
        text = _rename("; ".join(what), names)
        lines.append(f"{k:3}. {who} {event.kind}: {text}")
        g, perm, _ = symmetry.canonical(succ)
        moved = [""] * len(names)
        for old, new in enumerate(perm):
            moved[new] = names[old]
        names = moved
        lines.append(f"     -> {describe(g, names)}")
    return Replay(lines, None)


def _display(g: Global, slot: int, names: list[str]) -> str:
    inc = g.locals[slot].incarnation
    return names[slot] + (f"'{inc}" if inc else "")


def _rename(text: str, names: list[str]) -> str:
    """``text`` with node ids (``n1_101_0``) replaced by their trace names."""
    return _NODE_RE.sub(lambda m: _name(node_of(int(m[1]), int(m[2]) - 100), names), text)


def _name(n: NodeDesc, names: list[str]) -> str:
    base = names[int(n.addr[1:])]
    return base + (f"'{n.pid - 100}" if n.pid != 100 else "")
