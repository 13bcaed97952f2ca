"""Errors raised by the adapters, catchable as rallypoint's *and* torch's errors.

Each class inherits from the matching :mod:`rallypoint.core.errors` class and from
torch's ``torch.distributed.elastic.rendezvous.api`` class of the same name, so
torch's own elastic agent (which catches torch's classes) and rallypoint's agent
(which catches the core's) both handle them. Without torch (the core installed
alone, an embedder's asyncio executor on the memory backend) they are the core's
classes only: there is no torch agent to catch them then.

This module imports torch, so the modules an embedder uses without torch's agent
(``backend``, ``sync``, ``aio``) import it only when they raise one of its errors
(:func:`rallypoint.adapters.backend.state_error`) and catch the core's classes.

Messages follow one pattern: what happened, for which run and endpoint, and what to
check (:func:`describe`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from ..core import errors as _core
from ..core.errors import describe

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import api as _torch
else:
    try:
        from torch.distributed.elastic.rendezvous import api as _torch
    except ImportError:  # no torch: the core's classes are all there is to inherit
        _torch = SimpleNamespace(
            **dict.fromkeys(
                ["RendezvousError", "RendezvousClosedError", "RendezvousTimeoutError",
                 "RendezvousConnectionError", "RendezvousStateError",
                 "RendezvousGracefulExitError"],
                Exception,
            )
        )  # fmt: skip

__all__ = [
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousGracefulExitError",
    "RendezvousSettingsError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "describe",
]


class RendezvousClosedError(_core.RendezvousClosedError, _torch.RendezvousClosedError):
    """The rendezvous is closed: the job is over and no node may join."""


class RendezvousTimeoutError(_core.RendezvousTimeoutError, _torch.RendezvousTimeoutError):
    """A rendezvous operation did not finish before its deadline."""


class RendezvousConnectionError(_core.RendezvousConnectionError, _torch.RendezvousConnectionError):
    """The backend (c10d store or etcd server) could not be reached."""


class RendezvousStateError(_core.RendezvousStateError, _torch.RendezvousStateError):
    """The shared state on the backend is malformed or of an unknown version."""


class RendezvousSettingsError(_core.RendezvousSettingsError, _torch.RendezvousError):
    """This node was started with other settings (node counts, keep-alive, stable
    ranks) than the run it joins; torch has no such class, so it is torch's base
    rendezvous error."""


class RendezvousGracefulExitError(
    _core.RendezvousGracefulExitError, _torch.RendezvousGracefulExitError
):
    """The rendezvous closed while this node was redundant: exit without error."""
