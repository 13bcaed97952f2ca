"""The data of the rendezvous: who is in it, and what each node has seen.

Two kinds of data live here:

* :class:`RendezvousState` is *shared*: every node reads and writes it through a
  compare-and-set backend. It holds no clock values at all (docs/design.md, decision 2):
  heartbeats are counters, and the last call is an arming sequence number.
* :class:`Observations` is *local* to one node: when, on that node's own monotonic
  clock, it saw each heartbeat counter move and the last call armed. Only durations
  measured on one clock are ever compared, so clock skew between hosts is harmless.

Everything is immutable and hashable, so the model checker can keep visited sets
and a transition can never mutate its input.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from immutables import Map

__all__ = [
    "Context",
    "HeartbeatSighting",
    "LastCallSighting",
    "NodeDesc",
    "Observations",
    "RendezvousState",
    "Settings",
]

_K = TypeVar("_K")
_V = TypeVar("_V")
# Bound once: the copies below run on every write and every decision.
_new_instance = object.__new__
_set_attribute = object.__setattr__
# Every value the core reads on every step (states, settings, observations,
# contexts) is given a plain attribute dictionary of its own when it is made,
# ``_set_attribute(instance, "__dict__", fields)``: CPython 3.11 reads an attribute
# of such an instance at about a third of the cost of one whose dictionary was
# made from its inline values (the first read of ``__dict__``, or a ``copy()`` of
# such a dictionary, makes a key-sharing one, for which attribute reads are not
# specialized: measured 25 ns against 7 ns a read).


def _frozen_map(items: Mapping[_K, _V] | Iterable[tuple[_K, _V]] = ()) -> Map[_K, _V]:
    if isinstance(items, Map):
        return items
    return Map(items)


class NodeDesc(NamedTuple):
    """One rendezvous participant: a handler instance in one process on one host.

    Nodes are totally ordered by (addr, pid, local_id); without the stable-ranks
    option, ranks are assigned in that order, as torch does. A named tuple, because
    nodes are dictionary keys in every step of every node and tuple hashing and
    comparison run in C.
    """

    addr: str
    pid: int
    local_id: int

    def __str__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"

    @classmethod
    def parse(cls, text: str) -> NodeDesc:
        """The node whose ``str()`` is ``text``.

        Raises:
            ValueError: ``text`` is not ``<addr>_<pid>_<local_id>``.
        """
        addr, _, rest = text.rpartition("_")
        addr, _, pid = addr.rpartition("_")
        if not addr or not pid.isdigit() or not rest.isdigit():
            raise ValueError(f"{text[:100]!r} is not a node name (<addr>_<pid>_<local_id>)")
        return cls(addr, int(pid), int(rest))


def _is_seconds(value: object) -> bool:
    """A finite real number (bools are ints in Python, but never durations)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Settings:
    """What every node of one rendezvous must agree on.

    Durations are float seconds on each node's own monotonic clock; they are never
    compared across hosts. Defaults follow torch's dynamic rendezvous.

    Raises:
        ValueError: on construction, when a value is out of range, with a message
            naming the field and the accepted range.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    heartbeat_timeout: float = 5.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    #: Grace period after the join deadline during which a timed-out node still
    #: removes itself from the shared state (torch hard-codes 5 s).
    rollback_period: float = 5.0
    #: Keep a surviving node's rank across rounds where possible, instead of
    #: re-ranking all participants by node order (torch's behaviour).
    stable_ranks: bool = False
    #: How many failure-caused rounds the whole job may start (a job-wide
    #: ``--max-restarts``): the failure after the last one closes the rendezvous.
    #: None: no shared budget; each agent counts its own restarts, as torch does.
    restart_budget: int | None = None
    #: How many rounds a node that excluded itself (a failed health check, or
    #: workers failing again and again) sits out, standing by as a spare.
    exclusion_rounds: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ValueError("run_id must be a non-empty string")
        for name in ("min_nodes", "max_nodes", "keep_alive_max_attempt"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be at least 1, got {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"max_nodes ({self.max_nodes}) must be at least min_nodes ({self.min_nodes})"
            )
        if self.keep_alive_max_attempt < 1:
            raise ValueError(
                f"keep_alive_max_attempt must be at least 1, got {self.keep_alive_max_attempt}"
            )
        for name in (
            "join_timeout",
            "last_call_timeout",
            "close_timeout",
            "heartbeat_timeout",
            "keep_alive_interval",
        ):
            if not _is_seconds(value := getattr(self, name)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not _is_seconds(rollback := self.rollback_period) or rollback < 0:
            raise ValueError(f"rollback_period must be >= 0 seconds, got {rollback!r}")
        if not isinstance(self.stable_ranks, bool):
            raise ValueError(f"stable_ranks must be a bool, got {self.stable_ranks!r}")
        budget = self.restart_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise ValueError(f"restart_budget must be an integer or None, got {budget!r}")
        if budget is not None and budget < 0:
            raise ValueError(f"restart_budget must be at least 0, got {budget}")
        rounds = self.exclusion_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"exclusion_rounds must be an integer >= 1, got {rounds!r}")
        _set_attribute(self, "__dict__", dict(self.__dict__))

    # Read before every decision: computed once (the fields are frozen).
    @functools.cached_property
    def liveness_window(self) -> float:
        """Seconds without a heartbeat counter moving after which a node is dead."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


