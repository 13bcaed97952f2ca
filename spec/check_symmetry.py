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

from ..core import NodeDesc, RendezvousState
from .check_state import CheckConfig, Global, Local, node_of
from .lifecycle import TERMINAL_PHASES, Phase

__all__ = ["CACHE_LIMIT", "Instances", "Symmetry", "relabel"]

#: Entries a memo of the search keeps at most (a bound on memory, not on the search).
CACHE_LIMIT = 500_000
#: The phase a node in any terminal phase is stored in (see Symmetry._normal_locals).
_FINISHED = Phase.CLOSED


class Instances:
    """The one instance of each equal shared state a search hands around.

    States come from many places as equal copies: the same write made under other
    timers, a normal form reached again, a state back from a worker process. Memo
    keys and successors made of one instance compare by identity instead of field
    by field (comparing equal copies was a fifth of a 3-node search's time).
    """

    def __init__(self) -> None:
        self._table: dict[RendezvousState, RendezvousState] = {}

    def one(self, state: RendezvousState) -> RendezvousState:
        """The instance of ``state`` kept (``state`` itself, the first time)."""
        if len(self._table) >= CACHE_LIMIT:
            self._table.clear()
        return self._table.setdefault(state, state)


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
    return Global(shared, tuple(locals_), g.crashes, intents, g.failures, g.exclusions)


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
    if s.excluded:
        shared = shared.evolve(excluded={lab(n): u for n, u in s.excluded.items()})
    return shared


def _slot_key(loc: Local) -> tuple[object, ...]:
    """A slot's local state as sortable primitives (no deadline sorts first)."""
    return (loc.incarnation, loc.phase, loc.op or "", loc.deadline or 0, loc.round_ended)


