"""The pure rendezvous core: no sockets, threads, waiting, randomness or clock reads.

Embed it in any scheduler or simulation: keep the state somewhere all nodes can
compare-and-set (with a token), beside a side heartbeat counter per node, a phase
number to wait on and a per-round intent log (docs/adapters.md), and drive each node
through its :class:`RendezvousNode`. The node holds its view and the token of the
state it last read; you carry out what it asks and hand back what happened, with
the node's own monotonic time in seconds (``now``: the only kind of time)::

    node = RendezvousNode(desc, settings)
    node.join(now())
    result = None
    while True:
        match node.step(result, now()):
            case Read(counters, intents, state):  # state False: keep the one held
                result = ReadResult(decode_state(blob), token,
                                    side_counters if counters else None,
                                    intent_log if intents else None)
            case Write(state, phase=phase):       # CAS over node.token, then publish phase
                result = WriteResult(won, stored_state, new_token)
            case Beat():          result = BeatResult(bumped_side_counter)
            case Announce(round): result = AnnounceResult()  # appended str(desc)
            case Wait(until, phase):              # a phase above `phase`, or until
                result = WaitResult(changed)
            case Joined(membership):  start workers;  result = None
            case Regroup():           stop workers;   result = None  # rejoins itself
            case Done(action):        break  # left, closed, or ERROR_* (timeout...)

Every operation starts from a stale view (the node reads first). The node keeps
the operation's deadline (:attr:`RendezvousNode.deadline`; a won ``Write`` may move
it: a redundant node that becomes a joiner starts a fresh join timeout): an executor
that cannot reach the store gives up once it passed. Keep-alive (a ``KeepAliveOp``
pass every quarter keep-alive interval, answering ``Beat`` when one is due) and
watching the round (``driver.watch``: side counters read when due, dead peers
published, a ``Verdict`` the node turns into ``Regroup``; a lease run out answers
``Regroup(fenced=True)``) are instructions the node asks for while it is a member;
``Verdict`` reaches the caller only from :meth:`RendezvousNode.watch`, for an agent
that monitors on its own schedule (``StateSync``). :mod:`rallypoint.core.node`
documents what each instruction obliges the caller to do and in which order, and
:mod:`rallypoint.core.dispatch` is the same as code: the store operations each
instruction takes, for an executor to perform; :mod:`rallypoint.adapters.aio` and
:class:`rallypoint.adapters.StateSync` are executors of it (asyncio, threads).

Underneath, :mod:`rallypoint.core.driver` is the node's loop as pure functions
(``decide``, ``watch``, ``after_*``) on a :class:`NodeView`; the decisions under
it (operators, :func:`apply`, :func:`observe`, :func:`sanitize`) are public for
tests that study one decision. The shared state never holds a clock value, so clock
skew between hosts cannot kill live nodes. Store the state as :func:`encode_state`
bytes; :func:`decode_state` validates.
"""

from .actions import Action, apply, assign_ranks
from .codec import (
    MAX_STATE_BYTES,
    decode_state,
    encode_shared_settings,
    encode_state,
    shared_settings_differences,
)
from .deprecation import moved_names as _moved_names
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
    after_read,
    after_wait,
    after_write,
    decide,
    phase_of,
    watch,
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
    dead_nodes,
    heartbeat_of,
    observe,
    observe_own,
    sanitize,
)
from .newcomers import ADMISSION_RULE, Admission, NewcomerView, admission
from .node import (
    AnnounceResult,
    BeatResult,
    Joined,
    NodeInstruction,
    Outage,
    ReadResult,
    Regroup,
    RendezvousNode,
    Result,
    Unreachable,
    WaitResult,
    WriteResult,
    keep_alive_period,
)
from .operators import (
    JOIN_TABLE,
    ChargeRestartOp,
    CloseOp,
    ExcludeOp,
    ExitOp,
    JoinOp,
    KeepAliveOp,
    LeaveOp,
    Operator,
    join_row,
    keep_alive_due,
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
    "ADMISSION_RULE",
    "JOIN_TABLE",
    "MAX_STATE_BYTES",
    "Action",
    "Admission",
    "Announce",
    "AnnounceResult",
    "Beat",
    "BeatResult",
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
    "Joined",
    "KeepAliveOp",
    "LastCallSighting",
    "LeaveOp",
    "Membership",
    "NewcomerView",
    "NodeDesc",
    "NodeInstruction",
    "NodeView",
    "Observations",
    "Operator",
    "Outage",
    "Read",
    "ReadResult",
    "Regroup",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousNode",
    "RendezvousSettingsError",
    "RendezvousState",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "Result",
    "Settings",
    "Unreachable",
    "Verdict",
    "Wait",
    "WaitResult",
    "Write",
    "WriteResult",
    "admission",
    "after_announce",
    "after_beat",
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
    "heartbeat_of",
    "join_row",
    "keep_alive_due",
    "keep_alive_period",
    "observe",
    "observe_own",
    "phase_of",
    "sanitize",
    "shared_settings_differences",
    "wake_at",
    "watch",
]

# Names this package exported before 0.2.0 (CHANGELOG.md): each still works, with
# a warning naming where it lives now, until the next release.
__getattr__ = _moved_names(
    __name__,
    {
        "monitor": f"{__name__}.driver:watch",
        "FORMAT_VERSION": f"{__name__}.codec:FORMAT_VERSION",
        "SHARED_SETTINGS": f"{__name__}.codec:SHARED_SETTINGS",
        "JoinRow": f"{__name__}.operators:JoinRow",
        "last_call_passed": f"{__name__}.operators:last_call_passed",
        "SIDE_BITS": f"{__name__}.liveness:SIDE_BITS",
        "fence_after": f"{__name__}.liveness:fence_after",
        "lease_expiry": f"{__name__}.liveness:lease_expiry",
        "after_outage": f"{__name__}.driver:after_outage",
        "must_fence": f"{__name__}.driver:must_fence",
    },
)
