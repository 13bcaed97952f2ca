"""Conformance: every lifecycle change a checker step makes is an edge of the model.

The stepping node's change is judged on its own guards, by the trigger its action
names; its peers change only through peer triggers (``declared_dead`` when a
sanitize removed them, ``admitted`` when its write took them in, and
``round_completed`` when the round completed or advanced under them). See
:mod:`rallypoint.spec.model.machine`.
"""

from __future__ import annotations

from ...core import CloseOp, NodeDesc, Operator, RendezvousState, Settings
from ...core import driver as core_driver
from ...core.actions import Action
from ...core.errors import InvalidTransitionError
from ..model.lifecycle import Lifecycle
from ..model.machine import Guards, LifecycleModel, View, lifecycle_state
from .state import Found, Global, node_of, slot_of

__all__ = ["Conformance"]

#: Peer edges have no guards; their checks pass this placeholder.
_NO_GUARDS = Guards(*([False] * len(Guards._fields)))


class Conformance:
    """The model of one search, and the lifecycle edges its steps exercised."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.model = LifecycleModel()
        self.edges: set[tuple[str, str, str]] = set()

    def model_state(self, g: Global, slot: int, shared: RendezvousState | None = None) -> Lifecycle:
        """The lifecycle state of ``slot`` in ``g`` (on ``shared``, if given)."""
        loc = g.locals[slot]
        return lifecycle_state(
            loc.phase, node_of(slot, loc.incarnation), g.shared if shared is None else shared
        )

    def expect(self, src: str, trigger: str, dst: str, guards: Guards, who: NodeDesc) -> None:
        """Record the edge ``src --trigger--> dst`` of ``who``, or raise.

        Raises:
            Found: the model has no such edge whose guards hold.
        """
        if not self.model.allows(src, trigger, dst, guards):
            raise Found(
                [
                    f"conformance: {who} went {src} --{trigger}--> {dst}, "
                    f"which the model does not allow (guards: {_true_guards(guards)})"
                ]
            )
        self.edges.add((src, trigger, dst))

    def local_event(self, g: Global, slot: int, trigger: str, dst: str) -> None:
        """A lifecycle event of the node's own (``crash``, ``join``) leads to ``dst``."""
        loc = g.locals[slot]
        node = node_of(slot, loc.incarnation)
        guards = Guards.of(View(node, g.shared, self.settings, 0.0))
        self.expect(self.model_state(g, slot), trigger, dst, guards, node)

    @staticmethod
    def slots_read(
        shared: RendezvousState,
        sanitized: RendezvousState,
        dead: frozenset[NodeDesc],
        written: RendezvousState,
        admitted: tuple[NodeDesc, ...],
        nodes: int,
    ) -> tuple[int, ...]:
        """The slots whose phase and pid :meth:`conform` of such a step (from
        ``shared``) reads besides the stepping node's: every slot when a batch
        admits nodes or the round completes or advances; otherwise, when it
        declares nodes dead, the slots of the members its sanitize dropped (only
        their lifecycle changes); none otherwise."""
        if admitted or _round_moved(sanitized, written):
            return tuple(range(nodes))
        if not dead:
            return ()
        return tuple(sorted({slot_of(node) for node in shared.members() - sanitized.members()}))

    def conform(
        self,
        g: Global,
        slot: int,
        sanitized: RendezvousState,
        dead: frozenset[NodeDesc],
        after: Global,
        action: Action | None,
        op: Operator,
        guards: Guards,
        admitted: tuple[NodeDesc, ...] = (),
    ) -> None:
        """Every node's lifecycle change in this step must be an edge of the model.

        ``action`` is what the node carried out (None: it only published removals);
        ``admitted``: the nodes its write admitted in a batch, after its own action
        and in this order (each is judged on the state just before its admission).

        Raises:
            Found: a change that no edge allows.
        """
        loc = g.locals[slot]
        node = node_of(slot, loc.incarnation)
        nodes = [node_of(i, other.incarnation) for i, other in enumerate(g.locals)]
        # Peers change lifecycle state only when removed (sanitize), admitted in a
        # batch, or when the round completes or advances; other nodes need no check.
        if dead:
            self._declared_dead(g, sanitized, nodes)
        middle = self.model_state(g, slot, sanitized)
        final = self.model_state(after, slot)
        # A batch: the states after the node's own action and after each admission.
        stages = self._admission_stages(node, sanitized, action, admitted, after.shared)
        own = final if not admitted else lifecycle_state(loc.phase, node, stages[0])
        self._own_change(node, middle, own, action, op, guards)
        moved = self._admissions(g, sanitized, after, nodes, admitted, stages)
        if own != final:
            self.expect(own, "round_completed", final, _NO_GUARDS, node)
        if _round_moved(sanitized, after.shared):
            for i in range(len(g.locals)):
                if i == slot or i in moved:
                    continue
                src = self.model_state(g, i, sanitized)
                dst = self.model_state(after, i)
                if src != dst:
                    self.expect(src, "round_completed", dst, _NO_GUARDS, nodes[i])

    def _declared_dead(self, g: Global, sanitized: RendezvousState, nodes: list[NodeDesc]) -> None:
        """Members the step's sanitize removed moved by ``declared_dead``."""
        members, kept = g.shared.members(), sanitized.members()
        for i in range(len(g.locals)):
            if nodes[i] in members and nodes[i] not in kept:
                src = self.model_state(g, i)
                dst = self.model_state(g, i, sanitized)
                if src != dst:
                    self.expect(src, "declared_dead", dst, _NO_GUARDS, nodes[i])

    def _own_change(
        self,
        node: NodeDesc,
        middle: Lifecycle,
        own: Lifecycle,
        action: Action | None,
        op: Operator,
        guards: Guards,
    ) -> None:
        """The stepping node moved ``middle -> own`` by its own action."""
        trigger = _trigger(action, op)
        if (action is not None and action.changes_state) or (trigger is not None and middle != own):
            if trigger is None:
                raise Found([f"conformance: {node} changed {middle} -> {own}"])
            self.expect(middle, trigger, own, guards, node)
        elif middle != own:
            done = "only publishing removals" if action is None else action.name
            raise Found([f"conformance: {node} went {middle} -> {own} on {done}"])

    def _admissions(
        self,
        g: Global,
        sanitized: RendezvousState,
        after: Global,
        nodes: list[NodeDesc],
        admitted: tuple[NodeDesc, ...],
        stages: list[RendezvousState],
    ) -> set[int]:
        """The nodes a batch admitted moved by ``admitted`` (each on the state just
        before its admission), then by ``round_completed`` to where the write left
        them. Returns the slots checked."""
        moved: set[int] = set()
        for k, other in enumerate(admitted):
            index = next((j for j, n in enumerate(nodes) if n == other), None)
            if index is None:
                continue  # an earlier incarnation's entry: nobody runs that node
            src = self.model_state(g, index, sanitized)
            dst = lifecycle_state(g.locals[index].phase, other, stages[k + 1])
            if src != dst:
                view = View(other, stages[k], self.settings, 0.0, None, None, None, g.intents)
                self.expect(src, "admitted", dst, Guards.of(view), other)
            moved.add(index)
            final = self.model_state(after, index)
            if final != dst:
                self.expect(dst, "round_completed", final, _NO_GUARDS, other)
        return moved

    def _admission_stages(
        self,
        node: NodeDesc,
        sanitized: RendezvousState,
        action: Action | None,
        admitted: tuple[NodeDesc, ...],
        written: RendezvousState,
    ) -> list[RendezvousState]:
        """For a batch write: the state after the writer's own action, then after
        each admission in turn (each node's action read off where the write put it).
        Empty when the write admits nobody else."""
        try:
            return core_driver.admission_stages(
                node, self.settings, sanitized, action, admitted, written
            )
        except InvalidTransitionError as exc:
            raise Found(
                [f"conformance: {node}'s batch is not a sequence of admissions: {exc}"]
            ) from None


def _round_moved(sanitized: RendezvousState, written: RendezvousState) -> bool:
    """The step completed the round or advanced it (every node may change state)."""
    return written.complete != sanitized.complete or written.round != sanitized.round


def _true_guards(guards: Guards) -> str:
    held = [name for name, value in guards._asdict().items() if value]
    return ", ".join(held) or "none"


def _trigger(action: Action | None, op: Operator) -> str | None:
    """The model trigger of the stepping node's action (None: no trigger)."""
    if action is None:
        return None
    if action.changes_state:
        return action.value
    if action is Action.FINISH:
        return "closed" if isinstance(op, CloseOp) else "finish"
    if action in (Action.ERROR_CLOSED, Action.ERROR_GRACEFUL_EXIT):
        return "closed"
    if action is Action.ERROR_TIMEOUT:
        return "timeout"
    return None
