"""torchrun entry points: ``--rdzv-backend rallypoint-c10d`` / ``rallypoint-etcd`` /
``rallypoint-etcd-embedded``.

torch's registry loads each ``torchrun.handlers`` entry point and *calls* it with no
arguments to obtain the handler creator, so each entry point is a function that
returns a creator. The creator imports :func:`rallypoint.adapters.create_handler`
only when called: registration runs while ``torch.distributed.elastic.rendezvous``
is still being imported, so importing the handler's modules then could fail on a
partially initialized torch module (and torch only logs a warning).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ["c10d_handler", "etcd_embedded_handler", "etcd_handler"]


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from .factory import create_handler

    return create_handler(params)


def _creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return _create


def c10d_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The creator torchrun registers as ``rallypoint-c10d``."""
    return _creator()


def etcd_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The creator torchrun registers as ``rallypoint-etcd``."""
    return _creator()


def etcd_embedded_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The creator torchrun registers as ``rallypoint-etcd-embedded``."""
    return _creator()
