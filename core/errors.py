"""Typed errors of the rendezvous. Every error carries a message a user can act on.

The adapters raise the connection/timeout/closed/settings errors; the core raises
only :class:`RendezvousStateError` (bad shared state) and
:class:`InvalidTransitionError` (an action applied to a state it does not fit: a
programming error in a caller).
"""

from __future__ import annotations

__all__ = [
    "InvalidTransitionError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousSettingsError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "describe",
]


class RendezvousError(Exception):
    """Base class of every rendezvous error."""


class RendezvousStateError(RendezvousError):
    """The shared state is malformed, of an unknown version, or violates an invariant."""


class RendezvousSettingsError(RendezvousError):
    """This node's settings differ from the ones the run was started with (e.g. nodes
    launched with different ``--nnodes`` on one run id)."""


class RendezvousTimeoutError(RendezvousError):
    """An operation did not finish before its deadline."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: the job is over and no node may join."""


class RendezvousGracefulExitError(RendezvousError):
    """The rendezvous closed while this node was redundant: exit without error."""


class RendezvousConnectionError(RendezvousError):
    """The backend could not be reached."""


class InvalidTransitionError(RendezvousError, ValueError):
    """An action was applied to a state in which it is not allowed."""


def describe(what: str, *, run_id: str, endpoint: str, check: str) -> str:
    """The message of every adapter error: ``what`` for ``run_id`` at ``endpoint``;
    followed by what the user should ``check``."""
    return f"{what} (run id {run_id!r}, endpoint {endpoint!r}). Check: {check}"
