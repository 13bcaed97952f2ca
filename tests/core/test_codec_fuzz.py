"""Mutated valid states fed to ``decode_state``: each is decoded or refused with a typed error.

Every state the protocol can reach, changed in one to three places the way a bug, a
partial write or an attacker would change it (a field replaced, an entry dropped,
duplicated, moved to another list or renumbered, a node added without its heartbeat):
whatever ``decode_state`` accepts satisfies the safety properties
(:func:`rallypoint.spec.model.invariants.check_state`) and can make progress; whatever it
rejects raises ``RendezvousStateError`` (any other exception fails the test).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.core_scenarios import reachable_runs
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.core import RendezvousState, RendezvousStateError, decode_state, encode_state
from rallypoint.core import Settings as RendezvousSettings
from rallypoint.spec.model.invariants import check_state

_LISTS = ("p", "w", "r", "hb", "lr")
_FIELDS = ("round", "complete", "closed", "world", "lc", "lcs", "hs", "ph", "ic", "v")
_VALUES = st.one_of(
    st.integers(-2, 6),
    st.integers(2**31, 2**64),
    st.booleans(),
    st.none(),
    st.just("1"),
    st.just([]),
    st.just({}),
    st.floats(allow_nan=True),
)
_NODES = st.sampled_from([["host0", 100, 0], ["host1", 101, 0], ["ghost", 1, 0], ["host9", 9, 9]])


@st.composite
def _mutation(draw: st.DrawFn, doc: dict[str, Any]) -> None:
    kind = draw(st.integers(0, 7))
    name = draw(st.sampled_from(_LISTS))
    entries = doc[name]
    if kind == 0:  # a field replaced by a value of any type
        doc[draw(st.sampled_from(_FIELDS))] = draw(_VALUES)
    elif kind == 1:  # a small number changed
        field = draw(st.sampled_from(["round", "world", "lc", "lcs", "hs", "ph", "ic"]))
        doc[field] = draw(st.one_of(st.none(), st.integers(0, 8)))
    elif kind == 2:  # a flag flipped
        field = draw(st.sampled_from(["complete", "closed"]))
        doc[field] = not doc[field]
    elif kind == 3 and entries:  # an entry dropped
        entries.pop(draw(st.integers(0, len(entries) - 1)))
    elif kind == 4 and entries:  # an entry duplicated or moved to another list
        entry = list(entries[draw(st.integers(0, len(entries) - 1))])
        target = draw(st.sampled_from(_LISTS))
        extra = 1 if target in ("p", "hb", "lr") else 0
        doc[target].append(entry[:3] + [draw(st.integers(0, 4))] * extra)
    elif kind == 5 and entries and name in ("p", "hb", "lr"):  # a rank or counter changed
        entry = entries[draw(st.integers(0, len(entries) - 1))]
        entry[3] = draw(st.one_of(st.integers(-1, 9), _VALUES))
    elif kind == 6:  # a node added, with or without a heartbeat
        new = draw(_NODES)
        target = draw(st.sampled_from(_LISTS))
        extra = [draw(st.integers(0, 4))] if target in ("p", "hb", "lr") else []
        doc[target].append(new + extra)
        if draw(st.booleans()):
            doc["hb"].append([*new, draw(st.integers(0, 9))])
    else:  # a list replaced by another list's entries
        doc[name] = [list(e) for e in doc[draw(st.sampled_from(_LISTS))]]


def _progress_problems(state: RendezvousState, s: RendezvousSettings | None) -> list[str]:
    """What a decoded state must also hold for the protocol to move on: what
    :func:`check_state` leaves to the reachable states."""
    problems = []
    members = state.members()
    if set(members) != set(state.heartbeats):
        problems.append("members and heartbeat entries differ")
    if any(not 1 <= c <= state.heartbeat_seq for c in state.heartbeats.values()):
        problems.append("a heartbeat counter outside 1..heartbeat_seq")
    if state.complete and not state.participants:
        problems.append("a complete round without participants")
    if sorted(state.last_ranks.values()) != list(range(len(state.last_ranks))):
        problems.append("last ranks are not 0..n-1")
    if s is not None and not state.complete:
        if len(state.participants) >= s.max_nodes:
            problems.append("an incomplete round nobody can join")
        if (state.last_call is not None) != (len(state.participants) >= s.min_nodes):
            problems.append("the last call does not match min_nodes")
    return problems


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(reachable_runs(), st.data())
def test_decode_accepts_only_safe_states_and_rejects_the_rest_typed(run, data) -> None:  # type: ignore[no-untyped-def]
    s, states = run
    state = data.draw(st.sampled_from(states))
    doc = json.loads(encode_state(state))
    for _ in range(data.draw(st.integers(1, 3))):
        data.draw(_mutation(doc))
    raw = json.dumps(doc).encode()
    for given_settings in (s, None):
        try:
            decoded = decode_state(raw, given_settings)
        except RendezvousStateError:
            continue
        if given_settings is not None:
            assert check_state(decoded, given_settings) == [], doc
        assert _progress_problems(decoded, given_settings) == [], doc
        assert decode_state(encode_state(decoded), given_settings) == decoded
