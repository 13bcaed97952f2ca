"""The live regroup's admission rule: when a node whose workers are being replaced
is out of the group, and when it comes back. The core's rule on the cases a user
meets, the sweep of every view finding no broken property, and the sweep finding
each likely bug planted in the rule; then nodes that follow the rule in the
simulator, and the simulator's checks finding a planted bug in a running job."""

from __future__ import annotations

import dataclasses

import pytest

from rallypoint.core import newcomers as core_newcomers
from rallypoint.core.newcomers import ADMISSION_RULE, Admission, NewcomerView, admission
from rallypoint.spec.check.admission import admission_violations, newcomer_views
from rallypoint.spec.simulator import SimConfig, Simulator


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


# -- the rule in the simulator: nodes that follow it, in a running job ------------------


def _live_job(seed: int = 0) -> Simulator:
    """4 nodes, --nnodes 2:4, newcomers ready 3 s after they start; trained for 10 s."""
    sim = Simulator(SimConfig(nodes=4, min_nodes=2, seed=seed, duration=60.0, newcomer_startup=3.0))
    sim.run_until(10.0)
    assert sim.state.complete and len(sim.state.participants) == 4
    return sim


def test_the_others_train_on_while_a_nodes_replacements_start_then_it_is_taken_in() -> None:
    sim = _live_job()
    failed_at = sim.now
    sim.fail_workers(0)
    sim.run_until(failed_at + 2.5)
    # Out of the rendezvous: the three others completed a round without it.
    assert sim.nodes[0].outside and sim.nodes[0].desc not in sim.state.participants
    assert any(r.size == 3 and r.completed > failed_at for r in sim.report.rounds)
    sim.run_until(failed_at + 8.0)
    assert not sim.nodes[0].outside and sim.nodes[0].desc in sim.state.participants
    assert any(r.size == 4 and r.completed > failed_at + 3.0 for r in sim.report.rounds)
    assert sim.report.stepped_out == 1 and not sim.report.violations


def test_a_starting_node_joins_a_running_job_once_its_workers_are_ready() -> None:
    sim = _live_job()
    crashed_at = sim.now
    sim.crash(1)  # restarts after restart_delay as a new process
    sim.run_until(crashed_at + sim.config.restart_delay + 1.0)
    assert sim.nodes[1].alive and sim.nodes[1].outside
    sim.run_until(crashed_at + sim.config.restart_delay + 6.0)
    assert sim.nodes[1].desc in sim.state.participants and len(sim.state.participants) == 4
    assert not sim.report.violations


def test_a_job_that_may_not_shrink_waits_for_the_replacements_in_the_round() -> None:
    sim = Simulator(
        SimConfig(nodes=4, min_nodes=2, duration=60.0, newcomer_startup=3.0, may_shrink=False)
    )
    sim.run_until(10.0)
    before = sim.report.joined_unready  # the nodes that started the job, in at once
    sim.fail_workers(0)
    sim.run_until(20.0)
    assert sim.report.stepped_out == 0 and sim.report.joined_unready == before + 1
    assert not sim.report.violations


@pytest.mark.parametrize(
    ("cell", "planted", "broken"),
    [
        ((False, True), Admission.JOIN, "waits for the start-up of"),
        ((True, True), Admission.STEP_OUT, "newcomers are ready but it stays out"),
    ],
    ids=["admit before ready", "never take it back"],
)
def test_the_simulator_finds_a_planted_variant_in_a_running_job(
    monkeypatch: pytest.MonkeyPatch, cell: tuple[bool, bool], planted: Admission, broken: str
) -> None:
    monkeypatch.setattr(core_newcomers, "ADMISSION_RULE", {**ADMISSION_RULE, cell: planted})
    sim = _live_job()
    sim.fail_workers(0)
    sim.run_until(sim.now + 8.0)
    problems = [p for v in sim.report.violations for p in v.problems]
    assert problems and all(broken in p for p in problems), problems[:3]
