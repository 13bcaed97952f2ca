"""Properties over random runs of the real protocol: purity and safety."""

from __future__ import annotations

import copy
import itertools

from helpers.core_scenarios import FAR, node, reachable_runs, settings
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.core import (
    Action,
    Context,
    ExitOp,
    JoinOp,
    KeepAliveOp,
    Observations,
    RendezvousState,
    apply,
    encode_state,
    observe,
    sanitize,
)
from rallypoint.spec.model.invariants import check_state, check_transition

_NODES_OPS = st.tuples(st.integers(0, 4), st.sampled_from([JoinOp(), ExitOp(), KeepAliveOp()]))


@given(reachable_runs(), st.lists(_NODES_OPS, max_size=10), st.floats(0, 100))
def test_apply_never_mutates_its_input_and_keeps_the_invariants(run, steps, now):
    s, states = run
    for state in states:
        assert check_state(state, s) == []
    for before, after in itertools.pairwise(states):
        assert check_transition(before, after) == []

    state = states[-1]
    for index, op in steps:
        n = node(index)
        obs = observe(Observations(), state, now)
        view, _ = sanitize(state, obs, s, now)
        c = Context(n, view, s, now, obs)
        action = op(c, FAR)
        if not action.changes_state:
            continue
        frozen_bytes = encode_state(view)
        snapshot = copy.deepcopy(view)
        new = apply(view, action, c)
        assert view == snapshot and encode_state(view) == frozen_bytes  # input untouched
        assert check_state(new, s) == []
        assert check_transition(view, new) == []
        state = new


@given(reachable_runs(max_nodes=3, max_steps=60))
def test_sanitize_never_breaks_the_invariants(run):
    s, states = run
    for state in states:
        obs = observe(Observations(), state, 0.0)
        for now in (0.0, s.liveness_window + 1.0):
            cleaned, dead = sanitize(state, obs, s, now)
            assert check_state(cleaned, s) == []
            assert check_transition(state, cleaned) == []
            assert not (dead & cleaned.members())


def test_join_of_every_node_completes_a_round():
    """Liveness in the simplest fair run: nodes keep deciding until all finish."""
    s = settings(2, 3, last_call_timeout=1.0)
    nodes = [node(i) for i in range(3)]
    state = RendezvousState()
    obs = {n: Observations() for n in nodes}
    finished: set = set()
    now = 0.0
    for _ in range(100):
        for n in nodes:
            if n in finished:
                continue
            obs[n] = observe(obs[n], state, now)
            c = Context(n, state, s, now, obs[n])
            action = JoinOp()(c, FAR)
            if action is Action.FINISH:
                finished.add(n)
            elif action.changes_state:
                state = apply(state, action, c)
                obs[n] = observe(obs[n], state, now)
        if len(finished) == 3:
            break
        now += 0.5
    assert finished == set(nodes)
    assert sorted(state.participants.values()) == [0, 1, 2]
