"""torchrun entry points: ``--rdzv-backend rallypoint-c10d`` / ``rallypoint-etcd``.

torch's registry loads each ``torchrun.handlers`` entry point and *calls* it with no
arguments to obtain the handler creator, so each entry point is a function that
returns :func:`rallypoint.adapters.create_handler`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ["c10d_handler", "etcd_handler"]


def _creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    from .factory import create_handler

    return create_handler


def c10d_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The creator torchrun registers as ``rallypoint-c10d``."""
    return _creator()


def etcd_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The creator torchrun registers as ``rallypoint-etcd``."""
    return _creator()
