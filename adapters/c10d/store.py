"""Open the c10d store a rendezvous runs on, from a :class:`RendezvousConfig`.

TCP: the node whose ``is_host`` is true (or, when unset, whose host name or
address matches the endpoint, as torch decides) hosts the TCPStore server on the
endpoint; every node, the host included, talks to it as a client. Port 0 with
``is_host`` binds a free port (see :attr:`C10dBackend.endpoint`).
File: the endpoint is the path of a FileStore shared by all nodes.

The hosting server listens on the endpoint's address only (:func:`bind_address`),
not on every interface as TCPStore does by itself: the store is unauthenticated,
and whoever reaches it can close the rendezvous or rewrite its state
(docs/security.md). TCPStore binds ``::`` whatever host it is given, but serves a
socket it is handed (``master_listen_fd``), so this module binds that socket.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from torch.distributed import FileStore, Store, TCPStore

from ..config import DEFAULT_PORT_BY_KIND, RendezvousConfig, parse_endpoint
from ..errors import RendezvousConnectionError, describe
from .backend import C10dBackend

__all__ = [
    "DEFAULT_PORT",
    "StoreBindError",
    "bind_address",
    "create_c10d_backend",
    "host_tcp_store",
    "is_local_host",
]

#: torch's default c10d rendezvous port.
DEFAULT_PORT = DEFAULT_PORT_BY_KIND["c10d"]

#: Pause between connection attempts to a store that refuses them (not up yet).
_CONNECT_RETRY_SECONDS = 0.25

_T = TypeVar("_T")


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


class StoreBindError(OSError):
    """The store's server cannot listen on the address asked for (taken, or not
    an address of this host); ``errno`` says which."""


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def bind_address(host: str) -> str | None:
    """The one address a server for ``host`` should listen on; None: every interface.

    An IP address is itself; ``localhost`` is its loopback address. A host name is
    the address it resolves to here when that is a single address that other
    hosts can reach. Every interface otherwise, as TCPStore would: a name that
    resolves only to loopback here (Debian maps the host name to 127.0.1.1) is
    reached by peers at another address, and a name with several addresses could
    be reached at any of them.
    """
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if host.rstrip(".").lower() == "localhost":
        # IPv4 first: clients that resolve "localhost" elsewhere try 127.0.0.1 first.
        loopback = sorted((a for a in addresses if _is_loopback(a)), key=lambda a: ":" in a)
        return loopback[0] if loopback else None
    if len(addresses) == 1 and not _is_loopback(addresses[0]):
        return addresses[0]
    return None


def _listening_socket(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            reason = f"{address} is not an address of this host"
        elif exc.errno == errno.EADDRINUSE:
            reason = f"{address}:{port} is in use"
        else:
            reason = f"cannot listen on {address}:{port} ({exc.strerror or exc})"
        raise StoreBindError(exc.errno, reason) from exc
    return sock


def host_tcp_store(host: str, port: int, timeout: timedelta) -> TCPStore:
    """A multi-tenant TCPStore server for ``host:port`` listening only on
    :func:`bind_address` of ``host`` (port 0: a free one, see ``.port``).

    Raises:
        StoreBindError: the address is taken or not one of this host's.
        RuntimeError: TCPStore could not start (e.g. the port is taken).
    """
    address = bind_address(host)
    if address is None:
        return TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timeout)
    sock = _listening_socket(address, port)
    bound_port = int(sock.getsockname()[1])
    # TCPStore owns the descriptor from here on, and closes it with the server.
    return TCPStore(
        host,
        bound_port,
        is_master=True,
        multi_tenant=True,
        timeout=timeout,
        master_listen_fd=sock.detach(),
    )


def _connection_error(config: RendezvousConfig, exc: BaseException, check: str) -> Exception:
    return RendezvousConnectionError(
        describe(
            f"cannot open the c10d store ({exc.__class__.__name__}: {str(exc)[:200]})",
            run_id=config.settings.run_id,
            endpoint=config.endpoint,
            check=check,
        )
    )


class _ConnectTimeout(Exception):
    """The store did not accept a connection, or did not answer, in time."""


def _wait_until_accepting(host: str, port: int, deadline: float) -> None:
    """Return once ``host:port`` accepts a TCP connection.

    TCPStore's own connect loop retries for its timeout (read_timeout, per store)
    and then logs a C++ stack trace; this loop stops at ``deadline``, the bound
    the user set, and says why in one line.
    """
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _ConnectTimeout(f"nothing accepted a connection ({last})")
        try:
            with socket.create_connection((host, port), timeout=min(left, 5.0)):
                return
        except OSError as exc:
            last = exc.strerror or str(exc) or type(exc).__name__
        time.sleep(max(0.0, min(_CONNECT_RETRY_SECONDS, deadline - time.monotonic())))


def _finish_by(call: Callable[[], _T], deadline: float) -> _T:
    """``call()`` in a helper thread, given up at ``deadline``.

    A TCPStore client waits for the server's answer to its first message with no
    timeout at all: a port held by a server that never answers blocked it for
    good. Given up, the helper (a daemon, blocked in C++) is abandoned.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the caller as is
            outcome["error"] = exc

    helper = threading.Thread(target=run, name="rallypoint-store-connect", daemon=True)
    helper.start()
    helper.join(max(0.0, deadline - time.monotonic()))
    if helper.is_alive():
        raise _ConnectTimeout("a server accepted the connection but did not answer as a c10d store")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]


