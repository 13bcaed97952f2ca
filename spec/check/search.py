"""The checker's search: breadth first, a level at a time, in one or many processes.

Each level is stepped in chunks (:meth:`Search.step_chunk`) and their successors
merged in order; this process keeps the visited fingerprints and the parent
pointers, and replays a violation into its trace. With several workers the chunks
are stepped by forked processes: a worker is a fork of the search (so a bug
planted in the core before the search is planted in every worker), steps the
shared states that hash to it level after level (its memo tables hold their
work), and hands back the successors it did not hand back before. A level is
the set of states first reached at that depth whatever order its chunks merge
in, so the states, transitions and depth do not depend on the number of workers;
the parent a state is reached from, and so a violation's trace, may (with
several workers, the order follows ``hash()``, which differs between runs).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import multiprocessing
import os
import time
from collections.abc import Callable, Container, Iterable, Iterator
from multiprocessing.pool import AsyncResult, Pool
from typing import Any, TypeVar

import psutil

from ..model.invariants import check_state
from .memo import Weight, bound_memory
from .state import CheckerWorkerError, CheckResult, Event, Found, Global, Violation
from .steps import Steps
from .symmetry import Symmetry, relabel
from .trace import replay
from .wire import Wire, WireTuple, event_of

__all__ = ["Search"]

#: Seconds between two progress reports of a search, and between two looks at
#: its memory (against ``max_memory``).
_PROGRESS_INTERVAL = 0.5
#: Seconds between two looks at the workers while waiting for one: a dead one's
#: chunk never comes back, and waiting on would hang the search.
_LIVENESS_INTERVAL = 0.5
_GIB = 2**30
_T = TypeVar("_T")
#: States a worker steps in one go, at most.
_CHUNK = 256

#: A state of a level: (the state, its fingerprint) in process; from a worker, (the
#: state on the wire, its fingerprint, the hash of its shared state).
_Item = tuple[Any, ...]
#: One successor a chunk hands back: (parent fingerprint, event, its level item,
#: the fingerprints of the states that simulate it by earlier deadlines, see
#: Symmetry.earlier_twins); from a worker, the event is on the wire.
_Successor = tuple[int, Event | WireTuple, _Item, tuple[int, ...]]
#: What stepping a chunk gives (see Search.step_chunk).
_ChunkOutcome = tuple[
    list[_Successor],
    list[int],
    int,
    set[tuple[str, str, str]],
    tuple[int, Event, list[str]] | None,
]
#: Fingerprint -> (its parent's fingerprint, the event from the parent, maybe on
#: the wire; None for the initial state, its own parent).
_Parents = dict[int, tuple[int, Event | WireTuple | None]]


class Search:
    """One breadth-first search of the states reachable from an initial state."""

    def __init__(self, steps: Steps, symmetry: Symmetry) -> None:
        self.steps = steps
        self.symmetry = symmetry
        self.config = steps.config
        #: transitions checked whose successors are not stored (see Steps.choices)
        self.checked_transitions = 0
        #: fingerprints a worker process handed back already (see step_chunk)
        self._handed_out: set[int] = set()
        #: lifecycle edges a chunk reported already (see step_chunk)
        self._edges_reported: set[tuple[str, str, str]] = set()
        self._start = self._reported = self._weighed = 0.0
        #: the processes whose memory counts against ``max_memory``: this one,
        #: and the workers (see _levels)
        self._processes = [psutil.Process()]
        #: fingerprints of the states reached and not stepped: a state reached by
        #: then simulates each (see _merge; in a worker, those it left out)
        self._subsumed: set[int] = set()
        #: the state the search started from (a violation's trace starts there)
        self._initial: Global | None = None
        #: this process's end of the wire to and from the workers
        self._wire = Wire()
        #: what the search's processes hold, as last weighed, in memory the
        #: workers share (see _levels and memo.bound_memory)
        self._weight: Weight | None = None

    def run(
        self,
        initial: Global,
        progress: Callable[[CheckResult], None] | None = None,
        on_state: Callable[[Global, int], None] | None = None,
        workers: int = 1,
    ) -> CheckResult:
        """Explore every state reachable from ``initial`` (or up to ``max_states``).

        ``progress`` is called with the running totals about every
        ``_PROGRESS_INTERVAL`` seconds, and ``on_state`` with every newly stored
        state and its fingerprint.
        """
        with _without_collections():
            self._start = self._reported = self._weighed = time.perf_counter()
            self._initial = initial
            self._subsumed = set()
            result = CheckResult(self.config)
            init, _, init_fp = self.symmetry.canonical(initial)
            problems = check_state(init.shared, self.steps.settings)
            if problems:
                result.violation = Violation(problems, ["initial state"])
                return result
            parents: _Parents = {init_fp: (init_fp, None)}
            if on_state is not None:
                on_state(init, init_fp)
            result.depth = self._levels(
                result, parents, [(init, init_fp)], progress, on_state, workers
            )
            result.states, result.subsumed = len(parents), len(self._subsumed)
            result.seconds = time.perf_counter() - self._start
            result.lifecycle_edges = set(self.steps.conformance.edges)
            return result

    def _levels(
        self,
        result: CheckResult,
        parents: _Parents,
        level: list[_Item],
        progress: Callable[[CheckResult], None] | None,
        on_state: Callable[[Global, int], None] | None,
        workers: int,
    ) -> int:
        """Step level after level until none is left, a violation or the state
        limit; the depth reached."""
        global _WORKER
        depth = 0
        self.checked_transitions = 0
        # One single-process pool per worker, so that a shared state's chunks go
        # to the same process level after level and find their memoized work
        # there (with one shared pool, every worker redid most of it: two
        # workers used 1.7 times the CPU time of one).
        pools: list[Pool] = []
        #: shared state hash -> the worker that steps its states (see _in_workers)
        owners: dict[int, int] = {}
        # (before the workers fork: each reads the weight from shared memory)
        limit = self.config.max_memory
        context = multiprocessing.get_context("fork")
        self._weight = context.RawValue("d", 0.0)
        bound_memory(None if limit is None else limit * _GIB, self._weight)
        if workers > 1:
            _WORKER = self
            pools = [context.Pool(1) for _ in range(workers)]
            self._processes[1:] = [psutil.Process(pool.apply(os.getpid)) for pool in pools]
            g, fp = level[0]
            level = [(self._wire.state(g), fp, hash(g.shared))]
        try:
            while level:
                result.depth = depth
                if self._out_of_memory(result):
                    break
                size = max(1, min(_CHUNK, len(level) // (workers * 4)))
                # In process, each chunk is stepped after the previous one merged:
                # it skips the successors already known.
                outcomes: Iterable[_ChunkOutcome] = (
                    _in_workers(pools, level, size, owners, self._processes[1:])
                    if pools
                    else (self.step_chunk(chunk, parents) for chunk in _chunks(level, size))
                )
                following = self._merge(outcomes, result, parents, progress, on_state)
                if following is None:
                    break
                level = following
                depth += 1 if level else 0
        finally:
            for pool in pools:
                pool.terminate()
                pool.join()
            del self._processes[1:]
            _WORKER = None
            bound_memory(None)
        return depth

    def _out_of_memory(self, result: CheckResult) -> bool:
        """Whether the search's processes hold more than ``max_memory`` (then
        ``result`` says so: the search stops there). ``result.memory`` is what
        they hold, for the progress line; the memo tables read it too (see
        :func:`~rallypoint.spec.check.memo.bound_memory`)."""
        limit = self.config.max_memory
        if limit is None:
            return False
        self._weighed = time.perf_counter()
        held = 0
        for process in self._processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                held += process.memory_info().rss
        result.memory = held / _GIB
        if self._weight is not None:
            self._weight.value = held
        if held <= limit * _GIB:
            return False
        result.complete = False
        result.stopped_by = "max_memory"
        return True

    def _merge(
        self,
        outcomes: Iterable[_ChunkOutcome],
        result: CheckResult,
        parents: _Parents,
        progress: Callable[[CheckResult], None] | None,
        on_state: Callable[[Global, int], None] | None,
    ) -> list[_Item] | None:
        """Merge a level's chunk outcomes in order: the next level, or None when
        the search stops here (a violation, or the state limit)."""
        limit = self.config.max_states
        following: list[_Item] = []
        #: fingerprint of a state of ``following`` -> the states that simulate it
        twins_of: dict[int, tuple[int, ...]] = {}
        subsumed = self._subsumed
        for successors, simulated, stepped, edges, violation in outcomes:
            result.transitions += stepped
            self.steps.conformance.edges |= edges
            if violation is not None:
                result.violation = self._violation(parents, *violation)
                return None
            # (a worker that did not hand a state out does not know it was
            # stored: it was stored before a state that simulates it was reached)
            subsumed.update(fp for fp in simulated if fp not in parents)
            for parent, event, item, twins in successors:
                cfp = item[1]
                if cfp in parents or cfp in subsumed:
                    continue
                if twins:
                    if not parents.keys().isdisjoint(twins):
                        subsumed.add(cfp)
                        continue
                    twins_of[cfp] = twins
                parents[cfp] = (parent, event)
                following.append(item)
                if limit is not None and len(parents) >= limit:
                    result.complete = False
                    result.stopped_by = "max_states"
                    self._stored(following, on_state)
                    return None
            now = time.perf_counter()
            if now - self._weighed >= _PROGRESS_INTERVAL and self._out_of_memory(result):
                return None
            if progress is not None and now - self._reported >= _PROGRESS_INTERVAL:
                self._reported = now
                result.states, result.subsumed = len(parents), len(subsumed)
                result.seconds = now - self._start
                progress(result)
        if twins_of:
            # States simulated by one reached later in this level: the level is
            # the same set in whatever order its chunks merge.
            kept = []
            for item in following:
                if parents.keys().isdisjoint(twins_of.get(item[1], ())):
                    kept.append(item)
                else:
                    del parents[item[1]]  # (nothing was stepped from it yet)
                    subsumed.add(item[1])
            following = kept
        self._stored(following, on_state)
        return following

    def _stored(self, level: list[_Item], on_state: Callable[[Global, int], None] | None) -> None:
        """Hand ``on_state`` the states of ``level``, newly stored."""
        if on_state is None:
            return
        for item in level:
            stored = item[0]
            if not isinstance(stored, Global):
                stored = self._wire.global_of(stored)
            on_state(stored, item[1])

    def _violation(
        self, parents: _Parents, parent: int, event: Event, problems: list[str]
    ) -> Violation:
        """The violation found stepping ``event`` from the state ``parent``, with
        its trace (and its problems in the trace's node names)."""
        assert self._initial is not None, "a violation is found only within run"
        path = [*_path(parents, parent), event]
        traced = replay(self.steps, self.symmetry, self._initial, path)
        return Violation(problems if traced.problems is None else traced.problems, traced.trace)

    def successors(self, g: Global) -> Iterator[tuple[Event, Global]]:
        """The successors of ``g`` to store, each with its event, after checking
        every transition of ``g`` (see :meth:`Steps.choices`).

        Raises:
            Found: a transition violates a property (``event`` names it).
        """
        steps = self.steps
        phases = tuple((loc.phase, loc.incarnation) for loc in g.locals)
        for abstract in steps.events(g):
            stored, checked, checks = steps.plan(g, abstract)
            self.checked_transitions += checks
            for event in checked:
                try:
                    steps.successor(g, event, check_only=True)
                except Found as found:
                    found.event = event
                    raise
            for template in stored:
                try:
                    succ = steps.follow(g, template, phases)
                except Found as found:
                    found.event = template.event
                    raise
                yield template.event, succ

    def step_chunk(
        self,
        chunk: list[tuple[Global, int]],
        known: Container[int],
        handed_out: set[int] | None = None,
    ) -> _ChunkOutcome:
        """Step the states of ``chunk``: their successors whose fingerprints are
        not in ``known`` (each added to ``handed_out``, if given) and that no
        state in ``known`` simulates by earlier deadlines, each with the
        fingerprints of the states that would (see :meth:`_merge`); the
        transitions stepped, the lifecycle edges first exercised since the last
        chunk, and the first violation as (parent fingerprint, event, problems)."""
        successors: list[_Successor] = []
        simulated: list[int] = []
        checked_before = self.checked_transitions
        stepped = 0
        violation = None
        symmetry = self.symmetry
        max_round = self.config.max_round
        subsumed = self._subsumed
        for g, fp in chunk:
            if max_round is not None and g.shared.round > max_round:
                continue  # stored, not stepped: the rounds are bounded
            g = symmetry.intern(g)
            seen: set[int] = set()  # many timer choices lead to one state
            try:
                for event, succ in self.successors(g):
                    stepped += 1
                    succ, perm, cfp = symmetry.place(succ)
                    if cfp in seen or cfp in known or cfp in subsumed:
                        continue
                    twins = self._twins(succ, seen, known)
                    if twins is None:
                        # The merge would drop it (see _merge); and once a state
                        # is subsumed it stays so.
                        simulated.append(cfp)
                        subsumed.add(cfp)
                        continue
                    seen.add(cfp)
                    if handed_out is not None:
                        handed_out.add(cfp)
                    successors.append((fp, event, (relabel(succ, perm), cfp), twins))
            except Found as problem:
                assert problem.event is not None
                violation = (fp, problem.event, problem.problems)
                break
        edges = self.steps.conformance.edges - self._edges_reported
        self._edges_reported |= edges
        stepped += self.checked_transitions - checked_before
        return successors, simulated, stepped, edges, violation

    def _twins(self, succ: Global, seen: set[int], known: Container[int]) -> tuple[int, ...] | None:
        """The fingerprints of ``succ``'s earlier twins (the states that simulate
        it, see :meth:`Symmetry.earlier_twins`), or None once one of them is in
        ``seen`` or ``known``: reached already."""
        twins = []
        for twin in self.symmetry.earlier_twins(succ):
            if twin in seen or twin in known:
                return None
            twins.append(twin)
        return tuple(twins)


def _by_shared_state(level: list[tuple[Global, int]]) -> dict[object, list[tuple[Global, int]]]:
    """The states of ``level`` by shared state, in the order each first appears:
    most of a state's step work is memoized on its shared state."""
    groups: dict[object, list[tuple[Global, int]]] = {}
    for item in level:
        groups.setdefault(item[0].shared, []).append(item)
    return groups


def _by_shared_hash(
    level: list[tuple[WireTuple, int, int]],
) -> dict[int, list[tuple[WireTuple, int]]]:
    """:func:`_by_shared_state` for states on the wire, by their shared state's hash."""
    groups: dict[int, list[tuple[WireTuple, int]]] = {}
    for wire, fp, shared_hash in level:
        groups.setdefault(shared_hash, []).append((wire, fp))
    return groups


def _chunks(level: list[tuple[Global, int]], size: int) -> list[list[tuple[Global, int]]]:
    """``level`` cut into chunks of ``size`` states, a shared state's states next
    to each other."""
    return _cut([item for group in _by_shared_state(level).values() for item in group], size)


def _cut(items: list[_T], size: int) -> list[list[_T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _in_workers(
    pools: list[Pool],
    level: list[tuple[WireTuple, int, int]],
    size: int,
    owners: dict[int, int],
    processes: list[psutil.Process],
) -> Iterator[_ChunkOutcome]:
    """The outcomes of ``level``'s chunks, each stepped by the worker its shared
    state belongs to (the same worker level after level, where that state's
    memoized work is), in an order that takes the workers in turn.

    ``owners`` (shared state hash -> worker) grows as shared states first come:
    each new one goes to the worker given the fewest new ones in this level. Most
    of a level's work is the memo misses of its new shared states, so this evens
    the levels out; with the owner by ``hash % workers``, one worker got about a
    tenth more of most levels, a different share in every run (3-node default,
    five interleaved pairs: 28.6 s against 30.3 s on average, the worst 29.3
    against 33.0). (Forked workers hash alike: they share the main process's
    hash seed.)"""
    shares: list[list[tuple[WireTuple, int]]] = [[] for _ in pools]
    new_here = [0] * len(pools)
    for shared_hash, group in _by_shared_hash(level).items():
        owner = owners.get(shared_hash)
        if owner is None:
            owner = owners[shared_hash] = min(range(len(pools)), key=new_here.__getitem__)
            new_here[owner] += 1
        shares[owner].extend(group)
    queues = [
        [pool.apply_async(_step_chunk_in_worker, (chunk,)) for chunk in _cut(share, size)]
        for pool, share in zip(pools, shares, strict=True)
    ]
    for turn in itertools.zip_longest(*queues):
        for outcome in turn:
            if outcome is not None:
                yield _outcome(outcome, processes)


def _outcome(outcome: AsyncResult[_ChunkOutcome], processes: list[psutil.Process]) -> _ChunkOutcome:
    """What a worker's chunk gave, once it is back.

    Raises:
        CheckerWorkerError: a worker died meanwhile. A pool replaces a dead
            worker, but the chunk it held is lost, and its memo tables with it.
    """
    while not outcome.ready():
        outcome.wait(_LIVENESS_INTERVAL)
        for process in processes:
            try:
                alive = process.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                raise CheckerWorkerError(
                    f"checker worker process {process.pid} died in the middle of the "
                    "search (killed: by the out-of-memory killer, if the machine ran out "
                    "of memory); its part of the search is lost. Set a lower max_memory "
                    "(--max-memory), so that the search stops before the machine runs "
                    "out, or bound it with max_states (--max-states)"
                )
    return outcome.get()


def _path(parents: _Parents, fp: int) -> list[Event]:
    """The events from the initial state to the state ``fp``."""
    events: list[Event] = []
    while True:
        parent, event = parents[fp]
        if event is None:
            break
        events.append(event_of(event))
        fp = parent
    events.reverse()
    return events


#: The search a forked worker process steps states with (see Search._levels).
_WORKER: Search | None = None


def _step_chunk_in_worker(chunk: list[tuple[WireTuple, int]]) -> _ChunkOutcome:
    """A forked worker's part of a level, from the wire and back: it remembers what
    it handed back, the main process knows the rest."""
    search = _WORKER
    assert search is not None, "a worker runs only in a fork of Search.run"
    wire = search._wire
    states = [(wire.global_of(state), fp) for state, fp in chunk]
    successors, simulated, stepped, edges, violation = search.step_chunk(
        states, search._handed_out, search._handed_out
    )
    sent: list[_Successor] = []
    for parent, event, (g, fp), twins in successors:
        assert isinstance(event, Event)  # stepped in this process: not on the wire
        sent.append((parent, wire.event(event), (wire.state(g), fp, hash(g.shared)), twins))
    return sent, simulated, stepped, edges, violation


@contextlib.contextmanager
def _without_collections() -> Iterator[None]:
    """Run the search without the cycle collector.

    A search allocates millions of small objects that live to its end (memo tables,
    fingerprints, parents) and makes almost no reference cycles, so the collector
    spends its time traversing them and finds next to nothing: a bounded 3-node
    search (40,000 states) took 28.9 s with the default thresholds, 21.2 s with
    rare collections, 19.3 s with none; a 3-node space with a crash (74,542
    states) 33.5 CPU-s with rare collections, 29.6 with none, its memory the same.
    Forked workers inherit it.

    On the way out, what the search made moves to the oldest generation at once
    (``freeze`` then ``unfreeze``): with the collector back, the next young
    collection would otherwise traverse all of it (a second, after a 3-node
    search of five seconds).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if was_enabled:
            gc.enable()