@dataclass(frozen=True)
class RendezvousState:
    """The shared state of one rendezvous, as stored on the backend.

    Attributes:
        round: the current round; advances when the last participant of a complete
            round leaves. Never decreases.
        complete: the round's membership is final and ranks are assigned.
        closed: the job is over; no node may join again. Never reverts.
        world_size: the number of participants when the round completed (0 while
            incomplete). Participants may leave a complete round one by one; the
            world size their peers were told stays fixed.
        participants: node -> rank. Ranks are meaningful only once complete; while
            incomplete every rank is 0, as in torch.
        wait_list: nodes waiting for the next round (a complete round had capacity).
        redundancy_list: nodes beyond max_nodes of a complete round; they join the
            next round without forcing a re-rendezvous.
        heartbeats: node -> a counter the node bumps to prove it is alive. Every node
            in one of the three sets above has one.
        last_call: the arming sequence number of the current last call (set when
            the participants reach min_nodes), or None when not armed. Each node
            times the last call from when it first observed this number.
        last_call_seq: the last arming sequence number handed out; makes every
            arming distinguishable from the previous one.
        last_ranks: ranks of the last completed round, kept only with the
            stable-ranks option.
        heartbeat_seq: the largest heartbeat counter ever handed out. A node that
            (re)gets a heartbeat entry starts above it, so its counter never repeats
            a value an observer may still hold from an earlier membership (an
            observer that missed the removal would otherwise see "no movement").
        phase: a number that grows by one with every write that changes what a
            waiting node decides on (see :func:`rallypoint.core.driver.phase_of`):
            waiters wait for the phase, not for every write (docs/design.md, decision 8).
        intent_cursor: how many entries of this round's intent log (joiners that
            announced themselves) were already admitted; a new round starts at 0.
        restarts: how many failure-caused rounds the job has started (the
            job-wide restart budget's count). Never decreases.
        charged_through: failures in rounds below this one are already counted
            in ``restarts``: the workers of several nodes failing in one round
            cost one restart. Never decreases.
        excluded: node -> the first round it may be a participant of again. A
            node excludes itself (a failed health check, repeated failures);
            while excluded it may only stand by in the redundancy list. Entries
            are dropped once their round is reached.
        returning: participants of the last complete round that left it to join
            the next one (the exit before a join) and have not joined it yet. A
            node known gone is dropped: one that left for good, was declared
            dead, excluded itself, or gave up waiting on a timeout. Empty once
            closed: a closed rendezvous forms no next round to return to.
        regroup: the open round is a regroup of the last complete round: every
            participant so far came back from it (set when a round completes,
            cleared, with ``returning``, when anybody else joins). Once nobody is
            returning, nobody waits and no spare may join, nobody else is
            expected: the round completes at quorum without waiting out its last
            call. Cleared when the rendezvous closes.
    """

    round: int = 0
    complete: bool = False
    closed: bool = False
    world_size: int = 0
    participants: Map[NodeDesc, int] = field(default_factory=Map)
    wait_list: frozenset[NodeDesc] = frozenset()
    redundancy_list: frozenset[NodeDesc] = frozenset()
    heartbeats: Map[NodeDesc, int] = field(default_factory=Map)
    last_call: int | None = None
    last_call_seq: int = 0
    last_ranks: Map[NodeDesc, int] = field(default_factory=Map)
    heartbeat_seq: int = 0
    phase: int = 0
    intent_cursor: int = 0
    restarts: int = 0
    charged_through: int = 0
    excluded: Map[NodeDesc, int] = field(default_factory=Map)
    returning: frozenset[NodeDesc] = frozenset()
    regroup: bool = False

    def __post_init__(self) -> None:
        # Accept plain dicts/sets from callers; store immutable, hashable forms.
        object.__setattr__(self, "participants", _frozen_map(self.participants))
        object.__setattr__(self, "heartbeats", _frozen_map(self.heartbeats))
        object.__setattr__(self, "last_ranks", _frozen_map(self.last_ranks))
        object.__setattr__(self, "excluded", _frozen_map(self.excluded))
        object.__setattr__(self, "wait_list", frozenset(self.wait_list))
        object.__setattr__(self, "redundancy_list", frozenset(self.redundancy_list))
        object.__setattr__(self, "returning", frozenset(self.returning))
        # (Every state derived from this one copies its dictionary: a plain one.)
        _set_attribute(self, "__dict__", dict(self.__dict__))

    def __hash__(self) -> int:
        # States are dictionary keys in memo tables (the checker's, the simulator's
        # agreement tracker): hash the fields once per object, not once per lookup.
        fields = self.__dict__
        cached = fields.get("_hash")
        if cached is None:
            values = list(_field_values(fields))
            for at in _MAP_POSITIONS:
                # A map's own hash folds each key and value in apart (two maps
                # that swap two values hash alike: ranks, heartbeat counters);
                # a frozenset of its pairs hashes each pair as a whole.
                if values[at]:
                    values[at] = frozenset(values[at].items())
            cached = fields["_hash"] = hash(tuple(values))
        return cached

    def __eq__(self, other: object) -> bool:
        # States are compared on every hit of a memo keyed on an equal copy: the
        # cached hashes tell most unequal states apart without a field.
        if self is other:
            return True
        if other.__class__ is not RendezvousState:
            return NotImplemented
        mine, theirs = self.__dict__, other.__dict__
        # (hashes compared as cached: a dictionary lookup compares keys only
        # once their hashes matched, and an unhashed state is compared directly)
        hashed, other_hashed = mine.get("_hash"), theirs.get("_hash")
        if hashed is not None and other_hashed is not None and hashed != other_hashed:
            return False
        return bool(_field_values(mine) == _field_values(theirs))

    def __getstate__(self) -> dict[str, object]:
        # String hashes differ between processes: a copy made in another process
        # hashes anew.
        return {name: self.__dict__[name] for name in _FIELD_NAMES}

    def __setstate__(self, fields: dict[str, object]) -> None:
        # (States rebuilt from these fields, in another process or as copies, read
        # as fast as the ones made here.)
        _set_attribute(self, "__dict__", dict(fields))

    def members(self) -> frozenset[NodeDesc]:
        """Every node the state knows: participants, waiting and redundant nodes."""
        # Cached like the hash: checkers and monitors ask a state many times.
        cached = self.__dict__.get("_members")
        if cached is None:
            cached = frozenset(self.participants) | self.wait_list | self.redundancy_list
            object.__setattr__(self, "_members", cached)
        return cached

    def ranks(self) -> dict[NodeDesc, int]:
        """node -> rank of a complete round (empty while incomplete)."""
        return dict(self.participants.items()) if self.complete else {}

    def evolve(self, **changes: object) -> RendezvousState:
        """A copy with the given fields replaced (the input is never modified).

        Every transition goes through here; it copies the field dictionary instead
        of re-running the constructor, converting only the fields it is given.
        """
        for name, value in changes.items():
            if name not in _FIELD_SET:
                raise TypeError(f"RendezvousState has no field {name!r}")
            if name in _MAP_FIELDS and not isinstance(value, Map):
                changes[name] = Map(value)  # type: ignore[call-overload]
            elif name in _SET_FIELDS and not isinstance(value, frozenset):
                changes[name] = frozenset(value)  # type: ignore[call-overload]
        return self._derive(changes)

    def _derive(self, changes: dict[str, object]) -> RendezvousState:
        """:meth:`evolve` for the core's own transitions, whose ``changes`` are
        known to be fields of the stored types: no per-field checks."""
        fields = self._fields()
        fields.update(changes)
        return RendezvousState._of(fields)

    def _fields(self) -> dict[str, object]:
        """A copy of the field dictionary, for a transition to set the fields it
        changes in and hand to :meth:`_of` (the hottest transitions fill it
        directly instead of building a dictionary of changes for :meth:`_derive`)."""
        fields = self.__dict__.copy()
        if len(fields) != _FIELD_COUNT:  # (a cache is set: most states have none)
            fields.pop("_hash", None)  # the copy's fields change: hash them anew
            fields.pop("_members", None)
        return fields

    def _phase_set(self, phase: int) -> RendezvousState:
        """This state, its ``phase`` set to ``phase`` in place: only for a state
        just made for a write, which nobody else holds yet and whose hash is not
        cached. (A copy of every field, as :meth:`_derive` makes, costs about a
        tenth of a driver step, and every other write moves the phase.)"""
        self.__dict__["phase"] = phase
        return self

    @staticmethod
    def _of(fields: dict[str, object]) -> RendezvousState:
        """The state whose field dictionary is ``fields`` (every field, of the
        stored types; see :meth:`_fields`), which it takes over."""
        new = _new_instance(RendezvousState)
        # Handing the copy over whole costs half of filling the new instance's own
        # (key-sharing) dictionary field by field, and its attributes read faster.
        _set_attribute(new, "__dict__", fields)
        return new


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(RendezvousState))
#: A state's field dictionary -> its field values in order (in C).
_field_values = operator.itemgetter(*_FIELD_NAMES)
_FIELD_SET = frozenset(_FIELD_NAMES)
_FIELD_COUNT = len(_FIELD_NAMES)
_MAP_FIELDS = frozenset({"participants", "heartbeats", "last_ranks", "excluded"})
_MAP_POSITIONS = tuple(i for i, name in enumerate(_FIELD_NAMES) if name in _MAP_FIELDS)
_SET_FIELDS = frozenset({"wait_list", "redundancy_list", "returning"})