def _connect_clients(
    config: RendezvousConfig, host: str, port: int, timeout: timedelta
) -> tuple[TCPStore, TCPStore]:
    """The backend's two TCPStore clients, connected within the smaller of
    read_timeout and join_timeout."""
    bound = min(config.read_timeout, config.settings.join_timeout)
    deadline = time.monotonic() + bound
    try:
        _wait_until_accepting(host, port, deadline)
        client = _finish_by(
            lambda: TCPStore(host, port, is_master=False, timeout=timeout), deadline
        )
        waiter = _finish_by(
            lambda: TCPStore(host, port, is_master=False, timeout=timeout), deadline
        )
    except _ConnectTimeout as exc:
        raise RendezvousConnectionError(
            describe(
                f"cannot open the c10d store at {host}:{port}: {exc} within {bound:g} s "
                "(the smaller of read_timeout and join_timeout)",
                run_id=config.settings.run_id,
                endpoint=config.endpoint,
                check="that the node hosting the store (is_host) is up, the address and port "
                "are right and are the rendezvous store's (not another service's), and no "
                "firewall blocks them",
            )
        ) from None
    return client, waiter


def create_c10d_backend(config: RendezvousConfig) -> C10dBackend:
    """Connect to (or host) the store named by ``config`` and wrap it in a backend.

    Raises:
        ConfigError: a malformed endpoint (a list: only etcd takes one).
        RendezvousConnectionError: the store cannot be created, or does not accept
            and answer a connection within the smaller of ``read_timeout`` and
            ``join_timeout``; the message names the run, the endpoint and what to check.
    """
    if config.store_type == "file":
        return _file_backend(config)
    host, port = parse_endpoint(config.endpoint, DEFAULT_PORT, backend=config.backend_name)
    timeout = timedelta(seconds=config.read_timeout)
    server = _host_if_asked(config, host, port, timeout)
    if server is not None:
        port = server.port
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
        client, waiter = _connect_clients(config, host, port, timeout)
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


def _file_backend(config: RendezvousConfig) -> C10dBackend:
    """A backend on the FileStore at the endpoint's path (two clients: one waits)."""
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


def _host_if_asked(
    config: RendezvousConfig, host: str, port: int, timeout: timedelta
) -> TCPStore | None:
    """The TCPStore server this node hosts: with ``is_host``, or when it is unset
    and the endpoint names this machine (as torch decides). None: a client only."""
    inferred = config.is_host is None
    if not (is_local_host(host) if config.is_host is None else config.is_host):
        return None
    try:
        return host_tcp_store(host, port, timeout)
    except (StoreBindError, RuntimeError, ValueError) as exc:
        # Two processes on the endpoint's machine both infer they host; the one
        # that loses the bind is a client (torch does the same).
        if inferred:
            return None
        raise _connection_error(
            config,
            exc,
            "that the port is free and the endpoint's host is an address of this "
            "host, or set is_host=false",
        ) from exc
