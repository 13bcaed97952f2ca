"""rallypoint.adapters.c10d: the rendezvous state in a torch c10d store."""

from .backend import C10dBackend
from .store import DEFAULT_PORT, create_c10d_backend, is_local_host

__all__ = ["DEFAULT_PORT", "C10dBackend", "create_c10d_backend", "is_local_host"]