class HeartbeatSighting(NamedTuple):
    """A heartbeat counter value and when (observer's clock) it was first seen."""

    counter: int
    since: float


class LastCallSighting(NamedTuple):
    """Which last call (round, arming number) was seen, and when it was first seen."""

    round: int
    arming: int
    since: float


@dataclass(frozen=True)
class Observations:
    """One node's private record of what it saw, timed on its own monotonic clock.

    Built and updated only by :func:`rallypoint.core.observe`; never shared. A
    heartbeat sighting's counter is the pair (state counter, side counter) folded
    into one integer (see :mod:`rallypoint.core.liveness`).
    """

    heartbeats: Map[NodeDesc, HeartbeatSighting] = field(default_factory=Map)
    last_call: LastCallSighting | None = None
    #: The state counters and side counters the sightings were last taken from:
    #: observing them again costs one identity comparison.
    source: Map[NodeDesc, int] | None = field(default=None, compare=False, repr=False)
    source_side: object = field(default=None, compare=False, repr=False)
    #: The earliest ``since`` of all heartbeat sightings (None: no sightings), so
    #: that "is anybody dead?" is one comparison.
    oldest: float | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "heartbeats", _frozen_map(self.heartbeats))
        if self.oldest is None and self.heartbeats:
            object.__setattr__(self, "oldest", min(s.since for s in self.heartbeats.values()))
        _set_attribute(self, "__dict__", dict(self.__dict__))

    @classmethod
    def _derived(
        cls,
        heartbeats: Map[NodeDesc, HeartbeatSighting],
        last_call: LastCallSighting | None,
        source: Map[NodeDesc, int] | None,
        source_side: object,
        oldest: float | None,
    ) -> Observations:
        """Observations made by :mod:`rallypoint.core.liveness`, whose arguments
        are already of the stored types and whose ``oldest`` is already right: the
        constructor's conversion and scan are skipped (a node observes on every
        read and write)."""
        new = _new_instance(cls)
        _set_attribute(
            new,
            "__dict__",
            {
                "heartbeats": heartbeats,
                "last_call": last_call,
                "source": source,
                "source_side": source_side,
                "oldest": oldest,
            },
        )
        return new


