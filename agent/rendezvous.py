"""The one seam between the agent and a rendezvous implementation.

:func:`build_handler` maps the launcher's ``--rdzv-backend`` onto a handler:

* ``c10d``, ``etcd`` (and the entry-point names ``rallypoint-c10d``,
  ``rallypoint-etcd``): rallypoint's own handler, :func:`rallypoint.adapters.create_handler`;
* ``torch-c10d``, ``torch-etcd``: torch's dynamic rendezvous, kept for comparisons
  (``bench/recovery.py``);
* ``static``: torch's fixed-membership rendezvous (``--master-addr/--master-port``,
  ``--node-rank``), torchrun's default.

The agent uses the optional extras of rallypoint's handler (``round``,
``dead_participants``, ``wait_for_change``) through :class:`HandlerView`, which
degrades to polling when a handler lacks them.
"""

from __future__ import annotations

import time
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from rallypoint.agent.config import ConfigError, LaunchConfig

__all__ = [
    "BACKENDS",
    "DEFAULT_PORTS",
    "HandlerView",
    "build_handler",
    "parse_endpoint",
]

#: Accepted ``--rdzv-backend`` values and the implementation behind each.
BACKENDS: dict[str, str] = {
    "c10d": "rallypoint",
    "etcd": "rallypoint",
    "rallypoint-c10d": "rallypoint",
    "rallypoint-etcd": "rallypoint",
    "torch-c10d": "torch",
    "torch-etcd": "torch",
    "static": "torch",
}

#: Default port when an endpoint names only a host (None: the port is required).
DEFAULT_PORTS: dict[str, int | None] = {
    "c10d": None,
    "rallypoint-c10d": None,
    "torch-c10d": None,
    "etcd": 2379,
    "rallypoint-etcd": 2379,
    "torch-etcd": 2379,
    "static": None,
}


def parse_endpoint(endpoint: str, backend: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:port``); fill a backend's default port.

    Raises:
        ConfigError: empty host, missing port where the backend has no default, or
            a port that is not an integer in 0..65535.
    """
    text = endpoint.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if not sep:
            raise ConfigError(f"--rdzv-endpoint {endpoint!r}: missing ']' after the IPv6 host")
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: missing host (expected host:port)")
    if not port_text:
        default = DEFAULT_PORTS.get(backend)
        if default is None:
            raise ConfigError(
                f"--rdzv-endpoint {endpoint!r}: the {backend} backend needs host:port"
            )
        return host, default
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r}: port {port_text!r} is not a number"
        ) from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: port {port} is out of range 0..65535")
    return host, port


def build_handler(config: LaunchConfig) -> RendezvousHandler:
    """Create the rendezvous handler ``config`` asks for.

    Raises:
        ConfigError: unknown backend or malformed endpoint.
    """

    backend = config.rdzv_backend
    if backend not in BACKENDS:
        raise ConfigError(
            f"--rdzv-backend {backend!r} is unknown; use one of {', '.join(sorted(BACKENDS))}"
        )
    configs: dict[str, Any] = dict(config.rdzv_configs)
    if backend == "static":
        endpoint = f"{config.master_addr}:{config.master_port}"
        configs["rank"] = config.node_rank
        torch_backend = "static"
    else:
        if config.standalone:
            endpoint = "127.0.0.1:0"
            configs.setdefault("is_host", True)
        else:
            if not config.rdzv_endpoint:
                raise ConfigError(
                    f"--rdzv-endpoint is required for the {backend} backend "
                    "(or use --standalone for a single node)"
                )
            host, port = parse_endpoint(config.rdzv_endpoint, backend)
            endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        torch_backend = backend.removeprefix("torch-").removeprefix("rallypoint-")
    params = RendezvousParameters(
        backend=torch_backend,
        endpoint=endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **configs,
    )
    if BACKENDS[backend] == "rallypoint":
        from rallypoint.adapters import create_handler

        params.backend = backend
        return create_handler(params)
    return get_rendezvous_handler(params)


class HandlerView:
    """The agent's view of a handler: torch's interface plus rallypoint's optional extras."""

    def __init__(self, handler: RendezvousHandler) -> None:
        self.handler = handler
        self._dead = getattr(handler, "dead_participants", None)
        self._wait = getattr(handler, "wait_for_change", None)

    @property
    def knows_round(self) -> bool:
        """Whether the handler reports a group-wide round number itself."""
        return isinstance(getattr(type(self.handler), "round", None), property)

    @property
    def round(self) -> int:
        """The round of the last completed rendezvous (only if :attr:`knows_round`)."""
        return int(self.handler.round)  # type: ignore[attr-defined]

    @property
    def detects_dead_peers(self) -> bool:
        """Whether the handler reports participants that left or stopped heartbeating."""
        return self._dead is not None

    def dead_participants(self) -> frozenset[Any]:
        """Participants of the current round presumed dead (empty if unsupported)."""
        if self._dead is None:
            return frozenset()
        return frozenset(self._dead())

    def wait(self, timeout: float) -> None:
        """Block until the shared state may have changed or ``timeout`` passes."""
        if self._wait is not None:
            self._wait(timeout)
        else:
            time.sleep(timeout)

    def endpoint(self) -> str:
        """The endpoint in use, when the handler tells (rallypoint), else ''."""
        return str(getattr(self.handler, "endpoint", "") or "")
