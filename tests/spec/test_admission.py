"""The live regroup's admission rule: when a node whose workers are being replaced
is out of the group, and when it comes back. The core's rule on the cases a user
meets, the sweep of every view finding no broken property, and the sweep finding
each likely bug planted in the rule."""

from __future__ import annotations

import dataclasses

import pytest

from rallypoint.core import newcomers as core_newcomers
from rallypoint.core.newcomers import ADMISSION_RULE, Admission, NewcomerView, admission
from rallypoint.spec.check.admission import admission_violations, newcomer_views


def test_a_data_parallel_job_trains_on_without_a_node_whose_worker_restarts() -> None:
    # 4 nodes, --nnodes 3:4: the three others form a round by themselves.
    view = NewcomerView(ready=False, member=True, may_shrink=True, others=3, min_nodes=3)
    assert admission(view) is Admission.STEP_OUT
    assert admission(dataclasses.replace(view, ready=True)) is Admission.JOIN


def test_a_node_joining_a_running_job_gets_ready_first_whatever_the_script() -> None:
    view = NewcomerView(ready=False, member=False, may_shrink=False, others=2, min_nodes=2)
    assert admission(view) is Admission.STEP_OUT
    assert admission(dataclasses.replace(view, ready=True)) is Admission.JOIN
    # The job starts as a whole: no round runs, so nobody waits for it.
    assert admission(dataclasses.replace(view, others=0)) is Admission.JOIN


@pytest.mark.parametrize(
    ("may_shrink", "others", "min_nodes"),
    [(False, 3, 3), (True, 3, 4), (True, 2, 3)],
    ids=["every rank is needed", "--nnodes 4:4", "another node is gone too"],
)
def test_a_node_the_others_cannot_do_without_stays_in(
    may_shrink: bool, others: int, min_nodes: int
) -> None:
    view = NewcomerView(
        ready=False, member=True, may_shrink=may_shrink, others=others, min_nodes=min_nodes
    )
    assert admission(view) is Admission.JOIN


def test_the_sweep_covers_every_cell_of_the_rule() -> None:
    cells = {(view.ready, core_newcomers.others_go_on(view)) for view in newcomer_views(3)}
    assert cells == set(ADMISSION_RULE)


def test_the_rule_keeps_every_property_for_clusters_up_to_sixteen_nodes() -> None:
    assert admission_violations(16) == []


@pytest.mark.parametrize(
    ("cell", "planted", "broken"),
    [
        ((False, True), Admission.JOIN, "the others wait for a newcomer's start-up"),
        ((False, False), Admission.STEP_OUT, "out while the others cannot go on"),
        ((True, True), Admission.STEP_OUT, "a ready newcomer is kept out"),
    ],
    ids=["admit before ready", "step out for nothing", "never take it back"],
)
def test_a_planted_variant_of_the_rule_is_found(
    monkeypatch: pytest.MonkeyPatch, cell: tuple[bool, bool], planted: Admission, broken: str
) -> None:
    monkeypatch.setattr(core_newcomers, "ADMISSION_RULE", {**ADMISSION_RULE, cell: planted})
    found = admission_violations(4)
    assert found and all(line.startswith(broken) for line in found), found[:3]
