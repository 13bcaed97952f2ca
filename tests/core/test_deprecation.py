"""Renamed and moved public names keep working for one release, with a warning.

* each old spelling gives the object the new one names, and warns with a
  ``DeprecationWarning`` that names the new spelling;
* a name that never existed is still an ``AttributeError``;
* CHANGELOG.md lists every alias under "Deprecated", so a user can find it.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from helpers.core_scenarios import completed, node, settings

from rallypoint.adapters import MemoryBackend, StateSync
from rallypoint.core import Membership, encode_state

CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"

#: (module, old name, module, new name)
MOVED = [
    ("rallypoint.core.driver", "monitor", "rallypoint.core.driver", "watch"),
    ("rallypoint.core", "monitor", "rallypoint.core.driver", "watch"),
    ("rallypoint.core", "FORMAT_VERSION", "rallypoint.core.codec", "FORMAT_VERSION"),
    ("rallypoint.core", "SHARED_SETTINGS", "rallypoint.core.codec", "SHARED_SETTINGS"),
    ("rallypoint.core", "JoinRow", "rallypoint.core.operators", "JoinRow"),
    ("rallypoint.core", "last_call_passed", "rallypoint.core.operators", "last_call_passed"),
    ("rallypoint.core", "SIDE_BITS", "rallypoint.core.liveness", "SIDE_BITS"),
    ("rallypoint.core", "fence_after", "rallypoint.core.liveness", "fence_after"),
    ("rallypoint.core", "lease_expiry", "rallypoint.core.liveness", "lease_expiry"),
    ("rallypoint.core", "after_outage", "rallypoint.core.driver", "after_outage"),
    ("rallypoint.core", "must_fence", "rallypoint.core.driver", "must_fence"),
    ("rallypoint.adapters", "BACKENDS", "rallypoint.adapters.config", "BACKEND_KINDS"),
    ("rallypoint.adapters.config", "BACKENDS", "rallypoint.adapters.config", "BACKEND_KINDS"),
    (
        "rallypoint.adapters.config",
        "DEFAULT_PORTS",
        "rallypoint.adapters.config",
        "DEFAULT_PORT_BY_KIND",
    ),
]

#: (old module, new module): a module moved whole; every name of the new one still
#: answers from the old path, with a warning
MOVED_MODULES = [
    ("rallypoint.agent.live", "rallypoint.agent.worker.live"),
    ("rallypoint.agent.live_state", "rallypoint.agent.worker.live_state"),
    ("rallypoint.agent.live_snapshots", "rallypoint.agent.worker.live_snapshots"),
    ("rallypoint.agent.live_reshard", "rallypoint.agent.worker.live_reshard"),
    ("rallypoint.agent.live_channel", "rallypoint.agent.worker.live_channel"),
]


@pytest.mark.parametrize(("module", "old", "where", "new"), MOVED)
def test_an_old_name_gives_the_new_object_and_warns(module, old, where, new):
    with pytest.warns(DeprecationWarning, match=re.escape(f"use {where}.{new}")):
        value = getattr(importlib.import_module(module), old)
    assert value is getattr(importlib.import_module(where), new)


@pytest.mark.parametrize(("old", "new"), MOVED_MODULES)
def test_a_moved_module_serves_every_name_of_the_new_one_and_warns(old, new):
    moved = importlib.import_module(new)
    alias = importlib.import_module(old)
    assert alias is not moved
    names = [*moved.__all__, *(n for n in vars(moved) if n.startswith("_") and n[:2] != "__")]
    for name in names:
        with pytest.warns(DeprecationWarning, match=re.escape(f"use {new}.{name}")):
            value = getattr(alias, name)
        assert value is getattr(moved, name), name
    with pytest.raises(AttributeError, match=f"module '{re.escape(old)}' has no attribute 'nope'"):
        alias.nope  # noqa: B018


def test_the_old_spelling_of_the_live_api_works_as_scripts_wrote_it():
    from rallypoint.agent import live
    from rallypoint.agent.worker import live as moved
    from rallypoint.agent.worker import live_channel

    with pytest.warns(DeprecationWarning, match=r"rallypoint\.agent\.live\.Job is deprecated"):
        job = live.Job
    assert job is moved.Job
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning):
        exec("from rallypoint.agent.live_channel import *", namespace)
    assert namespace["StatusFile"] is live_channel.StatusFile


def test_a_name_that_never_existed_is_still_an_attribute_error():
    core = importlib.import_module("rallypoint.core")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        core.no_such_name  # noqa: B018


def test_state_sync_monitor_warns_and_answers_as_watch():
    s = settings(2, 2)
    state = completed(2, s)
    backend = MemoryBackend()
    backend.set_state(encode_state(state))
    for member in (node(0), node(1)):
        backend.beat(str(member))
    sync = StateSync(backend, node(0), s, clock=lambda: 0.0)
    joined = Membership(state.round, 0, 2, state.participants)
    with pytest.warns(DeprecationWarning, match=r"StateSync\.monitor .* use StateSync\.watch"):
        verdict = sync.monitor(joined)
    assert verdict == sync.watch(joined)


def test_the_changelog_lists_every_alias_as_deprecated():
    text = CHANGELOG.read_text()
    deprecated = text.split("### Deprecated", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    for module, old, _where, _new in MOVED:
        assert f"`{module}.{old}`" in deprecated, (module, old)
    assert "`StateSync.monitor`" in deprecated
    for old, _new in MOVED_MODULES:
        assert f"`{old}`" in deprecated, old
