"""When a node with newcomers takes part in the group (live regroup).

Nobody waits for a newcomer's start-up (docs/design.md, decision 13). A node that
lost a worker starts its replacement outside the group; a node that joins a running
job (a replacement node, a spare, a scale-up) starts its workers' processes before
it joins. Until its newcomers are *ready* (a replaced worker: its interpreter,
imports and script up to ``job.rounds()``; a joining node's: interpreter and
imports), the node is either out of the rendezvous, so that the others train on
(in a smaller world, or in the one they have), or in it, so that the others wait
(they cannot go on without it). Once ready, it joins; the rendezvous' own rules
then admit it: it waits in the wait list and the others open the next round at a
step boundary.

:data:`ADMISSION_RULE` is the whole rule, one cell per case; :func:`admission`
looks a node's case up in it. The agent carries the answer out (leave the round,
wait, join) and asks again whenever the newcomer's readiness changes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ADMISSION_RULE", "Admission", "NewcomerView", "admission", "others_go_on"]


class Admission(enum.Enum):
    """What a node with newcomers does now."""

    #: take part in the next round now (its newcomers are ready, or the others
    #: cannot form a round without this node anyway)
    JOIN = "join"
    #: be out of the rendezvous while the newcomers start: the others regroup without
    #: this node and train on; join once they are ready
    STEP_OUT = "step_out"


@dataclass(frozen=True)
class NewcomerView:
    """What one node knows when it decides.

    Attributes:
        ready: every newcomer of this node reported ready.
        member: the node is in the others' round (it lost a worker): without it,
            their world shrinks. False for a node joining a running job.
        may_shrink: the script declared that the job may train on without some of
            its workers for a while (``live.Job(may_shrink=True)``).
        others: the nodes that train (or would) without this one: the participants
            of its round besides itself that are still in the job, or, for a
            joining node, those of the running round (0: none runs).
        min_nodes: the rendezvous' minimum.
    """

    ready: bool
    member: bool
    may_shrink: bool
    others: int
    min_nodes: int


def others_go_on(view: NewcomerView) -> bool:
    """Whether the others may train on without this node: they are enough for a
    round by themselves, and either this node is not in their round or the script
    allows a smaller world."""
    return view.others >= view.min_nodes and (view.may_shrink or not view.member)


#: (the newcomers are ready, the others may go on without this node) -> what to do
ADMISSION_RULE: Mapping[tuple[bool, bool], Admission] = {
    (True, True): Admission.JOIN,
    (True, False): Admission.JOIN,
    # Not ready, but the others need this node for any round: they wait whatever it
    # does, so it joins now and saves them a second regroup.
    (False, False): Admission.JOIN,
    (False, True): Admission.STEP_OUT,
}


def admission(view: NewcomerView) -> Admission:
    """What a node with newcomers does now (:data:`ADMISSION_RULE`)."""
    return ADMISSION_RULE[(view.ready, others_go_on(view))]
