"""What the checker forgets of a state: normal forms, symmetry and fingerprints.

Two states that no future step can tell apart are stored as one:

* :meth:`Symmetry.normalize` renumbers what only equalities matter of (heartbeat
  counters, last-call armings, the phase number, the intent cursor) and, through
  the round abstraction, the round;
* :meth:`Symmetry.fingerprint` picks the least of a state's relabellings by node
  permutation (nodes are interchangeable) and hashes it into the 64-bit
  fingerprint the search keeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from ...core import NodeDesc, RendezvousState
from ...core.deprecation import moved_names
from ..model.lifecycle import TERMINAL_PHASES, Phase
from ..model.machine import built
from .memo import Memo
from .state import CheckConfig, Deadline, Global, Local, node_of

__all__ = ["Instances", "Symmetry", "relabel"]

__getattr__ = moved_names(__name__, {"CACHE_LIMIT": f"{__package__}.memo:CACHE_LIMIT"})
#: The phase a node in any terminal phase is stored in (see Symmetry._normal_locals).
_FINISHED = Phase.CLOSED
#: The intent log a closed rendezvous is stored with (see Symmetry._normal_intents).
_NO_INTENTS: frozenset[NodeDesc] = frozenset()


class Instances:
    """The one instance of each equal shared state a search hands around.

    States come from many places as equal copies: the same write made under other
    timers, a normal form reached again, a state back from a worker process. Memo
    keys and successors made of one instance compare by identity instead of field
    by field (comparing equal copies was a fifth of a 3-node search's time).
    """

    def __init__(self) -> None:
        self._table: Memo[RendezvousState, RendezvousState] = Memo()

    def one(self, state: RendezvousState) -> RendezvousState:
        """The instance of ``state`` kept (``state`` itself, the first time)."""
        known = self._table.get(state)
        return known if known is not None else self._table.put(state, state)


def relabel(g: Global, perm: tuple[int, ...]) -> Global:
    """``g`` with slot ``i`` moved to ``perm[i]`` and every node renamed with it."""
    if perm == tuple(range(len(perm))):
        return g

    def lab(n: NodeDesc) -> NodeDesc:
        return NodeDesc(f"n{perm[int(n.addr[1:])]}", n.pid, n.local_id)

    shared = _rename_nodes(g.shared, lab)
    locals_: list[Local] = [g.locals[0]] * len(g.locals)
    for i, loc in enumerate(g.locals):
        locals_[perm[i]] = loc
    intents = frozenset(map(lab, g.intents))
    return built(Global, (shared, tuple(locals_), g.crashes, intents, g.failures, g.exclusions))


def _rename_nodes(
    s: RendezvousState, rename: Callable[[NodeDesc], NodeDesc | None]
) -> RendezvousState:
    """``s`` with every node ``n`` named ``rename(n)`` (None: left as it is)."""

    def lab(n: NodeDesc) -> NodeDesc:
        return rename(n) or n

    shared = s.evolve(
        participants={lab(n): r for n, r in s.participants.items()},
        wait_list={lab(n) for n in s.wait_list},
        redundancy_list={lab(n) for n in s.redundancy_list},
        heartbeats={lab(n): c for n, c in s.heartbeats.items()},
        last_ranks={lab(n): r for n, r in s.last_ranks.items()},
    )
    if s.returning:
        shared = shared.evolve(returning={lab(n) for n in s.returning})
    if s.excluded:
        shared = shared.evolve(excluded={lab(n): u for n, u in s.excluded.items()})
    return shared


def _slot_key(loc: Local) -> tuple[object, ...]:
    """A slot's local state as sortable primitives (no deadline sorts first)."""
    return (loc.incarnation, loc.phase, loc.op or "", loc.deadline or 0, loc.round_ended)


#: A successor's normal form, the relabelling to its representative, its fingerprint.
_Placed = tuple[Global, tuple[int, ...], int]
#: What a fingerprint computes of a shared state and an intent log alone: (the
#: state, each slot's incarnation -> the label-free facts the two tell of each
#: slot's node, a relabelling -> the shared part of the key). The memo of these is
#: keyed on the state's id; the record keeps the state, and a hit is checked with
#: ``is`` (an id is reused once its object is gone).
_Record = tuple[
    RendezvousState,
    dict[tuple[int, ...], tuple[tuple[object, ...], ...]],
    dict[tuple[int, ...], tuple[object, ...]],
]


class Symmetry:
    """Normal forms and canonical representatives of the states of one search."""

    def __init__(self, config: CheckConfig, instances: Instances | None = None) -> None:
        self.config = config
        #: the one instance of each shared state (shared with the steps' own)
        self.instances = Instances() if instances is None else instances
        #: the deadline's values in the order time moves them, when states with
        #: earlier ones subsume (see earlier_twins); none otherwise
        self._deadlines = Deadline.in_time_order(config.settings()) if config.subsumption else ()
        #: id of a written state -> (the state, the round shift, its normal form)
        self._normal_forms: Memo[int, tuple[RendezvousState, int, RendezvousState]] = Memo()
        #: state -> (relabelling, fingerprint)
        self._fingerprints: Memo[Global, tuple[tuple[int, ...], int]] = Memo()
        #: (id of a shared state, intent log) -> the memo of what a fingerprint
        #: computes of the two alone (see _Record)
        self._records: Memo[tuple[int, frozenset[NodeDesc]], _Record] = Memo()
        #: (see _locals) local states of every slot -> (their one instance, their
        #: slot keys, their incarnations); a local state -> its one instance
        self._local_keys: Memo[
            tuple[Local, ...],
            tuple[tuple[Local, ...], tuple[tuple[object, ...], ...], tuple[int, ...]],
        ] = Memo()
        self._one_local: Memo[Local, Local] = Memo()
        #: id of a state -> (the state, the nodes it names); (state, renames) -> renamed
        self._names: Memo[int, tuple[RendezvousState, frozenset[NodeDesc]]] = Memo()
        self._renames: Memo[tuple[object, ...], RendezvousState] = Memo()
        #: id of a shared state -> (the state, the rest of a successor with that
        #: shared state, as a step made it -> (its normal form, the relabelling to
        #: the representative, the fingerprint)), each successor counted
        self._places: Memo[int, tuple[RendezvousState, dict[tuple[object, ...], _Placed]]] = Memo()
        #: (id of a shared state, local states, intent log) -> (the state, their
        #: normal forms)
        self._normal_local_forms: Memo[
            tuple[int, tuple[Local, ...], frozenset[NodeDesc]],
            tuple[
                RendezvousState,
                tuple[RendezvousState, tuple[Local, ...], frozenset[NodeDesc]],
            ],
        ] = Memo()

    def normalize(self, g: Global, shift_rounds: bool = True) -> Global:
        """Forget what no future step can tell apart.

        * Heartbeat counter values and last-call arming numbers (the steps choose the
          ages of sightings afresh, see :meth:`Steps.expand`), and the phase number:
          only whether a write publishes a new phase matters (a waiter's Wait ends
          on any phase above the one it read), and the step tells that.
        * The intent log: only its entries past ``intent_cursor`` (joiners that
          announced and were not admitted yet) matter to any decision, so a state
          keeps them as a set (``Global.intents``, computed by the step) and the
          cursor as 0. A new round's log starts empty.
        * The round number (the round abstraction, when ``max_round`` is None): the
          core only increments rounds and compares them for equality, so a state and
          its copy with every round number shifted step alike. Rounds are renumbered
          to start at 0, which makes every round's states the same finite set.
          The rounds the state holds besides its own move with it: an exclusion's
          end, and the round the restarts are counted through. The core compares
          these with the round and adds to it, so they step alike shifted too;
          the latter is clamped at 0 (it never decreases and is compared only with
          rounds from the current one on: any value up to the round is alike).
          A trace keeps concrete rounds (``shift_rounds=False``).
        * The intent log of a closed rendezvous (see :meth:`_normal_intents`).
        """
        shift = g.shared.round if shift_rounds and self.config.max_round is None else 0
        shared = self._normal_shared(g.shared, shift)
        # (the log first: a crashed node named only there is then forgotten too)
        locals_, intents = g.locals, self._normal_intents(shared, g.intents)
        for loc in locals_:
            if loc.incarnation or loc.phase in TERMINAL_PHASES:
                shared, locals_, intents = self._normal_locals(shared, locals_, intents)
                break
        locals_ = self._locals(locals_)[0]
        if shared is g.shared and locals_ is g.locals and intents is g.intents:
            return g
        return built(Global, (shared, locals_, g.crashes, intents, g.failures, g.exclusions))

    def _normal_intents(
        self, shared: RendezvousState, intents: frozenset[NodeDesc]
    ) -> frozenset[NodeDesc]:
        """``intents``, or none once ``shared`` is closed (docs/spec.md, "A closed
        rendezvous's intent log").

        Only an admission reads the log or whether the node announced itself in
        it (the driver's join through the log, and the checks of a write that
        admits), and nothing is admitted to a closed rendezvous: the join table
        ends every join on a closed state before its admissions, and no other
        operator admits. A write on a closed state carries the log on unchanged
        (or starts a new round's, empty), and closed never reverts. The step
        checks its half of this (:meth:`CoreSteps.step`): a decision on a closed
        state that reads the log or announces is a violation, not a state."""
        if intents and shared.closed:
            return _NO_INTENTS
        return intents

    def _normal_locals(
        self, shared: RendezvousState, locals_: tuple[Local, ...], intents: frozenset[NodeDesc]
    ) -> tuple[RendezvousState, tuple[Local, ...], frozenset[NodeDesc]]:
        """Forget what no future step reads of a slot's incarnation and of a
        finished node (docs/spec.md, "Finished nodes and forgotten crashes").

        * A node in a terminal phase never steps again, and every check maps
          each terminal phase to a lifecycle state that never changes: every
          terminal phase is stored as ``closed``.
        * A slot's incarnation only names its node. Once no earlier incarnation
          of the slot is named anywhere (the crashed node's entries are gone),
          the slot is stored as incarnation 0, its node renamed in the shared
          state and the intent log: the renaming keeps every order the core
          compares (within the slot's address only one node is named).
        """
        key = (id(shared), locals_, intents)
        known = self._normal_local_forms.get(key)
        if known is not None and known[0] is shared:
            return known[1]
        named = self._named(shared)
        renames: dict[NodeDesc, NodeDesc] = {}
        normal: list[Local] | None = None
        for slot, loc in enumerate(locals_):
            phase = loc.phase
            if phase in TERMINAL_PHASES and (phase is not _FINISHED or loc.op):
                loc = Local(loc.incarnation, _FINISHED, None, None)
                if normal is None:
                    normal = list(locals_)
                normal[slot] = loc
            incarnation = loc.incarnation
            if not incarnation:
                continue
            for k in range(incarnation):
                earlier = node_of(slot, k)
                if earlier in named or earlier in intents:
                    break
            else:
                if normal is None:
                    normal = list(locals_)
                normal[slot] = Local(0, loc.phase, loc.op, loc.deadline, loc.round_ended)
                node = node_of(slot, incarnation)
                if node in named or node in intents:
                    renames[node] = node_of(slot, 0)
        forms = (shared, locals_, intents)
        if renames:
            forms = (
                self._renamed(shared, tuple(sorted(renames.items()))),
                locals_,
                frozenset(renames.get(n, n) for n in intents),
            )
        if normal is not None:
            forms = (forms[0], tuple(normal), forms[2])
        self._normal_local_forms.put(key, (shared, forms))
        return forms

    def _named(self, state: RendezvousState) -> frozenset[NodeDesc]:
        """Every node ``state`` names (members, heartbeats, ranks, exclusions)."""
        known = self._names.get(id(state))
        if known is not None and known[0] is state:
            return known[1]
        named = (
            state.members()
            | frozenset(state.heartbeats)
            | frozenset(state.last_ranks)
            | frozenset(state.excluded)
            | state.returning
        )
        self._names.put(id(state), (state, named))
        return named

    def _renamed(
        self, state: RendezvousState, renames: tuple[tuple[NodeDesc, NodeDesc], ...]
    ) -> RendezvousState:
        key = (state, renames)
        known = self._renames.get(key)
        if known is None:
            renamed = _rename_nodes(state, dict(renames).get)
            known = self._renames.put(key, self.instances.one(renamed))
        return known

    def intern(self, g: Global) -> Global:
        """``g`` with its shared state replaced by the one equal instance this
        search keeps of it: memo tables are keyed on shared states, and a lookup
        with the very key object skips comparing equal copies field by field
        (states come back from relabelling and from worker processes as copies)."""
        shared = self.instances.one(g.shared)
        return g if shared is g.shared else g._replace(shared=shared)

    def _normal_shared(self, state: RendezvousState, shift: int) -> RendezvousState:
        # Core steps are memoized, so the same written state comes back many times:
        # remember its normal form by identity (the entry keeps it alive).
        known = self._normal_forms.get(id(state))
        if known is not None and known[0] is state and known[1] == shift:
            return known[2]
        normal = state
        if (
            shift
            or any(c != 1 for c in state.heartbeats.values())
            or state.last_call_seq != 1
            or state.last_call not in (None, 1)
            or state.heartbeat_seq != 1
            or state.phase
            or state.intent_cursor
        ):
            normal = state.evolve(
                round=state.round - shift,
                heartbeats=dict.fromkeys(state.heartbeats, 1),
                heartbeat_seq=1,
                last_call=None if state.last_call is None else 1,
                last_call_seq=1,
                phase=0,
                intent_cursor=0,
            )
            if shift and (state.charged_through or state.excluded):
                normal = normal.evolve(
                    charged_through=max(0, state.charged_through - shift),
                    excluded={n: until - shift for n, until in state.excluded.items()},
                )
        normal = self.instances.one(normal)
        self._normal_forms.put(id(state), (state, shift, normal))
        return normal

    def fingerprint(self, g: Global) -> tuple[tuple[int, ...], int]:
        """The relabelling to ``g``'s representative and the representative's
        64-bit fingerprint (memoized: most successors were reached before)."""
        known = self._fingerprints.get(g)
        if known is None:
            known = self._fingerprints.put(g, self._least(g))
        return known

    def place(self, g: Global) -> tuple[Global, tuple[int, ...], int]:
        """:meth:`normalize`, then :meth:`fingerprint`: ``g``'s normal form, the
        relabelling to its representative and the representative's fingerprint.

        Memoized on ``g`` itself: a state's successors are made from memoized steps,
        so most of them were made before, as equal copies (in the 3-node space, 2.55
        million successors are 578 thousand distinct ones), and one lookup replaces
        a lookup in each memo of the normal forms and of the fingerprints. The memo
        is kept per shared state, by its id (shared states are interned): a lookup
        hashes the rest of ``g`` only, in a table of the successors with that shared
        state."""
        s = g.shared
        places = self._places
        by_shared = places.get(id(s))
        rest = g[1:]
        known = by_shared[1].get(rest) if by_shared is not None and by_shared[0] is s else None
        if known is None:
            normal = self.normalize(g)
            perm, fp = self.fingerprint(normal)
            places.count()  # (which may forget the table: look again)
            by_shared = places.get(id(s))
            if by_shared is None or by_shared[0] is not s:
                by_shared = places[id(s)] = (s, {})
            known = by_shared[1][rest] = (normal, perm, fp)
        return known

    def earlier_twins(self, g: Global) -> Iterator[int]:
        """The fingerprints of every other state that is ``g`` (a normal form,
        see :meth:`place`) with some deadlines earlier: each deadline later than
        the earliest value at any value from the earliest to its own (none
        without ``CheckConfig.subsumption``). Made one at a time, the one with
        every such deadline at the earliest value first.

        Each such state simulates ``g`` (docs/spec.md, "Subsumed states"). The
        set is the same for every relabelling of ``g``: it does not depend on
        which of its copies a step made."""
        deadlines = self._deadlines
        if not deadlines:
            return
        locals_ = g.locals
        late = [i for i, loc in enumerate(locals_) if loc.deadline not in (None, deadlines[0])]
        if not late:
            return
        earlier = [deadlines[: deadlines.index(locals_[i].deadline) + 1] for i in late]
        for chosen in itertools.product(*earlier):
            if all(d is locals_[i].deadline for d, i in zip(chosen, late, strict=True)):
                continue  # g itself
            moved = list(locals_)
            for d, i in zip(chosen, late, strict=True):
                loc = moved[i]
                moved[i] = built(Local, (loc.incarnation, loc.phase, loc.op, d, loc.round_ended))
            twin = (g.shared, tuple(moved), g.crashes, g.intents, g.failures, g.exclusions)
            # (not memoized: most twins are never reached, and they would crowd
            # the successors out of the memo of places)
            yield self._least(self.normalize(built(Global, twin)))[1]

    def canonical(self, g: Global) -> tuple[Global, tuple[int, ...], int]:
        """The stored representative of ``g``, the permutation used, its fingerprint."""
        perm, fp = self.fingerprint(g)
        return relabel(g, perm), perm, fp

    def _least(self, g: Global) -> tuple[tuple[int, ...], int]:
        """The relabelling whose :meth:`_key` is least, and the hash of that key,
        among those that order slots by their label-free facts (every order of the
        slots those facts do not tell apart; the first such relabelling, if
        several keys tie)."""
        _, slots, incarnations = self._locals(g.locals)
        record = self._record(g.shared, g.intents)
        n = len(slots)
        if not self.config.symmetry:
            perm = tuple(range(n))
            return perm, hash(self._key(g, perm, slots, record))
        sigs = self._signatures(g, slots, incarnations, record)
        order = sorted(range(n), key=sigs.__getitem__)
        previous = sigs[order[0]]
        for i in order[1:]:
            sig = sigs[i]
            if sig == previous:
                break  # slots the signatures do not tell apart: try every order of them
            previous = sig
        else:
            # the usual case: one order, hence one relabelling and one key
            perm = tuple(sorted(range(n), key=order.__getitem__))
            return perm, hash(self._key(g, perm, slots, record))
        best_key: tuple[object, ...] | None = None
        best_perm: tuple[int, ...] = tuple(range(n))
        for perm in _orders(order, sigs):
            key = self._key(g, perm, slots, record)
            if best_key is None or key < best_key:
                best_key, best_perm = key, perm
        return best_perm, hash(best_key)

    def _locals(
        self, locals_: tuple[Local, ...]
    ) -> tuple[tuple[Local, ...], tuple[tuple[object, ...], ...], tuple[int, ...]]:
        """The one instance of ``locals_`` and of each of its local states, each
        slot's :func:`_slot_key`, and each slot's incarnation (memoized: a search's
        states hold a few thousand different tuples of a few dozen local states).

        Normal forms hold these instances, and so do the states stored and the
        successors made of them: memo lookups keyed on them compare local states
        by identity, without reading them."""
        known = self._local_keys.get(locals_)
        if known is None:
            # (the local states: a few dozen in a search, never forgotten by count)
            one = self._one_local
            instance = tuple(one.setdefault(loc, loc) for loc in locals_)
            known = self._local_keys.put(
                locals_,
                (
                    instance,
                    tuple(map(_slot_key, locals_)),
                    tuple(loc.incarnation for loc in locals_),
                ),
            )
        return known

    def _record(self, s: RendezvousState, intents: frozenset[NodeDesc]) -> _Record:
        """The memo of what :meth:`_signatures` and :meth:`_key` compute of ``s``
        and ``intents`` alone."""
        memo = (id(s), intents)
        record = self._records.get(memo)
        if record is None or record[0] is not s:
            record = self._records.put(memo, (s, {}, {}))
        return record

    @staticmethod
    def _signatures(
        g: Global,
        slots: tuple[tuple[object, ...], ...],
        incarnations: tuple[int, ...],
        record: _Record,
    ) -> list[tuple[object, ...]]:
        """Label-free facts about each slot, to order slots before breaking ties:
        its local state (``slots``) and what the shared state and the intent log
        say of its node (``incarnations``: each slot's; memoized in ``record``).
        A signature is the pair of both; it orders as their concatenation would
        (slot keys have one length)."""
        by_incarnations = record[1]
        facts = by_incarnations.get(incarnations)
        if facts is None:
            s, intents = g.shared, g.intents
            facts = by_incarnations[incarnations] = tuple(
                _node_facts(s, intents, node_of(slot, k)) for slot, k in enumerate(incarnations)
            )
        return list(zip(slots, facts, strict=True))

    @staticmethod
    def _key(
        g: Global,
        perm: tuple[int, ...],
        slots: tuple[tuple[object, ...], ...],
        record: _Record,
    ) -> tuple[object, ...]:
        """The state as sortable primitives, slots relabelled by ``perm``
        (``slots``: each slot's :func:`_slot_key`; the shared part is memoized
        in ``record``, the memo of ``g``'s shared state and intent log)."""
        by_perm = record[2]
        shared = by_perm.get(perm)
        if shared is None:

            def lab(n: NodeDesc) -> tuple[int, int]:
                return (perm[int(n.addr[1:])], n.pid)

            shared = by_perm[perm] = _shared_key(g.shared, g.intents, lab)
        relabelled: list[tuple[object, ...]] = [()] * len(slots)
        for i, slot in enumerate(slots):
            relabelled[perm[i]] = slot
        return (shared, tuple(relabelled), g.crashes, g.failures, g.exclusions)


def _orders(order: list[int], sigs: list[tuple[object, ...]]) -> Iterator[tuple[int, ...]]:
    """The relabellings that put slots in ``order`` (sorted by ``sigs``), in
    every order of the slots of equal signatures."""
    n = len(order)
    groups = [list(grp) for _, grp in itertools.groupby(order, key=sigs.__getitem__)]
    for choice in itertools.product(*(itertools.permutations(grp) for grp in groups)):
        ordered = [i for grp in choice for i in grp]
        perm = [0] * n
        for new, old in enumerate(ordered):
            perm[old] = new
        yield tuple(perm)


def _node_facts(
    s: RendezvousState, intents: frozenset[NodeDesc], node: NodeDesc
) -> tuple[object, ...]:
    """Label-free facts ``s`` and ``intents`` tell about ``node``."""
    role = (
        ("p", s.participants[node])
        if node in s.participants
        else ("w", 0)
        if node in s.wait_list
        else ("r", 0)
        if node in s.redundancy_list
        else ("-", 0)
    )
    return (
        role,
        s.last_ranks.get(node, -1),
        s.heartbeats.get(node, 0),
        node in intents,
        s.excluded.get(node, 0),
        node in s.returning,
    )


def _shared_key(
    s: RendezvousState,
    intents: frozenset[NodeDesc],
    lab: Callable[[NodeDesc], tuple[int, int]],
) -> tuple[object, ...]:
    return (
        s.round,
        s.complete,
        s.closed,
        s.world_size,
        tuple(sorted((lab(n), r) for n, r in s.participants.items())),
        tuple(sorted(lab(n) for n in s.wait_list)),
        tuple(sorted(lab(n) for n in s.redundancy_list)),
        tuple(sorted((lab(n), c) for n, c in s.heartbeats.items())),
        s.last_call or 0,
        tuple(sorted((lab(n), r) for n, r in s.last_ranks.items())),
        tuple(sorted(lab(n) for n in intents)),
        s.restarts,
        s.charged_through,
        tuple(sorted((lab(n), u) for n, u in s.excluded.items())),
        tuple(sorted(lab(n) for n in s.returning)),
        s.regroup,
    )
