"""The checker's limits: a search too large for the machine stops with its figures
(``max_memory``), and a worker that dies fails the search instead of hanging it."""

from __future__ import annotations

import dataclasses
import importlib
import io
import itertools
import os
import pkgutil
import re
import signal
from types import SimpleNamespace

import pytest
import rich.console

from rallypoint.core import driver
from rallypoint.spec import check as check_package
from rallypoint.spec import cli
from rallypoint.spec.check import (
    CheckConfig,
    CheckerConfigError,
    CheckerWorkerError,
    check,
    memo,
    search,
    symmetry,
)
from rallypoint.spec.cli import spec_main

#: Two nodes, every round, a crash and close: the full space in about a second.
TWO = CheckConfig(nodes=2)
MEMO_CONFIG = CheckConfig(nodes=2, allow_close=False)
#: Far below what any Python process holds.
TINY_GIB = 0.001


@pytest.mark.parametrize("workers", [1, 2])
def test_a_memory_limit_stops_the_search_with_its_figures(workers: int) -> None:
    result = check(CheckConfig(nodes=2, max_memory=TINY_GIB), workers=workers)
    assert not result.complete and result.ok
    assert result.stopped_by == "max_memory"
    assert result.memory > TINY_GIB
    assert result.states >= 1
    assert "stopped at the memory limit" in result.summary()
    assert f"more than max_memory={TINY_GIB:g} GiB" in result.summary()


def test_a_memory_limit_not_reached_changes_nothing() -> None:
    # The search weighs its memory before every level (and every half second), so
    # the 2-node space without crashes (14 levels) weighs it as often as it steps
    # a level: what the limit does is the same in any space.
    config = CheckConfig(nodes=2, max_crashes=0)
    limited = check(dataclasses.replace(config, max_memory=1000.0))
    unlimited = check(config)
    assert limited.complete and limited.stopped_by is None
    assert (limited.states, limited.transitions, limited.depth) == (
        unlimited.states,
        unlimited.transitions,
        unlimited.depth,
    )


def test_the_state_limit_names_itself() -> None:
    result = check(CheckConfig(nodes=2, max_states=50))
    assert not result.complete and result.stopped_by == "max_states"
    assert "stopped at 50 states" in result.summary()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_a_memory_limit_out_of_range_is_refused(bad: float) -> None:
    with pytest.raises(CheckerConfigError, match="max_memory must be a finite number > 0"):
        CheckConfig(max_memory=bad)


def test_the_cli_stops_at_the_memory_limit_it_is_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert spec_main(["check", "--nodes", "2", "--max-memory", str(TINY_GIB), "--quiet"]) == 0
    assert "stopped at the memory limit" in capsys.readouterr().out
    assert spec_main(["check", "--nodes", "2", "--max-memory", "0", "--quiet"]) == 2
    assert "max_memory must be a finite number > 0, got 0.0" in capsys.readouterr().err


