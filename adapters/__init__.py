"""rallypoint.adapters: backends, the sync engine, and torch's RendezvousHandler.

``create_handler(params)`` builds a :class:`RallypointHandler` from torch's
``RendezvousParameters`` (backend ``c10d``/``etcd`` or the torchrun entry-point
names ``rallypoint-c10d``/``rallypoint-etcd``). See docs/adapters.md.
"""

from .backend import BackendStats, MemoryBackend, RendezvousBackend, StateSizeLimit, Token
from .config import BACKENDS, RendezvousConfig, parse_endpoint, parse_endpoints, parse_params
from .errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousSettingsError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from .factory import create_handler
from .handler import RallypointHandler
from .sync import StateSync

__all__ = [
    "BACKENDS",
    "BackendStats",
    "MemoryBackend",
    "RallypointHandler",
    "RendezvousBackend",
    "RendezvousClosedError",
    "RendezvousConfig",
    "RendezvousConnectionError",
    "RendezvousGracefulExitError",
    "RendezvousSettingsError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "StateSizeLimit",
    "StateSync",
    "Token",
    "create_handler",
    "parse_endpoint",
    "parse_endpoints",
    "parse_params",
]
