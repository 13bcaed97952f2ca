"""The transitions model of one node's lifecycle: edges, guards, mapping, diagram."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.examples import examples
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.core import NodeDesc, Observations, RendezvousState, Settings
from rallypoint.core.state import HeartbeatSighting, LastCallSighting
from rallypoint.spec.model.machine import (
    LOCAL_PHASES,
    MODEL_STATES,
    MODEL_TRANSITIONS,
    TERMINAL_STATES,
    Guards,
    Lifecycle,
    LifecycleModel,
    ModelUnavailableError,
    Phase,
    View,
    diagram_source,
    lifecycle_state,
    write_diagram,
)

A, B, C = NodeDesc("a", 1, 0), NodeDesc("b", 1, 0), NodeDesc("c", 1, 0)
SETTINGS = Settings("m", min_nodes=2, max_nodes=3, last_call_timeout=1.0, keep_alive_interval=1.0)
GUARD_NAMES = list(Guards._fields)


def guards(**true: bool) -> Guards:
    values = dict.fromkeys(GUARD_NAMES, False)
    values.update(true)
    return Guards(**values)


@pytest.fixture(scope="module")
def model() -> LifecycleModel:
    return LifecycleModel()


def test_joining_an_open_round_makes_a_participant(model: LifecycleModel) -> None:
    g = guards(round_open=True)
    assert model.allows("joining", "add_to_participants", "participant", g)
    assert not model.allows("joining", "add_to_participants", "complete", g)


def test_the_arrival_that_fills_the_round_completes_it(model: LifecycleModel) -> None:
    g = guards(round_open=True, fills_round=True)
    assert model.allows("joining", "add_to_participants", "complete", g)
    assert not model.allows("joining", "add_to_participants", "participant", g)


def test_a_complete_round_is_not_joined(model: LifecycleModel) -> None:
    g = guards(round_complete=True, round_full=True)
    assert not model.allows("joining", "add_to_participants", "participant", g)
    assert model.allows("joining", "add_to_redundancy_list", "redundant", g)
    assert not model.allows("joining", "add_to_wait_list", "waiting", g)
    assert model.allows("joining", "add_to_wait_list", "waiting", guards(round_complete=True))


def test_completion_needs_quorum_and_the_last_call(model: LifecycleModel) -> None:
    ok = guards(quorum=True, last_call_over=True)
    assert model.allows("participant", "mark_rendezvous_complete", "complete", ok)
    assert not model.allows(
        "participant", "mark_rendezvous_complete", "complete", guards(quorum=True)
    )
    early = guards(last_call_over=True)
    assert not model.allows("participant", "mark_rendezvous_complete", "complete", early)


def test_keep_alive_is_internal_and_only_when_due(model: LifecycleModel) -> None:
    assert model.allows("waiting", "keep_alive", "waiting", guards(keep_alive_due=True))
    assert not model.allows("waiting", "keep_alive", "waiting", guards())
    assert not model.allows("idle", "keep_alive", "idle", guards(keep_alive_due=True))


def test_rollback_only_after_the_deadline(model: LifecycleModel) -> None:
    late = guards(timed_out=True, within_rollback=True)
    assert model.allows("participant", "remove_from_participants", "joining", late)
    assert not model.allows("participant", "remove_from_participants", "joining", guards())
    assert model.allows("training", "remove_from_participants", "exited", guards())
    assert not model.allows("redundant", "timeout", "failed", guards(timed_out=True))


def test_an_unknown_trigger_is_not_allowed(model: LifecycleModel) -> None:
    assert not model.allows("idle", "no_such_trigger", "idle", guards())


guard_values = st.builds(Guards, **{name: st.booleans() for name in GUARD_NAMES})
triggers = sorted({t["trigger"] for t in MODEL_TRANSITIONS})


@examples(300, deadline=None)
@given(
    source=st.sampled_from(MODEL_STATES),
    trigger=st.sampled_from(triggers),
    dest=st.sampled_from(MODEL_STATES),
    g=guard_values,
)
def test_every_state_trigger_pair_is_decided_by_the_table(
    source: str, trigger: str, dest: str, g: Guards
) -> None:
    """h2's rule: a pair not in the table is an error, never a silent move; no edge
    leaves a terminal state; one (source, trigger, guards) has one destination."""
    model = LifecycleModel()
    allowed = model.allows(source, trigger, dest, g)
    if source in TERMINAL_STATES:
        assert not allowed
    if allowed:
        others = [d for d in MODEL_STATES if d != dest and model.allows(source, trigger, d, g)]
        assert not others


def test_lifecycle_state_follows_membership() -> None:
    state = RendezvousState(
        participants={A: 0}, wait_list={B}, redundancy_list={C}, heartbeats={A: 1, B: 1, C: 1}
    )
    assert lifecycle_state("joining", A, state) == "participant"
    assert lifecycle_state("joining", B, state) == "waiting"
    assert lifecycle_state("joining", C, state) == "redundant"
    done = state.evolve(complete=True, world_size=1)
    assert lifecycle_state("joining", A, done) == "complete"
    assert lifecycle_state("training", A, done) == "training"
    assert lifecycle_state("training", NodeDesc("d", 1, 0), done) == "evicted"
    assert lifecycle_state("crashed", A, done) == "crashed"
    with pytest.raises(ValueError, match="unknown local phase"):
        lifecycle_state("dancing", None, state)


def test_one_vocabulary_names_phases_and_lifecycle_states() -> None:
    """The model's states are Lifecycle members; a local phase that membership does
    not refine maps to the lifecycle state of the same name."""
    assert tuple(Lifecycle) == MODEL_STATES
    assert all(isinstance(s, Lifecycle) for s in TERMINAL_STATES)
    empty = RendezvousState()
    for phase in LOCAL_PHASES - {Phase.TRAINING}:
        state = lifecycle_state(phase, A, empty)
        assert state is Lifecycle(phase.value) and state == phase
    assert lifecycle_state(Phase.TRAINING, A, empty) is Lifecycle.EVICTED
    with pytest.raises(ValueError, match="unknown local phase"):
        lifecycle_state(Phase.DOWN, A, empty)  # the simulator's own
    model = LifecycleModel()
    assert model.allows(Lifecycle.IDLE, "join", Lifecycle.JOINING, guards())
    assert model.allows("idle", "join", "joining", guards())


def test_guards_restate_the_protocol() -> None:
    state = RendezvousState(participants={A: 0, B: 0}, heartbeats={A: 1, B: 1}, last_call=1)
    state = state.evolve(last_call_seq=1)
    own, call = HeartbeatSighting(1, 0.0), LastCallSighting(0, 1, 0.0)
    early = Guards.of(View(A, state, SETTINGS, 0.5, own, call, deadline=10.0))
    assert early.quorum and early.round_open and not early.last_call_over
    assert not early.keep_alive_due and not early.timed_out and early.within_rollback
    late = Guards.of(View(A, state, SETTINGS, 1.5, own, call, deadline=1.0))
    assert late.last_call_over and late.keep_alive_due and late.timed_out
    assert Guards.of(View(C, state, SETTINGS, 0.0, None, call)).fills_round


def test_diagram_source_names_every_state() -> None:
    dot = diagram_source("graphviz")
    mermaid = diagram_source("mermaid")
    for state in MODEL_STATES:
        assert state in dot and state in mermaid
    assert "add_to_participants" in dot
    with pytest.raises(ValueError, match="engine"):
        diagram_source("ascii")


def test_committed_diagram_source_is_up_to_date() -> None:
    committed = Path(__file__).resolve().parents[2] / "docs" / "spec-diagram.dot"
    assert committed.read_text() == diagram_source("graphviz")


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' is not installed")
def test_write_diagram_renders_a_png(tmp_path: Path) -> None:
    out = write_diagram(tmp_path / "d.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_diagram_without_dot_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ModelUnavailableError, match="apt-get install graphviz"):
        write_diagram(tmp_path / "d.png")


def test_a_peer_admits_only_a_node_that_announced_itself(model: LifecycleModel) -> None:
    open_round = guards(announced=True, round_open=True)
    assert model.allows("joining", "admitted", "participant", open_round)
    assert not model.allows("joining", "admitted", "participant", guards(round_open=True))
    filled = guards(announced=True, round_open=True, fills_round=True)
    assert model.allows("joining", "admitted", "complete", filled)
    assert not model.allows("joining", "admitted", "participant", filled)
    room = guards(announced=True, round_complete=True)
    assert model.allows("joining", "admitted", "waiting", room)
    full = guards(announced=True, round_complete=True, round_full=True)
    assert model.allows("joining", "admitted", "redundant", full)
    # a waiting node needs its entry in the open round's log too: from the wait list
    # alone it would hold a place even if it never acts again
    assert model.allows("waiting", "admitted", "participant", open_round)
    assert not model.allows("waiting", "admitted", "participant", guards(round_open=True))
    # a node that is not joining or waiting is never admitted
    for source in ("idle", "exited", "evicted", "training", "participant", "redundant"):
        for dest in ("participant", "waiting", "complete"):
            assert not model.allows(source, "admitted", dest, room)
            assert not model.allows(source, "admitted", dest, open_round)


def test_the_announced_guard_reads_the_intent_log() -> None:
    state = RendezvousState(participants={A: 0}, heartbeats={A: 1})
    assert Guards.of(
        View(B, state, SETTINGS, 0.0, Observations(), pending=frozenset({B}))
    ).announced
    assert not Guards.of(
        View(C, state, SETTINGS, 0.0, Observations(), pending=frozenset({B}))
    ).announced


def test_an_excluded_node_only_stands_by(model: LifecycleModel) -> None:
    """While excluded, a node joins no round and waits for none: it stands by as a
    spare, by its own join or a peer's batch, until its exclusion runs out."""
    open_round = guards(excluded=True, round_open=True)
    assert not model.allows("joining", "add_to_participants", "participant", open_round)
    assert model.allows("joining", "add_to_redundancy_list", "redundant", open_round)
    assert not model.allows("redundant", "remove_from_redundancy_list", "joining", open_round)
    assert model.allows(
        "redundant", "remove_from_redundancy_list", "joining", guards(round_open=True)
    )
    waiting_room = guards(excluded=True, round_complete=True)
    assert not model.allows("joining", "add_to_wait_list", "waiting", waiting_room)
    announced = guards(excluded=True, announced=True, round_open=True)
    assert not model.allows("joining", "admitted", "participant", announced)
    assert model.allows("joining", "admitted", "redundant", announced)
    assert not model.allows("waiting", "admitted", "participant", open_round)


def test_a_node_excludes_itself_and_charges_failures_while_it_trains(
    model: LifecycleModel,
) -> None:
    assert model.allows("training", "exclude", "exited", guards())
    assert model.allows("evicted", "exclude", "exited", guards())
    assert model.allows("idle", "exclude", "idle", guards())
    assert not model.allows("training", "exclude", "exited", guards(closed=True))
    assert not model.allows("training", "exclude", "exited", guards(timed_out=True))
    assert not model.allows("joining", "exclude", "exited", guards())
    assert model.allows("training", "charge_restart", "training", guards())
    assert model.allows("evicted", "charge_restart", "evicted", guards())
    assert not model.allows("training", "charge_restart", "training", guards(closed=True))
    assert not model.allows("participant", "charge_restart", "participant", guards())


def test_the_excluded_guard_reads_the_exclusions() -> None:
    state = RendezvousState(round=1, excluded={A: 2, B: 1})
    assert Guards.of(View(A, state, SETTINGS, 0.0, Observations())).excluded
    assert not Guards.of(View(B, state, SETTINGS, 0.0, Observations())).excluded
    assert not Guards.of(View(C, state, SETTINGS, 0.0, Observations())).excluded
