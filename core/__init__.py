"""The pure rendezvous core: no sockets, threads, waiting, randomness or clock reads.

Embed it in any scheduler or simulation: keep a :class:`RendezvousState` somewhere
all nodes can compare-and-set, and drive each node with the driver
(:mod:`rallypoint.core.driver`), carrying out its instructions::

    view = NodeView()
    while True:
        match decide(view, node, settings, JoinOp(), deadline, now()):
            case Read(counters, intents):
                after_read(view, node, state, side_counters_or_None, now(), log_or_None)
            case Write(state, phase=phase):
                compare-and-set, publish phase if set
                after_write(view, node, won, stored_state, now(), sent_at)
            case Beat():          after_beat(view, node, bumped_counter, now(), sent_at)
            case Announce(round): append node to the round's intent log
                                  after_announce(view, round)
            case Wait(until, phase):
                wait for a phase above ``phase`` or until; after_wait(view)
            case Done(action):    break  # FINISH, or raise for ERROR_*

The view belongs to its node and changes in place: the ``after_*`` functions update
it (and return it), :func:`decide` reads it and records in it what it decided on
(:meth:`Decision.of`, for tracing). Take :meth:`NodeView.copy` to keep one.

While its workers run, a node asks :func:`must_fence` (no IO) and stops them when it
has not renewed its lease (``sent_at``: when the renewing request was sent) for long
enough that its peers may declare it dead.

Time (``now``, ``deadline``) is the node's own monotonic clock in seconds. The shared
state never holds a clock value, so clock skew between hosts cannot kill live nodes.
The decisions underneath (operators, :func:`apply`, :func:`observe`,
:func:`sanitize`) are public for tests and embedders that study one decision.
Store the state as :func:`encode_state` bytes; :func:`decode_state` validates.
"""

from .actions import Action, apply, assign_ranks
from .codec import (
    FORMAT_VERSION,
    MAX_STATE_BYTES,
    SHARED_SETTINGS,
    decode_state,
    encode_shared_settings,
    encode_state,
    shared_settings_differences,
)
from .driver import (
    Announce,
    Beat,
    Decision,
    Done,
    Instruction,
    Membership,
    NodeView,
    Read,
    Verdict,
    Wait,
    Write,
    after_announce,
    after_beat,
    after_outage,
    after_read,
    after_wait,
    after_write,
    decide,
    monitor,
    must_fence,
    phase_of,
)
from .errors import (
    InvalidTransitionError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousSettingsError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from .liveness import (
    SIDE_BITS,
    dead_nodes,
    fence_after,
    heartbeat_of,
    lease_expiry,
    observe,
    observe_own,
    sanitize,
)
from .operators import (
    JOIN_TABLE,
    ChargeRestartOp,
    CloseOp,
    ExcludeOp,
    ExitOp,
    JoinOp,
    JoinRow,
    KeepAliveOp,
    LeaveOp,
    Operator,
    join_row,
    keep_alive_due,
    last_call_passed,
    wake_at,
)
from .state import (
    Context,
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
    "SHARED_SETTINGS",
    "SIDE_BITS",
    "Action",
    "Announce",
    "Beat",
    "ChargeRestartOp",
    "CloseOp",
    "Context",
    "Decision",
    "Done",
    "ExcludeOp",
    "ExitOp",
    "HeartbeatSighting",
    "Instruction",
    "InvalidTransitionError",
    "JoinOp",
    "JoinRow",
    "KeepAliveOp",
    "LastCallSighting",
    "LeaveOp",
    "Membership",
    "NodeDesc",
    "NodeView",
    "Observations",
    "Operator",
    "Read",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousSettingsError",
    "RendezvousState",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "Settings",
    "Verdict",
    "Wait",
    "Write",
    "after_announce",
    "after_beat",
    "after_outage",
    "after_read",
    "after_wait",
    "after_write",
    "apply",
    "assign_ranks",
    "dead_nodes",
    "decide",
    "decode_state",
    "encode_shared_settings",
    "encode_state",
    "fence_after",
    "heartbeat_of",
    "join_row",
    "keep_alive_due",
    "last_call_passed",
    "lease_expiry",
    "monitor",
    "must_fence",
    "observe",
    "observe_own",
    "phase_of",
    "sanitize",
    "shared_settings_differences",
    "wake_at",
]
