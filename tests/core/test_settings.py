"""Rendezvous ``Settings``: validation, defaults, and the comparison of a node's
settings with those published for its run.

* a bad value is a ``ValueError`` that names the setting and what it must be;
* the defaults are torch's (join 600 s, last call 30 s, close 30 s, keep-alive
  every 5 s, 3 attempts);
* ``shared_settings_differences`` names each shared setting that differs (not the
  timeouts, which are each node's own), and published settings that are not
  rallypoint's are a ``RendezvousStateError``.

Pure: no servers, no sockets. How nodes started with different settings are told so
through a real store is in ``tests/adapters/test_state_errors.py``.
"""

from __future__ import annotations

import pytest
from helpers.core_scenarios import settings

from rallypoint.core import RendezvousStateError, Settings
from rallypoint.core.codec import encode_shared_settings, shared_settings_differences


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


def test_the_shared_settings_comparison_names_each_difference() -> None:
    run = Settings("r", 2, 4, keep_alive_interval=5.0)
    published = encode_shared_settings(run)
    assert shared_settings_differences(run, published) == []
    # timeouts are each node's own: not compared
    assert shared_settings_differences(Settings("r", 2, 4, join_timeout=9.0), published) == []
    ours = Settings("r", 2, 8, keep_alive_interval=1.0, stable_ranks=True)
    assert shared_settings_differences(ours, published) == [
        "max_nodes: 8 on this node, 4 for the run",
        "stable_ranks: True on this node, False for the run",
        "keep_alive_interval: 1.0 on this node, 5.0 for the run",
    ]
    as_float = published.replace(b'"v":2', b'"v":2.0')
    assert as_float != published
    for bad in (b"", b"[]", b'{"v": 1}', b'{"v": 1, "min_nodes": "2"}', b"x" * 5000, as_float):
        with pytest.raises(RendezvousStateError, match="corrupt published settings"):
            shared_settings_differences(run, bad)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("restart_budget", -1, "restart_budget must be at least 0"),
        ("restart_budget", 1.5, "restart_budget must be an integer or None"),
        ("restart_budget", True, "restart_budget must be an integer or None"),
        ("exclusion_rounds", 0, "exclusion_rounds must be an integer >= 1"),
    ],
)
def test_settings_refuse_a_bad_budget_or_exclusion_length(field, value, message):
    with pytest.raises(ValueError, match=message):
        Settings("job", 1, 2, **{field: value})


def test_nodes_with_different_budgets_are_told_so():
    ours = settings(2, 3, restart_budget=3)
    theirs = settings(2, 3, restart_budget=None, exclusion_rounds=2)
    assert shared_settings_differences(ours, encode_shared_settings(theirs)) == [
        "restart_budget: 3 on this node, None for the run",
        "exclusion_rounds: 1 on this node, 2 for the run",
    ]
