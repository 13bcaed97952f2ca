"""The admission rule of a live regroup (:mod:`rallypoint.core.newcomers`), checked.

A node whose workers are being replaced asks the rule what to do while the
replacements start, and again when they are ready. The rule sees one node's
:class:`NewcomerView`, so the space of its inputs is small: this module sweeps all
of it, for clusters up to ``max_nodes``, and judges every answer against the
properties the rule exists for (docs/design.md, decision 13):

* **nobody waits for a newcomer's start-up**: when the others may train on without
  the node (they are enough for a round, and the node is not in theirs or the
  script may shrink), a node whose newcomers are not ready stays out, so no round
  forms that waits for them;
* **no pointless absence**: a node steps out only when the others can form a round
  without it (else they wait anyway, and its absence costs them a second regroup);
* **a ready newcomer is taken in**: once every newcomer is ready the node joins, so
  no node stays out of a job that could use it.

The rule is looked up at call time (``core.newcomers.admission``), so a test can
plant a variant in :data:`rallypoint.core.newcomers.ADMISSION_RULE` and see it found.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from ...core import newcomers as core_newcomers
from ...core.newcomers import Admission, NewcomerView
from ..model.invariants import others_may_train_on

__all__ = ["admission_violations", "newcomer_views"]


def newcomer_views(max_nodes: int) -> Iterator[NewcomerView]:
    """Every view a node of a cluster of up to ``max_nodes`` can have: each
    cluster size and minimum, each number of the others known gone (or, for a
    joining node, not running), readiness, membership and the script's choice."""
    flags = (False, True)
    for nodes in range(1, max_nodes + 1):
        for min_nodes, gone, ready, member, may_shrink in itertools.product(
            range(1, nodes + 1), range(nodes), flags, flags, flags
        ):
            yield NewcomerView(ready, member, may_shrink, nodes - 1 - gone, min_nodes)


def admission_violations(max_nodes: int = 8) -> list[str]:
    """The broken properties (module docstring), one line per view that breaks one;
    empty when the rule keeps them all."""
    found = []
    for view in newcomer_views(max_nodes):
        answer = core_newcomers.admission(view)
        others_go_on = others_may_train_on(view)
        if not view.ready and others_go_on and answer is not Admission.STEP_OUT:
            found.append(f"the others wait for a newcomer's start-up: {view} -> {answer.name}")
        if answer is Admission.STEP_OUT and not others_go_on:
            found.append(f"out while the others cannot go on without it: {view}")
        if view.ready and answer is not Admission.JOIN:
            found.append(f"a ready newcomer is kept out: {view} -> {answer.name}")
    return found
