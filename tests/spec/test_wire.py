"""The checker's wire (spec/check/wire.py): states and events cross between its
processes unchanged, and a search with workers is the search without them."""

from __future__ import annotations

import pickle

import pytest
from helpers.checker_plants import assert_same_space

from rallypoint.spec.check import CheckConfig, Checker, Event, Global, check
from rallypoint.spec.check.wire import Wire, event_of

# Crashes, close, failures, exclusions and stable ranks: every kind of field of a
# state and of an event occurs in the first 10,000 states (asserted below).
SPACE = CheckConfig(
    nodes=2, max_crashes=1, max_failures=1, max_exclusions=1, stable_ranks=True, max_states=10_000
)


_EVERY_FIELD = (
    "participants",
    "wait_list",
    "redundancy_list",
    "heartbeats",
    "last_ranks",
    "excluded",
    "closed",
    "complete",
    "last_call",
)


def _states(config: CheckConfig) -> list[Global]:
    states: list[Global] = []
    Checker(config).run(on_state=lambda g, fp: states.append(g))
    return states


@pytest.mark.slow
def test_every_state_and_event_of_a_search_crosses_the_wire_unchanged() -> None:
    checker = Checker(SPACE)
    states = _states(SPACE)
    shared = [g.shared for g in states]
    assert all(any(getattr(s, name) for s in shared) for name in _EVERY_FIELD)
    assert any(g.intents for g in states)
    assert any(loc.incarnation for g in states for loc in g.locals)
    assert any(loc.round_ended for g in states for loc in g.locals)
    sender, receiver = Wire(), Wire()
    events = 0
    for number, g in enumerate(states):
        # pickled between the ends, as a pool does
        wire = pickle.loads(pickle.dumps(sender.state(g)))
        received = receiver.global_of(wire)
        assert received == g
        assert [type(loc.phase) for loc in received.locals] == [type(loc.phase) for loc in g.locals]
        if number % 4:
            continue  # (the events of every 4th state: each kind occurs many times)
        for abstract in checker.events(g):
            for event in checker.expand(g, abstract):
                back = event_of(pickle.loads(pickle.dumps(sender.event(event))))
                assert back == event and isinstance(back, Event)
                events += 1
    assert events > 5_000
    # what was on the wire decodes into one instance per shared state
    instances = {id(receiver.global_of(sender.state(g)).shared) for g in states}
    assert len(instances) == len(set(shared))


@pytest.mark.slow
def test_bounded_rounds_are_the_same_space_with_workers() -> None:
    # Two nodes with a crash and close, rounds 0..1 stepped: every kind of event
    # (crash and close too) crosses to the workers with concrete round numbers,
    # in half the states of three nodes without them. (Three nodes with workers:
    # tests/spec/test_check.py's parallel test.)
    bounded = CheckConfig(nodes=2, max_round=1)
    sequential, parallel = check(bounded), check(bounded, workers=2)
    assert parallel.ok and parallel.complete
    assert_same_space(parallel, sequential)
