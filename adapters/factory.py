"""``create_handler(params)``: torch's ``RendezvousParameters`` -> :class:`RallypointHandler`."""

from __future__ import annotations

import atexit

from torch.distributed.elastic.rendezvous import RendezvousParameters

from .config import parse_params
from .handler import RallypointHandler

__all__ = ["create_handler"]


def create_handler(params: RendezvousParameters) -> RallypointHandler:
    """Build a handler for ``params.backend`` in ``c10d``, ``etcd``, ``etcd-embedded``
    and their ``rallypoint-`` entry-point names.

    ``etcd-embedded`` starts this node's etcd member first (when it runs one); it
    stops when the handler is closed, or at the latest when this process exits
    (torchrun's agent never closes its handler).

    Raises:
        ConfigError: (a ValueError) an unknown backend, a malformed endpoint or option.
        RendezvousConnectionError: the backend cannot be reached.
    """
    config = parse_params(params)
    if config.kind == "c10d":
        from .c10d import create_c10d_backend

        backend = create_c10d_backend(config)
        return RallypointHandler(backend, config.settings, local_addr=config.local_addr)
    if config.embedded is not None:
        from .etcd.embedded import create_embedded_backend

        etcd_backend, store = create_embedded_backend(config)
        atexit.register(etcd_backend.close)
    else:
        from .etcd import create_etcd_backend

        etcd_backend, store = create_etcd_backend(config)
    # The etcd backend retries every call itself (for read_timeout, failing over
    # between the members): the sync engine must not retry that window again.
    return RallypointHandler(
        etcd_backend, config.settings, local_addr=config.local_addr, store=store
    )
