"""rallypoint.adapters: backends, the sync engine, and torch's RendezvousHandler.

``create_handler(params)`` builds a :class:`RallypointHandler` from torch's
``RendezvousParameters`` (backend ``c10d``, ``etcd`` or ``etcd-embedded``, or the
torchrun entry-point names ``rallypoint-c10d``, ``rallypoint-etcd`` and
``rallypoint-etcd-embedded``). See docs/adapters.md.

Importing this package stays cheap (no torch), so that the launcher can check its
flags with :mod:`rallypoint.adapters.config` before torch loads; everything else
loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import (
    BACKEND_KINDS,
    ConfigError,
    RendezvousConfig,
    RendezvousConfigError,
    parse_endpoint,
    parse_endpoints,
    parse_params,
)

if TYPE_CHECKING:
    from .aio import AsyncBackend, AsyncMemoryBackend, AsyncRendezvous, ThreadedBackend
    from .backend import BackendStats, MemoryBackend, RendezvousBackend, StateSizeLimit, Token
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
    "BACKEND_KINDS",
    "AsyncBackend",
    "AsyncMemoryBackend",
    "AsyncRendezvous",
    "BackendStats",
    "ConfigError",
    "MemoryBackend",
    "RallypointHandler",
    "RendezvousBackend",
    "RendezvousClosedError",
    "RendezvousConfig",
    "RendezvousConfigError",
    "RendezvousConnectionError",
    "RendezvousGracefulExitError",
    "RendezvousSettingsError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "StateSizeLimit",
    "StateSync",
    "ThreadedBackend",
    "Token",
    "create_handler",
    "parse_endpoint",
    "parse_endpoints",
    "parse_params",
]

#: The modules of the other names (they import torch), in the order __getattr__
#: looks a name up in them; each loads on first use.
_LAZY_MODULES = ("aio", "backend", "errors", "factory", "handler", "sync")


#: Names this package exported before 0.2.0 (CHANGELOG.md): each still works, with
#: a warning naming the new one, until the next release.
_MOVED = {"BACKENDS": f"{__name__}.config:BACKEND_KINDS"}


def __getattr__(name: str) -> Any:
    if name in __all__:
        for module_name in _LAZY_MODULES:
            module = importlib.import_module(f".{module_name}", __name__)
            if hasattr(module, name):
                value = getattr(module, name)
                globals()[name] = value
                return value
    from ..core.deprecation import moved_names  # only an old name needs the core

    return moved_names(__name__, _MOVED)(name)
