"""Open the c10d store a rendezvous runs on, from a :class:`RendezvousConfig`.

TCP: the node whose ``is_host`` is true (or, when unset, whose host name or
address matches the endpoint, as torch decides) hosts the TCPStore server on the
endpoint; every node, the host included, talks to it as a client. Port 0 with
``is_host`` binds a free port (see :attr:`C10dBackend.endpoint`).
File: the endpoint is the path of a FileStore shared by all nodes.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from torch.distributed import FileStore, Store, TCPStore

from ..config import RendezvousConfig, parse_endpoint
from ..errors import RendezvousConnectionError, describe
from .backend import C10dBackend

__all__ = ["DEFAULT_PORT", "create_c10d_backend", "is_local_host"]

#: torch's default c10d rendezvous port.
DEFAULT_PORT = 29400


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine (loopback, its name, or one of its addresses)."""
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        target = {info[4][0] for info in socket.getaddrinfo(host, None)}
        local = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return bool(target & (local | {"127.0.0.1", "::1"}))


def _connection_error(config: RendezvousConfig, exc: BaseException, check: str) -> Exception:
    return RendezvousConnectionError(
        describe(
            f"cannot open the c10d store ({exc.__class__.__name__}: {str(exc)[:200]})",
            run_id=config.settings.run_id,
            endpoint=config.endpoint,
            check=check,
        )
    )


def create_c10d_backend(config: RendezvousConfig) -> C10dBackend:
    """Connect to (or host) the store named by ``config`` and wrap it in a backend.

    Raises:
        RendezvousConnectionError: the store cannot be created or reached within
            ``read_timeout``; the message names the run, the endpoint and what to check.
    """
    if config.store_type == "file":
        path = config.endpoint
        try:
            store: Store = FileStore(path, -1)
            waiter: Store = FileStore(path, -1)
        except (RuntimeError, ValueError) as exc:
            raise _connection_error(
                config, exc, "that the file's directory exists and is writable by every node"
            ) from exc
        run_id, name = config.settings.run_id, config.backend_name
        return C10dBackend(store, run_id, endpoint=path, wait_store=waiter, name=name)

    host, port = parse_endpoint(config.endpoint, DEFAULT_PORT)
    timeout = timedelta(seconds=config.read_timeout)
    inferred = config.is_host is None
    is_host = config.is_host if config.is_host is not None else is_local_host(host)
    server: TCPStore | None = None
    if is_host:
        try:
            server = TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timeout)
            port = server.port
        except (RuntimeError, ValueError) as exc:
            # Two processes on the endpoint's machine both infer they host; the one
            # that loses the bind is a client (torch does the same).
            if not inferred:
                raise _connection_error(
                    config, exc, "that the port is free on this host, or set is_host=false"
                ) from exc
    if port == 0:
        raise RendezvousConnectionError(
            describe(
                "port 0 (pick a free port) works only on the node that hosts the store",
                run_id=config.settings.run_id,
                endpoint=config.endpoint,
                check="pass the actual port to the other nodes, or set is_host=true here",
            )
        )
    try:
        client = TCPStore(host, port, is_master=False, timeout=timeout)
        waiter = TCPStore(host, port, is_master=False, timeout=timeout)
    except (RuntimeError, ValueError) as exc:
        raise _connection_error(
            config,
            exc,
            "that the node hosting the store (is_host) is up, the address and port are right, "
            "and no firewall blocks them",
        ) from exc

    def drop_server() -> None:
        # Keep the server alive as long as the backend: clients of other nodes use it.
        nonlocal server
        server = None

    return C10dBackend(
        client,
        config.settings.run_id,
        endpoint=f"{host}:{port}",
        wait_store=waiter,
        name=config.backend_name,
        on_close=drop_server,
    )