def test_the_cli_limits_memory_to_a_share_of_what_is_available(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A machine with about 1 MiB available: the default limit stops at once.
    monkeypatch.setattr(cli.psutil, "virtual_memory", lambda: SimpleNamespace(available=2**20))
    assert spec_main(["check", "--nodes", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    limit = cli._DEFAULT_MEMORY_SHARE * 2**20 / 2**30
    assert "stopped at the memory limit" in out and f"max_memory={limit:g} GiB" in out


def _killed_in_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant a decide that kills the process it runs in, unless that is this one:
    a worker dies the way the out-of-memory killer ends it."""
    main, real = os.getpid(), driver.decide

    def decide(*args: object, **kwargs: object) -> driver.Instruction:
        if os.getpid() != main:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(driver, "decide", decide)


@pytest.mark.timeout(120)
def test_a_worker_that_dies_fails_the_search_instead_of_hanging_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _killed_in_workers(monkeypatch)
    with pytest.raises(CheckerWorkerError, match=r"checker worker process \d+ died"):
        check(TWO, workers=2)


@pytest.mark.timeout(120)
def test_the_cli_reports_a_dead_worker_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _killed_in_workers(monkeypatch)
    assert spec_main(["check", "--nodes", "2", "--workers", "2", "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("rallypoint spec check: checker worker process")
    assert "--max-memory" in err and "Traceback" not in err and out == ""


@pytest.mark.slow
def test_memos_cleared_at_every_few_entries_search_the_same_space(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The memo tables are bounds on memory only: cleared whenever they hold 20
    entries, they give the same states, transitions and depth. (Two nodes without
    the close: every memo table is still filled and cleared over and over, in half
    the states; the search with the tables cleared takes three times as long.)"""
    full = check(MEMO_CONFIG)
    # No module of the checker keeps a limit of its own: every memo is a Memo,
    # bounded by the one limit patched here.
    for info in pkgutil.iter_modules(check_package.__path__, f"{check_package.__name__}."):
        module = importlib.import_module(info.name)
        assert module is memo or "CACHE_LIMIT" not in vars(module), module.__name__
    monkeypatch.setattr(memo, "CACHE_LIMIT", 20)
    cleared = check(MEMO_CONFIG)
    assert cleared.ok and cleared.complete
    assert (cleared.states, cleared.transitions, cleared.depth) == (
        full.states,
        full.transitions,
        full.depth,
    )


class _EverHeavier:
    """A search's weight that is a TiB more at every read, far past any limit."""

    def __init__(self) -> None:
        self._reads = itertools.count(1)

    @property
    def value(self) -> float:
        return next(self._reads) * 2.0**40


@pytest.mark.parametrize("workers", [1, 2])
def test_memos_forgotten_for_the_searchs_memory_search_the_same_space(
    monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """Every process of a search forgets all its memo tables when the search is
    past three quarters of ``max_memory``. Here every read of the search's weight
    (every 64 insertions into a process's tables) finds it a TiB heavier than
    the last: the tables are forgotten at every read, in every process, and the
    search still finds the same states, transitions and depth."""
    config = CheckConfig(nodes=2, max_crashes=0)
    full = check(config, workers=workers)
    # (the workers fork after the search bounds the memos: each reads a copy)
    monkeypatch.setattr(
        search,
        "bound_memory",
        lambda limit, weight=None: memo.bound_memory(limit, _EverHeavier()),
    )
    monkeypatch.setattr(memo, "READ_EVERY", 64)
    before = memo.forgotten()
    forgetting = check(dataclasses.replace(config, max_memory=1000.0), workers=workers)
    assert forgetting.ok and forgetting.complete
    assert (forgetting.states, forgetting.transitions, forgetting.depth) == (
        full.states,
        full.transitions,
        full.depth,
    )
    if workers == 1:  # (with workers, they forget, in their own processes)
        assert memo.forgotten() > before + 10


def test_memos_are_forgotten_past_three_quarters_of_the_limit_and_not_at_every_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tables are forgotten when the search holds more than three quarters of
    its limit. When what stays keeps it above that (the states it keeps, memory
    the allocator holds on to), they may fill an eighth of the limit on top of
    that before they are forgotten again; once the search is lighter, the bound
    is three quarters again."""
    monkeypatch.setattr(memo, "READ_EVERY", 1)
    weight = SimpleNamespace(value=0.0)
    table: memo.Memo[int, int] = memo.Memo()
    memo.bound_memory(1000, weight)
    before = memo.forgotten()
    try:
        for key, held, forgotten in [
            (0, 700, 0),  # below 750
            (1, 800, 1),  # forgotten first; the bound is 800 + 125
            (2, 900, 1),
            (3, 950, 2),  # past 925: forgotten; the bound is 1075
            (4, 300, 2),  # lighter: the bound is 750 again
            (5, 760, 3),
        ]:
            weight.value = held
            table.put(key, key)
            assert memo.forgotten() - before == forgotten, (key, held)
        assert table == {5: 5}
    finally:
        memo.bound_memory(None)
    weight.value = 2000.0  # no bound: the weight is not read
    for key in range(10):
        table.put(key, key)
    assert len(table) == 10 and memo.forgotten() - before == 3


def test_a_memo_table_at_its_entry_limit_is_forgotten_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memo, "CACHE_LIMIT", 3)
    full, other = memo.Memo[int, int](), memo.Memo[int, int]()
    other.put(0, 0)
    for key in range(4):
        full.put(key, key)
    assert full == {3: 3} and other == {0: 0}


def test_the_old_home_of_the_entry_limit_warns() -> None:
    with pytest.deprecated_call(match="rallypoint.spec.check.memo.CACHE_LIMIT"):
        assert symmetry.CACHE_LIMIT == memo.CACHE_LIMIT


@pytest.mark.slow
def test_the_live_line_shows_the_memory_the_search_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    screen = io.StringIO()
    terminal = rich.console.Console(file=screen, force_terminal=True, width=200)
    monkeypatch.setattr(rich.console, "Console", lambda **_: terminal)
    # A search of a few seconds: the progress line is drawn every half second,
    # and every frame after the first level shows the memory weighed before it.
    config = CheckConfig(nodes=2, allow_close=False, max_memory=100.0)
    result = cli._check_with_progress(config, 1)
    assert result.complete and result.memory > 0
    # a frame drawn after the first weighing shows what the search held
    assert re.search(r"states/s, (?!0\.0 )\d+\.\d GiB", screen.getvalue())
