"""The checker's memo tables, bounded in entries each and in bytes together.

Every step rule, normal form and wire encoding of the checker is memoized: a
search meets the same shared states, views and steps over and over, and looks
them up instead of computing them again. A memo only saves work, so the search may
forget any table at any time and still find the same states, transitions and
depth (``tests/spec/test_check_limits.py`` checks that). Two bounds forget them:

* a table that holds :data:`CACHE_LIMIT` entries is forgotten before its next
  one (a bound per table, whatever the machine);
* with a memory limit (``max_memory``), every process of the search forgets all
  its tables once the search's processes together hold more than
  :data:`FORGET_AT` of it (see :func:`bound_memory`): the search stops at the
  limit, and without this the memos of a long search were what filled it.

The search's main process weighs its processes (every half second, see
``Search._out_of_memory``) and publishes the total in shared memory; each process
reads it every :data:`READ_EVERY` insertions into its tables, so a lookup costs
nothing more than the dict's own.
"""

from __future__ import annotations

import weakref
from typing import Protocol, TypeVar

__all__ = ["CACHE_LIMIT", "FORGET_AT", "READ_EVERY", "Memo", "bound_memory", "forgotten"]

#: Entries one memo table keeps at most (a bound on memory, not on the search).
CACHE_LIMIT = 500_000
#: The share of ``max_memory`` the search's processes hold before they forget
#: their memo tables (the rest is for the states the search must keep).
FORGET_AT = 0.75
#: Insertions into a process's memo tables between two reads of the search's
#: weight.
READ_EVERY = 4096

_K = TypeVar("_K")
_V = TypeVar("_V")


class Weight(Protocol):
    """Bytes the search's processes hold, as last weighed (a shared ``double``,
    ``multiprocessing.RawValue("d")``)."""

    value: float


class _Tables:
    """The memo tables of this process, and when it forgets them."""

    def __init__(self) -> None:
        #: id -> table, for every table alive
        self.tables: weakref.WeakValueDictionary[int, Memo[object, object]] = (
            weakref.WeakValueDictionary()
        )
        self.weight: Weight | None = None
        self.limit = 0.0
        #: the weight past which the tables are forgotten: FORGET_AT of the
        #: limit, or more while what they left behind keeps the search above
        #: that (see read)
        self.threshold = 0.0
        self.until_read = READ_EVERY
        #: times this process forgot every table for the search's memory
        self.forgotten = 0

    def read(self) -> None:
        self.until_read = READ_EVERY
        if self.weight is None:
            return
        held = self.weight.value
        # What the search keeps besides the tables (its states), or memory the
        # allocator holds on to after them, can keep the weight above FORGET_AT:
        # the tables then get an eighth of the limit on top of that before they
        # are forgotten again, not forgotten at every read.
        slack = self.limit / 8
        if held <= self.threshold:
            self.threshold = max(FORGET_AT * self.limit, min(self.threshold, held + slack))
            return
        for table in list(self.tables.values()):
            table.clear()
        self.forgotten += 1
        self.threshold = held + slack


_TABLES = _Tables()


class Memo(dict[_K, _V]):
    """One memo table: a dict whose entries are put with :meth:`put` (or counted
    with :meth:`count`, for a table whose values are tables), which the process
    may forget at any insertion (see the module's docstring). Lookups are the
    dict's own."""

    # (no instance dict: a lookup is then as fast as a plain dict's)
    __slots__ = ("__weakref__", "held")

    def __init__(self) -> None:
        super().__init__()
        #: entries put since the table was last forgotten
        self.held = 0
        _TABLES.tables[id(self)] = self  # type: ignore[assignment]

    def put(self, key: _K, value: _V) -> _V:
        """Memoize ``value`` under ``key`` (the table may be forgotten first);
        ``value``."""
        self.count()
        self[key] = value
        return value

    def count(self) -> None:
        """One entry more in this table or in a table it holds: the table is
        forgotten first if it holds :data:`CACHE_LIMIT`, and every table of the
        process if the search is past :data:`FORGET_AT` of its memory limit."""
        if self.held >= CACHE_LIMIT:
            self.clear()
        self.held += 1
        tables = _TABLES
        tables.until_read -= 1
        if tables.until_read <= 0:
            tables.read()

    def clear(self) -> None:
        super().clear()
        self.held = 0


def bound_memory(limit_bytes: float | None, weight: Weight | None = None) -> None:
    """Forget every memo table of this process whenever ``weight`` (the bytes the
    search's processes hold, as its main process last weighed them) passes
    :data:`FORGET_AT` of ``limit_bytes``; None: only :data:`CACHE_LIMIT` bounds
    them. A process forked after the call reads the same ``weight``."""
    _TABLES.weight = None if limit_bytes is None else weight
    _TABLES.limit = limit_bytes or 0.0
    _TABLES.threshold = FORGET_AT * _TABLES.limit
    _TABLES.until_read = READ_EVERY


def forgotten() -> int:
    """Times this process forgot every memo table for the search's memory."""
    return _TABLES.forgotten
