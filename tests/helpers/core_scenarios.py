"""Builders shared by the core tests: nodes, settings, and states reached by the
protocol itself (never hand-assembled), so every state a test starts from is one the
real core can produce."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import strategies as st

from rallypoint.core import (
    Action,
    Context,
    ExitOp,
    JoinOp,
    KeepAliveOp,
    NodeDesc,
    Observations,
    RendezvousState,
    Settings,
    apply,
    observe,
    sanitize,
)

FAR = 1e9  # a deadline that never passes


def node(i: int) -> NodeDesc:
    return NodeDesc(f"host{i}", 100 + i, 0)


def settings(min_nodes: int = 2, max_nodes: int = 3, **kw: object) -> Settings:
    base: dict[str, object] = {
        "last_call_timeout": 10.0,
        "keep_alive_interval": 1.0,
        "keep_alive_max_attempt": 3,
    }
    base.update(kw)
    return Settings("job", min_nodes, max_nodes, **base)  # type: ignore[arg-type]


def ctx(
    n: NodeDesc,
    state: RendezvousState,
    s: Settings,
    now: float = 0.0,
    obs: Observations | None = None,
) -> Context:
    """A context whose observations are up to date with ``state`` at ``now``."""
    return Context(n, state, s, now, observe(obs or Observations(), state, now))


def step(state: RendezvousState, n: NodeDesc, action: Action, s: Settings) -> RendezvousState:
    return apply(state, action, ctx(n, state, s))


def joined(nodes: Iterable[NodeDesc], s: Settings, state: RendezvousState | None = None):
    """Each node in turn adds itself to the participants (as the join operator would)."""
    state = state or RendezvousState()
    for n in nodes:
        state = step(state, n, Action.ADD_TO_PARTICIPANTS, s)
    return state


def completed(count: int, s: Settings) -> RendezvousState:
    """A complete round with ``count`` participants (node(0)..node(count-1))."""
    state = joined([node(i) for i in range(count)], s)
    if not state.complete:
        state = step(state, node(0), Action.MARK_RENDEZVOUS_COMPLETE, s)
    return state


@st.composite
def reachable_runs(draw: st.DrawFn, max_nodes: int = 4, max_steps: int = 40):
    """(settings, [states...]): a random run of the real protocol from the empty state.

    Each step picks a node and an operator, asks the core for the action at a drawn
    local time, and applies it if it changes the state. Times only move forward and
    every node keeps its own observations, so liveness expiry happens too.
    """
    lo = draw(st.integers(1, max_nodes))
    hi = draw(st.integers(lo, max_nodes))
    s = settings(
        lo,
        hi,
        last_call_timeout=2.0,
        keep_alive_interval=1.0,
        keep_alive_max_attempt=2,
        stable_ranks=draw(st.booleans()),
    )
    nodes = [node(i) for i in range(max_nodes + 1)]
    observations = {n: Observations() for n in nodes}
    state = RendezvousState()
    states = [state]
    now = 0.0
    for _ in range(draw(st.integers(0, max_steps))):
        now += draw(st.sampled_from([0.0, 0.5, 1.5, 3.0]))
        n = draw(st.sampled_from(nodes))
        op = draw(st.sampled_from([JoinOp(), JoinOp(), ExitOp(), KeepAliveOp(), "close"]))
        obs = observe(observations[n], state, now)
        view, _dead = sanitize(state, obs, s, now)
        c = Context(n, view, s, now, obs)
        if op == "close":
            if draw(st.integers(0, 9)) != 0:  # closing ends the run: make it rare
                continue
            action = Action.MARK_RENDEZVOUS_CLOSED
        else:
            action = op(c, FAR)
        if action.changes_state:
            state = apply(view, action, c)
            states.append(state)
        observations[n] = observe(obs, state, now)
    return s, states
