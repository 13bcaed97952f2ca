"""The state codec (``core/codec.py``): ``encode_state`` and ``decode_state``.

* every state the protocol can reach round trips, with and without the settings it
  was reached under, and its encoding is canonical (one byte string per state,
  whatever the order its collections were filled in);
* ``decode_state`` refuses with a typed ``RendezvousStateError`` that says what it
  read: a malformed document, garbage bytes, input over ``MAX_STATE_BYTES`` (before
  parsing it), something that is not bytes;
* it also refuses a state that breaks the safety properties or that no node could
  make progress from (a member without a heartbeat entry, a complete round nobody
  is in), and, given the reader's settings, what those settings forbid;
* fuzzed input (random bytes, a valid state with one byte changed, a reachable
  state mutated in one to three places) is either refused typed or decodes to a
  well-formed state; no other exception escapes.

Pure: no servers, no sockets. The mutation fuzz is marked ``slow``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.core_scenarios import completed, joined, node, reachable_runs, settings, step
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from rallypoint.core import (
    MAX_STATE_BYTES,
    Action,
    NodeDesc,
    RendezvousState,
    RendezvousStateError,
    Settings,
    decode_state,
    encode_state,
)
from rallypoint.spec.model.invariants import check_state

# --- round trip -----------------------------------------------------------------------


@given(reachable_runs())
def test_every_reachable_state_round_trips_with_and_without_its_settings(run):
    s, states = run
    for state in states:
        data = encode_state(state)
        assert decode_state(data) == state
        assert encode_state(decode_state(data)) == data  # canonical
        assert decode_state(data, s) == state
        assert check_state(state, s) == []


def test_encoding_is_canonical_whatever_the_insertion_order():
    nodes = [node(0), node(1), node(2)]
    a = RendezvousState(participants={n: 0 for n in nodes}, heartbeats={n: 1 for n in nodes})
    rev = list(reversed(nodes))
    b = RendezvousState(participants={n: 0 for n in rev}, heartbeats={n: 1 for n in rev})
    assert encode_state(a) == encode_state(b)


def test_round_trip_keeps_unusual_addresses():
    s = settings(1, 5)
    nodes = [NodeDesc(addr, 0, 7) for addr in ('a"b\\c', "ünï-cödé", "[::1]", "x" * 1024)]
    state = joined(nodes, s)
    assert decode_state(encode_state(state)) == state


# --- rejection of malformed input -----------------------------------------------------


def _doc(state: RendezvousState | None = None) -> dict:  # type: ignore[type-arg]
    """The JSON document of ``state`` (by default a complete round of 2 under
    min 2 / max 3), to be changed by a test."""
    return json.loads(encode_state(state or completed(2, settings(2, 3))))


def _bytes(doc: dict) -> bytes:  # type: ignore[type-arg]
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(v=1), "format version 1 is not supported"),
        (lambda d: d.update(v=2), "format version 2 is not supported"),
        (lambda d: d.update(ph=-1), "phase must be >= 0"),
        (lambda d: d.update(ic="0"), "intent cursor must be an integer"),
        (lambda d: d.update(v=True), "format version True"),
        (lambda d: d.update(v=4.0), "format version 4.0 is not supported"),
        (lambda d: d.pop("round"), "missing fields"),
        (lambda d: d.update(extra=1), "unknown fields"),
        (lambda d: d.update(round="1"), "round must be an integer"),
        (lambda d: d.update(round=-1), "round must be >= 0"),
        (lambda d: d.update(complete=1), "complete must be true or false"),
        (lambda d: d["p"][0].__setitem__(3, -1), "must be >= 0"),
        (lambda d: d["p"][1].__setitem__(3, 0), "two participants share a rank"),
        (lambda d: d["p"][1].__setitem__(3, 7), "exceeds the world size"),
        (lambda d: d["p"].append(list(d["p"][0])), "appears twice in participants"),
        (lambda d: d["p"][0].__setitem__(0, ""), "non-empty string"),
        (lambda d: d["p"][0].__setitem__(1, 1.5), "a pid in participants must be an integer"),
        (lambda d: d["p"][0].pop(), "must be a list of 4 values"),
        (lambda d: d.update(p={}), "participants must be a list"),
        (lambda d: d["w"].append(d["p"][0][:3]), "both a participant and waiting"),
        (lambda d: d.update(lc=1), "complete round has an armed last call"),
        (lambda d: d.update(world=0), "exceeds the world size"),
        (lambda d: d["hb"][0].__setitem__(3, "x"), "must be an integer"),
    ],
)
def test_decode_rejects_malformed_state(mutate, message):
    doc = _doc()
    mutate(doc)
    with pytest.raises(RendezvousStateError, match=message):
        decode_state(_bytes(doc))


@pytest.mark.parametrize(
    "mutate",
    [lambda d: d.update(rg=True), lambda d: d["rt"].append(["ghost", 1, 0])],
    ids=["regroup mark", "returning node"],
)
def test_decode_rejects_a_return_to_a_round_0_that_never_completed(mutate):
    doc = _doc(joined([node(0)], settings(2, 3)))
    mutate(doc)
    with pytest.raises(RendezvousStateError, match="no earlier round to return from"):
        decode_state(_bytes(doc))


def test_decode_accepts_what_the_protocol_writes_on_a_departure_from_round_0():
    """Round 0 complete carries the regroup mark; its participant leaving to join
    the next round is returning with no heartbeat entry until its join lands."""
    s = settings(2, 3)
    state = completed(2, s)
    assert state.round == 0 and state.regroup
    assert decode_state(encode_state(state), s) == state
    leaver = node(0)
    departed = step(state, leaver, Action.REMOVE_FROM_PARTICIPANTS, s)
    assert leaver in departed.returning
    assert leaver not in departed.members() and leaver not in departed.heartbeats
    assert decode_state(encode_state(departed), s) == departed


def test_decode_rejects_assigned_ranks_in_an_incomplete_round():
    doc = _doc(joined([node(0), node(1)], settings(2, 3)))
    doc["p"][1][3] = 1
    with pytest.raises(RendezvousStateError, match="incomplete round has assigned ranks"):
        decode_state(_bytes(doc))


@pytest.mark.parametrize(
    "data",
    [b"", b"\xff\xfe", b"null", b"[]", b"{", b'{"v": 1}', b"1e999999", b"[" * 100_000],
)
def test_decode_rejects_garbage(data: bytes):
    with pytest.raises(RendezvousStateError, match="corrupt rendezvous state"):
        decode_state(data)


def test_decode_rejects_oversize_input_before_parsing():
    with pytest.raises(RendezvousStateError, match="exceeds the limit"):
        decode_state(b" " * (MAX_STATE_BYTES + 1))


def test_decode_rejects_non_bytes():
    with pytest.raises(RendezvousStateError, match="expected bytes"):
        decode_state("{}")  # type: ignore[arg-type]


# --- rejection of states that break safety or cannot make progress --------------------


def _drop_participants(doc: dict) -> None:  # type: ignore[type-arg]
    doc["p"] = []
    doc["hb"] = []


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["hb"].pop(0), "has no heartbeat entry"),
        (_drop_participants, "complete round 0 has no participants"),
        (lambda d: d["hb"].append(["ghost", 1, 0, 1]), "heartbeat entry but is not a member"),
        (lambda d: d["hb"][0].__setitem__(3, 0), "heartbeat counter"),
        (lambda d: d["hb"][0].__setitem__(3, d["hs"] + 1), "above the heartbeat sequence"),
        (lambda d: d.update(lr=[["host0", 100, 0, 3]]), "last ranks"),
    ],
)
def test_decode_rejects_states_that_cannot_make_progress(mutate, message) -> None:  # type: ignore[no-untyped-def]
    doc = _doc(completed(2, settings(2, 3)))
    mutate(doc)
    with pytest.raises(RendezvousStateError, match=message):
        decode_state(_bytes(doc))


# --- decode under the reader's settings -----------------------------------------------


def _armed_but_below_min(doc: dict) -> None:  # type: ignore[type-arg]
    doc["p"].pop()
    doc["hb"] = [e for e in doc["hb"] if e[:3] in [p[:3] for p in doc["p"]]]


@pytest.mark.parametrize(
    ("state", "mutate", "message"),
    [
        # a complete round of 2 read by a node whose max_nodes is 1 (or min_nodes 3)
        (lambda s: completed(2, s), lambda d: d.update(world=4), "outside \\[2, 3\\]"),
        (lambda s: completed(2, s), lambda d: d.update(world=1), "outside \\[2, 3\\]"),
        # an incomplete round that already holds max_nodes: nobody can join it
        (
            lambda s: joined([node(i) for i in range(2)], settings(2, 4)),
            lambda d: (d["p"].append(["x", 1, 0, 0]), d["hb"].append(["x", 1, 0, 1])),
            "incomplete round 0 already holds 3 participants",
        ),
        # min_nodes reached but no last call: the round would never complete
        (
            lambda s: joined([node(i) for i in range(2)], s),
            lambda d: d.update(lc=None),
            "no last call is armed",
        ),
        (lambda s: joined([node(i) for i in range(2)], s), _armed_but_below_min, "below min"),
    ],
)
def test_decode_with_settings_rejects_what_the_settings_forbid(state, mutate, message) -> None:  # type: ignore[no-untyped-def]
    s = settings(2, 3)
    doc = _doc(state(s))
    mutate(doc)
    with pytest.raises(RendezvousStateError, match=message):
        decode_state(_bytes(doc), s)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["x"].append([*d["p"][0][:3], 9]), "is excluded until round 9 but is a member"),
        (lambda d: d["x"].append(["host7", 1, 0, 0]), "exclusion ended at round 0"),
        (lambda d: d.update(ct=5), "counted through round 4, after round 0"),
        (lambda d: d.update(ct=1, rs=0), "the restart count is 0"),
        (lambda d: d.update(rs=3, ct=1), "restart budget of 2 is spent but the rendezvous is open"),
        (lambda d: d.update(rs=9, ct=1, closed=True), "overspend the restart budget of 2"),
        (lambda d: d.update(rs=-1), "restarts must be >= 0"),
    ],
)
def test_decode_rejects_a_broken_budget_or_exclusion(mutate, message):
    s = settings(2, 3, restart_budget=2)
    doc = _doc(completed(3, s))
    mutate(doc)
    with pytest.raises(RendezvousStateError, match=message):
        decode_state(json.dumps(doc).encode(), s)


def test_decode_rejects_a_waiter_beside_a_full_complete_round():
    s = settings(2, 3)
    full = completed(3, s)
    forged = full.evolve(
        wait_list={node(5)},
        heartbeats=full.heartbeats.set(node(5), full.heartbeat_seq + 1),
        heartbeat_seq=full.heartbeat_seq + 1,
    )
    data = encode_state(forged)
    assert decode_state(data) == forged  # without settings nothing tells it is full
    with pytest.raises(RendezvousStateError, match=r"is full .* and a node waits beside it"):
        decode_state(data, s)
    # A complete round with room may have waiters.
    room = step(completed(2, s), node(5), Action.ADD_TO_WAIT_LIST, s)
    assert decode_state(encode_state(room), s) == room


# --- fuzzing --------------------------------------------------------------------------


@given(st.binary(max_size=512))
def test_decode_of_random_bytes_either_fails_typed_or_round_trips(data: bytes):
    try:
        state = decode_state(data)
    except RendezvousStateError:
        return
    assert decode_state(encode_state(state)) == state


@given(reachable_runs(), st.data())
def test_decode_of_corrupted_valid_state_fails_typed_or_is_valid(run, data):
    _settings, states = run
    raw = bytearray(encode_state(states[-1]))
    position = data.draw(st.integers(0, len(raw) - 1))
    raw[position] = data.draw(st.integers(0, 255))
    try:
        state = decode_state(bytes(raw))
    except RendezvousStateError:
        return
    assert decode_state(encode_state(state)) == state  # whatever decoded is well-formed


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
        # An entry that a list replacement left without a fourth field gets one.
        entry[3:] = [draw(st.one_of(st.integers(-1, 9), _VALUES))]
    elif kind == 6:  # a node added, with or without a heartbeat
        new = draw(_NODES)
        target = draw(st.sampled_from(_LISTS))
        extra = [draw(st.integers(0, 4))] if target in ("p", "hb", "lr") else []
        doc[target].append(new + extra)
        if draw(st.booleans()):
            doc["hb"].append([*new, draw(st.integers(0, 9))])
    else:  # a list replaced by another list's entries
        doc[name] = [list(e) for e in doc[draw(st.sampled_from(_LISTS))]]


def _progress_problems(state: RendezvousState, s: Settings | None) -> list[str]:
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
@hypothesis_settings(max_examples=400, deadline=None)
@given(reachable_runs(), st.data())
def test_decode_accepts_only_safe_states_and_rejects_the_rest_typed(run, data) -> None:  # type: ignore[no-untyped-def]
    """Every reachable state, changed in one to three places the way a bug, a
    partial write or an attacker would change it (a field replaced, an entry
    dropped, duplicated, moved to another list or renumbered, a node added without
    its heartbeat): whatever ``decode_state`` accepts satisfies the safety
    properties (:func:`rallypoint.spec.model.invariants.check_state`) and can make
    progress; whatever it rejects raises ``RendezvousStateError`` (any other
    exception fails the test)."""
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
