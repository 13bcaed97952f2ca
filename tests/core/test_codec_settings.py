"""Settings validation, and the codec's round trip and rejection of bad input."""

from __future__ import annotations

import json

import pytest
from helpers.core_scenarios import completed, joined, node, reachable_runs, settings
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.core import (
    MAX_STATE_BYTES,
    NodeDesc,
    RendezvousState,
    RendezvousStateError,
    Settings,
    decode_state,
    encode_state,
)

# --- settings ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_nodes": 0}, "min_nodes must be at least 1"),
        ({"min_nodes": 3, "max_nodes": 2}, r"max_nodes \(2\) must be at least min_nodes \(3\)"),
        ({"min_nodes": True}, "min_nodes must be an integer"),
        ({"max_nodes": 2.0}, "max_nodes must be an integer"),
        ({"join_timeout": 0}, "join_timeout must be a positive number of seconds"),
        ({"last_call_timeout": -1.0}, "last_call_timeout must be a positive"),
        ({"close_timeout": float("nan")}, "close_timeout must be a positive"),
        ({"heartbeat_timeout": float("inf")}, "heartbeat_timeout must be a positive"),
        ({"keep_alive_interval": 0.0}, "keep_alive_interval must be a positive"),
        ({"keep_alive_max_attempt": 0}, "keep_alive_max_attempt must be at least 1"),
        ({"rollback_period": -0.1}, "rollback_period must be >= 0"),
        ({"run_id": ""}, "run_id must be a non-empty string"),
        ({"stable_ranks": "yes"}, "stable_ranks must be a bool"),
    ],
)
def test_settings_reject_bad_values_with_a_clear_message(kwargs, message):
    base = {"run_id": "job", "min_nodes": 1, "max_nodes": 2}
    base.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Settings(**base)


def test_settings_defaults_follow_torch():
    s = Settings("job", 1, 4)
    assert (s.join_timeout, s.last_call_timeout, s.close_timeout) == (600.0, 30.0, 30.0)
    assert (s.keep_alive_interval, s.keep_alive_max_attempt) == (5.0, 3)
    assert s.liveness_window == 15.0


# --- round trip -------------------------------------------------------------------


@given(reachable_runs())
def test_every_reachable_state_round_trips(run):
    _settings, states = run
    for state in states:
        data = encode_state(state)
        assert decode_state(data) == state
        assert encode_state(decode_state(data)) == data  # canonical


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


# --- rejection --------------------------------------------------------------------


def _doc(state: RendezvousState | None = None) -> dict:
    s = settings(2, 3)
    return json.loads(encode_state(state or completed(2, s)))


def _bytes(doc: dict) -> bytes:
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(v=1), "format version 1 is not supported"),
        (lambda d: d.update(v=2), "format version 2 is not supported"),
        (lambda d: d.update(ph=-1), "phase must be >= 0"),
        (lambda d: d.update(ic="0"), "intent cursor must be an integer"),
        (lambda d: d.update(v=True), "format version True"),
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