#: Observations of nothing: immutable, so every context without its own shares it.
_NO_OBSERVATIONS = Observations()


@dataclass(frozen=True, init=False)
class Context:
    """Everything one decision may depend on.

    Attributes:
        node: the deciding node.
        state: the shared state as this node last read it (after :func:`sanitize`).
        settings: the rendezvous settings.
        now: the node's local monotonic time, in seconds.
        observations: the node's local sightings (see :func:`observe`).
    """

    node: NodeDesc
    state: RendezvousState
    settings: Settings
    now: float
    observations: Observations = _NO_OBSERVATIONS

    def __init__(
        self,
        node: NodeDesc,
        state: RendezvousState,
        settings: Settings,
        now: float,
        observations: Observations = _NO_OBSERVATIONS,
    ) -> None:
        # One context is built per decision (and per admitted joiner): handing it
        # its field dictionary costs a fraction of the frozen dataclass's
        # per-field object.__setattr__ calls.
        _set_attribute(
            self,
            "__dict__",
            {
                "node": node,
                "state": state,
                "settings": settings,
                "now": now,
                "observations": observations,
            },
        )

    @property
    def is_participant(self) -> bool:
        return self.node in self.state.participants

    @property
    def is_waiting(self) -> bool:
        return self.node in self.state.wait_list

    @property
    def is_redundant(self) -> bool:
        return self.node in self.state.redundancy_list

    @property
    def is_excluded(self) -> bool:
        """The node excluded itself and its exclusion has not run out yet."""
        return self.state.excluded.get(self.node, 0) > self.state.round
