"""The words for a node's lifecycle, shared by the model, the checker and the simulator.

Two vocabularies, one for each half of what a node is:

* :class:`Phase` -- what the node's process is doing locally (runs a join, trains,
  left its round...). The checker keeps it per node slot; the simulator per
  simulated node.
* :class:`Lifecycle` -- the state of the model (:mod:`rallypoint.spec.model.machine`): the
  local phase refined by the node's membership in the shared state (a joining node
  listed as a participant is a *participant*; see
  :func:`rallypoint.spec.model.machine.lifecycle_state`).

A phase and a lifecycle state of the same name mean the same thing (and are equal,
as the strings they are). Members are strings so that they render and compare as
the words of docs/spec.md, hash like them (so do the checker's state fingerprints,
in every worker process), and pickle by value.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["LOCAL_PHASES", "TERMINAL_PHASES", "Lifecycle", "Name", "Phase"]


class Name(str, Enum):
    """An enumeration whose members are strings and print as their value
    (``enum.StrEnum``, which Python 3.10 lacks)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class Phase(Name):
    """What a node's process is doing locally."""

    #: started, in no round and running no operation
    IDLE = "idle"
    #: runs a join (the simulator: also the exit that precedes a re-join, and
    #: the restart charge or self-exclusion before it)
    JOINING = "joining"
    #: its join returned: its workers run
    TRAINING = "training"
    #: left its round (and may join again)
    EXITED = "exited"
    #: the rendezvous is closed; the node stopped
    CLOSED = "closed"
    #: an operation ran past its deadline
    FAILED = "failed"
    #: the process died
    CRASHED = "crashed"
    #: (the simulator) no process runs in the slot until it restarts
    DOWN = "down"
    #: (the simulator) leaves: its graceful exit runs
    EXITING = "exiting"
    #: (the simulator) its close runs
    CLOSING = "closing"


#: The phases the model knows (:func:`rallypoint.spec.model.machine.lifecycle_state`).
LOCAL_PHASES: frozenset[Phase] = frozenset(
    {
        Phase.IDLE,
        Phase.JOINING,
        Phase.TRAINING,
        Phase.EXITED,
        Phase.CLOSED,
        Phase.FAILED,
        Phase.CRASHED,
    }
)
#: Phases no event leaves (a crashed process restarts as a new one).
TERMINAL_PHASES: frozenset[Phase] = frozenset({Phase.CLOSED, Phase.FAILED, Phase.CRASHED})


class Lifecycle(Name):
    """The lifecycle states of one node, in the diagram's order (the model's
    states; docs/spec.md draws them)."""

    IDLE = "idle"
    JOINING = "joining"
    WAITING = "waiting"
    REDUNDANT = "redundant"
    PARTICIPANT = "participant"
    COMPLETE = "complete"
    TRAINING = "training"
    #: its join returned, and it is no member of the state any more
    EVICTED = "evicted"
    EXITED = "exited"
    CLOSED = "closed"
    FAILED = "failed"
    CRASHED = "crashed"
