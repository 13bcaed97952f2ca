"""Parse torch's ``RendezvousParameters`` into rallypoint settings and options.

``--rdzv-conf`` values arrive as strings (``"true"``, ``"5"``) or typed values;
both are accepted, as in torch. Defaults follow torch's c10d rendezvous.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import RendezvousParameters

from rallypoint.core import Settings

__all__ = ["BACKENDS", "RendezvousConfig", "parse_endpoint", "parse_params"]

#: Accepted ``params.backend`` names: the plain ones and the torchrun entry points.
BACKENDS: dict[str, str] = {
    "c10d": "c10d",
    "rallypoint-c10d": "c10d",
    "etcd": "etcd",
    "rallypoint-etcd": "etcd",
}

_TRUE = {"1", "true", "t", "yes", "y", "on"}
_FALSE = {"0", "false", "f", "no", "n", "off"}


@dataclass(frozen=True)
class RendezvousConfig:
    """Everything :func:`rallypoint.adapters.create_handler` reads from the parameters."""

    kind: str
    backend_name: str
    endpoint: str
    settings: Settings
    local_addr: str
    is_host: bool | None
    store_type: str
    read_timeout: float
    etcd_ttl: float | None


def _bool(value: object, key: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"rendezvous option {key}={value!r} is not a boolean (use true or false)")


def _seconds(value: object, key: str, default: float) -> float:
    if value is None:
        return default
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"rendezvous option {key}={value!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"rendezvous option {key}={value!r} must be a positive number of seconds")
    return seconds


def _int(value: object, key: str, default: int) -> int:
    if value is None:
        return default
    try:
        number = int(str(value))
    except ValueError:
        raise ValueError(f"rendezvous option {key}={value!r} is not an integer") from None
    return number


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``host[:port]`` (IPv6 in brackets) -> (host, port).

    Raises:
        ValueError: the port is not an integer in 0..65535.
    """
    text = endpoint.strip()
    if not text:
        return "localhost", default_port
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ValueError(f"the port in rendezvous endpoint {endpoint!r} is not in 0..65535")
    return host, int(port_text)


def parse_params(params: RendezvousParameters) -> RendezvousConfig:
    """Validate ``params`` and turn them into a :class:`RendezvousConfig`.

    Raises:
        ValueError: an unknown backend name (the message lists the accepted ones)
            or an option of the wrong type or range.
    """
    kind = BACKENDS.get(params.backend)
    if kind is None:
        raise ValueError(
            f"unknown rendezvous backend {params.backend!r}; rallypoint accepts "
            f"{', '.join(sorted(BACKENDS))}"
        )
    get = params.config.get
    settings = Settings(
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout=_seconds(get("join_timeout"), "join_timeout", 600.0),
        last_call_timeout=_seconds(get("last_call_timeout"), "last_call_timeout", 30.0),
        close_timeout=_seconds(get("close_timeout"), "close_timeout", 30.0),
        heartbeat_timeout=_seconds(get("heartbeat_timeout"), "heartbeat_timeout", 5.0),
        keep_alive_interval=_seconds(get("keep_alive_interval"), "keep_alive_interval", 5.0),
        keep_alive_max_attempt=_int(get("keep_alive_max_attempt"), "keep_alive_max_attempt", 3),
        stable_ranks=bool(_bool(get("stable_ranks"), "stable_ranks")),
    )
    local_addr = get("local_addr") or params.local_addr or socket.getfqdn()
    store_type = str(get("store_type", "tcp")).strip().lower()
    if store_type not in ("tcp", "file"):
        raise ValueError(f"rendezvous option store_type={store_type!r}: use tcp or file")
    ttl = get("ttl")
    return RendezvousConfig(
        kind=kind,
        backend_name=params.backend,
        endpoint=params.endpoint,
        settings=settings,
        local_addr=str(local_addr),
        is_host=_bool(get("is_host"), "is_host"),
        store_type=store_type,
        read_timeout=_seconds(get("read_timeout"), "read_timeout", 60.0),
        etcd_ttl=None if ttl is None else _seconds(ttl, "ttl", 1.0),
    )
