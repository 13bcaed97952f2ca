"""A torch ``Store`` on etcd v3, and the etcd backend factory.

torch's agent needs a ``torch.distributed.Store`` from the rendezvous (rank
assignment, exit barrier); etcd is not one, so :class:`EtcdStore` implements the
Store interface on the same etcd client: every node is already connected, nothing
new is opened when a round completes (a new server plus a connection from every
node stalled 32 nodes for seconds), and the store outlives any single node.

Keys live under ``<prefix>/<run_id>/kv/``. ``get``/``wait`` block on an etcd watch,
not a poll; ``add`` and ``compare_set`` are transactions, so concurrent callers never
lose an update.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, Store

from ..config import RendezvousConfig, parse_endpoint
from ..errors import RendezvousConnectionError, describe
from .backend import EtcdBackend, _client_errors

__all__ = ["DEFAULT_PORT", "EtcdStore", "create_etcd_backend"]

#: etcd's default client port.
DEFAULT_PORT = 2379


def _bytes(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(Store):
    """``torch.distributed.Store`` over an :class:`EtcdBackend`'s client.

    Args:
        backend: gives the client, the run's key namespace and error mapping.
        timeout: the default timeout of ``get`` and ``wait``.
    """

    def __init__(self, backend: EtcdBackend, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self._backend = backend
        self._client: Any = backend.client
        self._root = backend.key("kv/")
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._root + key

    def set(self, key: str, value: str | bytes) -> None:
        full, data = self._key(key), _bytes(value)
        self._backend.call(lambda: self._client.put(full, data), written=len(full) + len(data))

    def _lookup(self, key: str) -> tuple[bytes | None, int]:
        """(value or None, the revision the read saw)."""
        response = self._backend.call(lambda: self._client.get_response(self._key(key)))
        if response.count > 0:
            return bytes(response.kvs[0].value), int(response.header.revision)
        return None, int(response.header.revision)

    def _wait_one(self, key: str, deadline: float) -> bytes:
        while True:
            value, revision = self._lookup(key)
            if value is not None:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistStoreError(
                    f"timed out waiting for key {key!r} in the etcd store at "
                    f"{self._backend.endpoint}"
                )
            self._backend.watch(self._key(key), revision + 1, min(left, 1.0))

    def get(self, key: str) -> bytes:
        # torch's Store stub omits the ``timeout`` property the binding has.
        deadline = time.monotonic() + self.timeout.total_seconds()  # type: ignore[attr-defined]
        return self._wait_one(key, deadline)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        # torch's Store stub omits the ``timeout`` property the binding has.
        span = (timeout or self.timeout).total_seconds()  # type: ignore[attr-defined]
        deadline = time.monotonic() + span
        for key in keys:
            self._wait_one(key, deadline)

    def check(self, keys: list[str]) -> bool:
        return all(self._lookup(key)[0] is not None for key in keys)

    def _swap(self, key: str, update: Callable[[bytes | None], bytes | None]) -> bytes:
        """Atomically replace the value with ``update(old or None)`` (None: keep)."""
        full = self._key(key)
        tx = self._client.transactions
        while True:
            response = self._backend.call(lambda: self._client.get_response(full))
            if response.count > 0:
                old: bytes | None = bytes(response.kvs[0].value)
                compare = [tx.mod(full) == int(response.kvs[0].mod_revision)]
            else:
                old, compare = None, [tx.version(full) == 0]
            new = update(old)
            if new is None:
                return old if old is not None else b""

            def transaction(c: list[Any] = compare, n: bytes = new) -> Any:
                return self._client.transaction(compare=c, success=[tx.put(full, n)], failure=[])

            ok, _ = self._backend.call(transaction, written=len(full) + len(new))
            if ok:
                return bytes(new)

    def add(self, key: str, amount: int) -> int:
        def update(old: bytes | None) -> bytes:
            if old is not None and not old.lstrip(b"-").isdigit():
                # What a store raises for a value add() cannot count on, naming the key.
                raise DistStoreError(
                    f"add() on key {key!r} of the etcd store at {self._backend.endpoint}: "
                    f"its value {old[:40]!r} is not an integer"
                )
            return str(int(old or b"0") + amount).encode()

        return int(self._swap(key, update))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        want, data = _bytes(expected), _bytes(desired)

        def update(old: bytes | None) -> bytes | None:
            if (old is None and want == b"") or old == want:
                return data
            return None

        return self._swap(key, update)

    def delete_key(self, key: str) -> bool:
        full = self._key(key)
        return bool(self._backend.call(lambda: self._client.delete(full)))

    def num_keys(self) -> int:
        return sum(1 for _ in self._backend.call(lambda: list(self._client.get_prefix(self._root))))


def _read_pem(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as file:
        return file.read()


def _connect(host: str, port: int, config: RendezvousConfig) -> Any:
    """A pyetcd client for ``config``: plain, or TLS with the configured CA and
    client certificate; authenticated when a user is configured (the client asks
    etcd for a token as it is built)."""
    import pyetcd

    tls, auth = config.etcd_tls, config.etcd_auth
    user, password = (auth.user, auth.password) if auth is not None else (None, None)
    if tls is None:
        client = pyetcd.client(
            host, port, timeout=config.read_timeout, user=user, password=password
        )
        # grpc refuses call credentials on a plain channel; pyetcd also sends the
        # token as request metadata, which is all etcd reads.
        client.call_credentials = None
        return client
    import grpc

    # Built here rather than by pyetcd.client, which needs a CA file: without
    # cacert the system's trusted CAs verify the server, as for any https URL.
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_pem(tls.cacert),
        private_key=_read_pem(tls.key),
        certificate_chain=_read_pem(tls.cert),
    )
    endpoint = pyetcd.Endpoint(host, port, secure=True, creds=credentials)
    return pyetcd.MultiEndpointEtcd3Client(
        endpoints=[endpoint], timeout=config.read_timeout, user=user, password=password
    )


def _access_check(config: RendezvousConfig) -> str:
    """What to check when the first requests fail, given the security settings."""
    checks = [
        "that the etcd server is running and reachable at this address "
        "(etcdctl --endpoints=<endpoint> endpoint health)"
    ]
    if config.etcd_tls is not None:
        checks.append(
            "that it serves https with a certificate for this host name signed by "
            + ("cacert" if config.etcd_tls.cacert else "a CA this system trusts (or set cacert)")
            + (
                ", and trusts the CA of the client certificate (cert, key)"
                if config.etcd_tls.cert
                else "; a server started with --client-cert-auth also needs cert and key"
            )
        )
    else:
        checks.append("a server started with TLS needs protocol=https and cacert")
    if config.etcd_auth is not None:
        checks.append(
            f"that user {config.etcd_auth.user!r} exists with this password and has a role "
            "granting readwrite on the /rallypoint/ prefix"
        )
    else:
        checks.append("a server with authentication enabled needs user and password")
    return "; ".join(checks)


def create_etcd_backend(
    config: RendezvousConfig, client: Any = None
) -> tuple[EtcdBackend, EtcdStore]:
    """Connect to the etcd server named by ``config.endpoint`` (default port 2379),
    over TLS with ``config.etcd_tls`` and as ``config.etcd_auth``'s user if set.

    Returns the backend and the store handed to the agent (same client).

    Raises:
        RendezvousConnectionError: etcd does not answer a status request and a
            read of this run's state (TLS, authentication and permission
            failures included; the message says what to check).
    """
    host, port = parse_endpoint(config.endpoint, DEFAULT_PORT)
    scheme = "https" if config.etcd_tls is not None else "http"
    endpoint = f"{scheme}://{host}:{port}" if config.etcd_tls is not None else f"{host}:{port}"
    check = _access_check(config)

    def failed(exc: BaseException) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            describe(
                f"cannot use etcd ({exc.__class__.__name__}: {_grpc_details(exc)})",
                run_id=config.settings.run_id,
                endpoint=endpoint,
                check=check,
            )
        )

    if client is None:
        # OSError, ValueError: an unreadable or malformed PEM file.
        connect_errors: tuple[type[BaseException], ...] = (*_client_errors(), OSError, ValueError)
        try:
            client = _connect(host, port, config)
        except connect_errors as exc:
            # Authentication happens while the client is built.
            raise failed(exc) from exc
    backend = EtcdBackend(
        client,
        config.settings.run_id,
        endpoint=endpoint,
        ttl=config.etcd_ttl,
        name=config.backend_name,
    )
    state_key = backend.key("state")
    try:
        backend.call(client.status)
        # A status request needs no permission: read this run's key too, so a
        # user without access to the prefix fails here and not mid-rendezvous.
        backend.call(lambda: client.get_response(state_key))
    except RendezvousConnectionError as exc:
        raise failed(exc.__cause__ or exc) from exc
    return backend, EtcdStore(backend, timedelta(seconds=config.read_timeout))


def _grpc_details(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    if callable(details):
        try:
            text = details()
        except Exception:  # a message is best effort
            text = None
        if text:
            return str(text)[:300]
    return str(exc)[:300]
