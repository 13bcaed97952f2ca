"""The checker's memo tables, bounded in entries each and in bytes together.

Every step rule, normal form and wire encoding of the checker is memoized: a
search meets the same shared states, views and steps over and over, and looks
them up instead of computing them again. A memo only saves work, so the search may
forget any table at any time and still find the same states, transitions and
depth (``tests/spec/test_check_limits.py`` checks that). Two bounds forget them:

* a table that holds :data:`CACHE_LIMIT` entries is forgotten before its next
  one (a bound per table, whatever the machine);
* every table of a process is forgotten when the process holds more memory than
  its share of the search's ``max_memory`` (:func:`bound_memory`): the search
  stops once its processes hold ``max_memory``, and without this the memos of a
  long search were what filled it.

A process weighs itself every :data:`WEIGH_EVERY` insertions (a read of its
resident size, a few microseconds) and nowhere else, so a table costs nothing
more to read than the dict it is.
"""

from __future__ import annotations

import os
import weakref
from typing import TypeVar

import psutil

__all__ = ["CACHE_LIMIT", "WEIGH_EVERY", "Memo", "bound_memory", "forgotten"]

#: Entries one memo table keeps at most (a bound on memory, not on the search).
CACHE_LIMIT = 500_000
#: Insertions into this process's memo tables between two looks at its memory.
WEIGH_EVERY = 4096

_K = TypeVar("_K")
_V = TypeVar("_V")


class _Tables:
    """The memo tables of this process and the memory they may fill."""

    def __init__(self) -> None:
        #: id -> table, for every table alive
        self.tables: weakref.WeakValueDictionary[int, Memo[object, object]] = (
            weakref.WeakValueDictionary()
        )
        #: bytes this process holds before it forgets every table (None: no bound)
        self.share: int | None = None
        #: what the process holds without its tables may itself pass the share:
        #: the tables are then forgotten past that much more (see weigh)
        self.threshold: int | None = None
        self.until_weighed = WEIGH_EVERY
        #: times this process forgot every table for its memory
        self.forgotten = 0
        self._process: tuple[int, psutil.Process] | None = None

    def resident(self) -> int:
        pid = os.getpid()
        # (a fork inherits this object: a Process made before it names the parent)
        if self._process is None or self._process[0] != pid:
            self._process = (pid, psutil.Process(pid))
        return int(self._process[1].memory_info().rss)

    def weigh(self) -> None:
        self.until_weighed = WEIGH_EVERY
        if self.threshold is None or self.share is None:
            return
        if self.resident() <= self.threshold:
            return
        for table in list(self.tables.values()):
            table.clear()
        self.forgotten += 1
        # Freed memory goes back to the allocator, not always to the system: the
        # tables refill it before the process grows again. What the process
        # holds without them may also be past the share (a search's own sets):
        # the tables then get a quarter of the share on top of that.
        self.threshold = max(self.share, self.resident() + self.share // 4)


_TABLES = _Tables()


class Memo(dict[_K, _V]):
    """One memo table: a dict whose entries are put with :meth:`put` (or counted
    with :meth:`count`, for a table whose values are tables), which the process
    may forget at any insertion (see the module's docstring). Lookups are the
    dict's own."""

    # (no instance dict: a lookup is then as fast as a dict's own, specialized)
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
        process if the process is past its share of memory."""
        if self.held >= CACHE_LIMIT:
            self.clear()
        self.held += 1
        tables = _TABLES
        tables.until_weighed -= 1
        if tables.until_weighed <= 0:
            tables.weigh()

    def clear(self) -> None:
        super().clear()
        self.held = 0


def bound_memory(share_bytes: int | None) -> None:
    """Forget every memo table of this process whenever it holds more than
    ``share_bytes`` (None: only :data:`CACHE_LIMIT` bounds them). A process forked
    after the call inherits the bound, and weighs its own memory."""
    _TABLES.share = share_bytes
    _TABLES.threshold = share_bytes
    _TABLES.until_weighed = WEIGH_EVERY


def forgotten() -> int:
    """Times this process forgot every memo table for its memory."""
    return _TABLES.forgotten
