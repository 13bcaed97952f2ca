"""The pure rendezvous core: no sockets, threads, waiting, randomness or clock reads.

Embed it in any scheduler or simulation: keep a :class:`RendezvousState` somewhere
all nodes can compare-and-set, and drive each node with this loop::

    obs = observe(obs, state, now)                  # what this node saw, when
    state, dead = sanitize(state, obs, settings, now)
    ctx = Context(node, state, settings, now, obs)
    action = JoinOp()(ctx, deadline)                # or ExitOp, CloseOp, KeepAliveOp
    if action.is_terminal: stop (FINISH) or raise (ERROR_*)
    elif action is Action.SYNC: wait for a change or until wake_at(ctx, deadline)
    else: new = apply(state, action, ctx); write it with compare-and-set;
          on a lost race re-read and decide again; after a win, observe(new)

Time (``now``, ``deadline``) is the node's own monotonic clock in seconds. The shared
state never holds a clock value, so clock skew between hosts cannot kill live nodes.
Store the state as :func:`encode_state` bytes; :func:`decode_state` validates.
"""

from .actions import Action, apply, assign_ranks, dead_nodes, observe, sanitize
from .codec import FORMAT_VERSION, MAX_STATE_BYTES, decode_state, encode_state
from .errors import (
    InvalidTransitionError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from .operators import (
    JOIN_TABLE,
    CloseOp,
    Context,
    ExitOp,
    JoinOp,
    JoinRow,
    KeepAliveOp,
    Operator,
    join_row,
    keep_alive_due,
    last_call_passed,
    wake_at,
)
from .state import (
    HeartbeatSighting,
    LastCallSighting,
    NodeDesc,
    Observations,
    RendezvousState,
    Settings,
)

__all__ = [
    "FORMAT_VERSION",
    "JOIN_TABLE",
    "MAX_STATE_BYTES",
    "Action",
    "CloseOp",
    "Context",
    "ExitOp",
    "HeartbeatSighting",
    "InvalidTransitionError",
    "JoinOp",
    "JoinRow",
    "KeepAliveOp",
    "LastCallSighting",
    "NodeDesc",
    "Observations",
    "Operator",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousState",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "Settings",
    "apply",
    "assign_ranks",
    "dead_nodes",
    "decode_state",
    "encode_state",
    "join_row",
    "keep_alive_due",
    "last_call_passed",
    "observe",
    "sanitize",
    "wake_at",
]