class Symmetry:
    """Normal forms and canonical representatives of the states of one search."""

    def __init__(self, config: CheckConfig, instances: Instances | None = None) -> None:
        self.config = config
        #: the one instance of each shared state (shared with the steps' own)
        self.instances = Instances() if instances is None else instances
        #: id of a written state -> (the state, the round shift, its normal form)
        self._normal_forms: dict[int, tuple[RendezvousState, int, RendezvousState]] = {}
        #: state -> (relabelling, fingerprint); (shared, intents, relabelling) -> key
        self._fingerprints: dict[Global, tuple[tuple[int, ...], int]] = {}
        self._shared_keys: dict[tuple[object, ...], tuple[object, ...]] = {}
        #: id of a state -> (the state, the nodes it names); (state, renames) -> renamed
        self._names: dict[int, tuple[RendezvousState, frozenset[NodeDesc]]] = {}
        self._renames: dict[tuple[object, ...], RendezvousState] = {}
        #: a successor as a step made it -> (its normal form's relabelling, fingerprint)
        self._places: dict[Global, tuple[Global, tuple[int, ...], int]] = {}
        #: (shared state, local states, intent log) -> their normal forms
        self._normal_local_forms: dict[
            tuple[object, ...],
            tuple[RendezvousState, tuple[Local, ...], frozenset[NodeDesc]],
        ] = {}

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
        """
        shift = g.shared.round if shift_rounds and self.config.max_round is None else 0
        shared = self._normal_shared(g.shared, shift)
        locals_, intents = g.locals, g.intents
        for loc in locals_:
            if loc.incarnation or loc.phase in TERMINAL_PHASES:
                shared, locals_, intents = self._normal_locals(shared, locals_, intents)
                break
        return Global(shared, locals_, g.crashes, intents, g.failures, g.exclusions)

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
        key = (shared, locals_, intents)
        known = self._normal_local_forms.get(key)
        if known is not None:
            return known
        named = self._named(shared) | intents
        renames: dict[NodeDesc, NodeDesc] = {}
        normal = list(locals_)
        for slot, loc in enumerate(locals_):
            if loc.phase in TERMINAL_PHASES and (loc.phase is not _FINISHED or loc.op):
                loc = normal[slot] = Local(loc.incarnation, _FINISHED, None, None)
            incarnation = loc.incarnation
            if not incarnation or any(node_of(slot, k) in named for k in range(incarnation)):
                continue
            normal[slot] = loc._replace(incarnation=0)
            node = node_of(slot, incarnation)
            if node in named:
                renames[node] = node_of(slot, 0)
        normal_shared, normal_intents = shared, intents
        if renames:
            normal_shared = self._renamed(shared, tuple(sorted(renames.items())))
            normal_intents = frozenset(renames.get(n, n) for n in intents)
        if len(self._normal_local_forms) >= CACHE_LIMIT:
            self._normal_local_forms.clear()
        known = self._normal_local_forms[key] = (normal_shared, tuple(normal), normal_intents)
        return known

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
        )
        if len(self._names) >= CACHE_LIMIT:
            self._names.clear()
        self._names[id(state)] = (state, named)
        return named

    def _renamed(
        self, state: RendezvousState, renames: tuple[tuple[NodeDesc, NodeDesc], ...]
    ) -> RendezvousState:
        key = (state, renames)
        known = self._renames.get(key)
        if known is None:
            if len(self._renames) >= CACHE_LIMIT:
                self._renames.clear()
            renamed = _rename_nodes(state, dict(renames).get)
            known = self._renames[key] = self.instances.one(renamed)
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
        if len(self._normal_forms) >= CACHE_LIMIT:
            self._normal_forms.clear()
        normal = self.instances.one(normal)
        self._normal_forms[id(state)] = (state, shift, normal)
        return normal

    def fingerprint(self, g: Global) -> tuple[tuple[int, ...], int]:
        """The relabelling to ``g``'s representative and the representative's
        64-bit fingerprint (memoized: most successors were reached before)."""
        known = self._fingerprints.get(g)
        if known is None:
            if len(self._fingerprints) >= CACHE_LIMIT:
                self._fingerprints.clear()
            known = self._fingerprints[g] = self._least(g)
        return known

    def place(self, g: Global) -> tuple[Global, tuple[int, ...], int]:
        """:meth:`normalize`, then :meth:`fingerprint`: ``g``'s normal form, the
        relabelling to its representative and the representative's fingerprint.

        Memoized on ``g`` itself: a state's successors are made from memoized steps,
        so most of them were made before, as equal copies (in the 3-node space, 2.55
        million successors are 578 thousand distinct ones), and one lookup replaces
        a lookup in each memo of the normal forms and of the fingerprints."""
        known = self._places.get(g)
        if known is None:
            normal = self.normalize(g)
            perm, fp = self.fingerprint(normal)
            if len(self._places) >= CACHE_LIMIT:
                self._places.clear()
            known = self._places[g] = (normal, perm, fp)
        return known

    def canonical(self, g: Global) -> tuple[Global, tuple[int, ...], int]:
        """The stored representative of ``g``, the permutation used, its fingerprint."""
        perm, fp = self.fingerprint(g)
        return relabel(g, perm), perm, fp

    def _least(self, g: Global) -> tuple[tuple[int, ...], int]:
        best_key: tuple[object, ...] | None = None
        best_perm: tuple[int, ...] = tuple(range(len(g.locals)))
        for perm in self._permutations(g):
            key = self._key(g, perm)
            if best_key is None or key < best_key:
                best_key, best_perm = key, perm
        return best_perm, hash(best_key)

    def _permutations(self, g: Global) -> Iterator[tuple[int, ...]]:
        """The relabellings that order slots by their label-free facts (every
        order of the slots those facts do not tell apart)."""
        n = len(g.locals)
        if not self.config.symmetry:
            yield tuple(range(n))
            return
        sigs = [self._signature(g, i) for i in range(n)]
        order = sorted(range(n), key=lambda i: sigs[i])
        groups = [list(grp) for _, grp in itertools.groupby(order, key=lambda i: sigs[i])]
        for choice in itertools.product(*(itertools.permutations(grp) for grp in groups)):
            ordered = [i for grp in choice for i in grp]
            perm = [0] * n
            for new, old in enumerate(ordered):
                perm[old] = new
            yield tuple(perm)

    @staticmethod
    def _signature(g: Global, slot: int) -> tuple[object, ...]:
        """Label-free facts about a slot, to order slots before breaking ties."""
        loc = g.locals[slot]
        node = node_of(slot, loc.incarnation)
        s = g.shared
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
            *_slot_key(loc),
            role,
            s.last_ranks.get(node, -1),
            s.heartbeats.get(node, 0),
            node in g.intents,
            s.excluded.get(node, 0),
        )

    def _key(self, g: Global, perm: tuple[int, ...]) -> tuple[object, ...]:
        """The state as sortable primitives, slots relabelled by ``perm``."""

        def lab(n: NodeDesc) -> tuple[int, int]:
            return (perm[int(n.addr[1:])], n.pid)

        s = g.shared
        memo = (s, g.intents, perm)
        shared = self._shared_keys.get(memo)
        if shared is None:
            if len(self._shared_keys) >= CACHE_LIMIT:
                self._shared_keys.clear()
            shared = self._shared_keys[memo] = _shared_key(s, g.intents, lab)
        slots: list[tuple[object, ...]] = [()] * len(g.locals)
        for i, loc in enumerate(g.locals):
            slots[perm[i]] = _slot_key(loc)
        return (shared, tuple(slots), g.crashes, g.failures, g.exclusions)


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
    )
