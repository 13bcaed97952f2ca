"""A torch ``Store`` on etcd v3, and the etcd backend factory (one member or a
cluster: a comma-separated endpoint list).

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

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, Store

from ..config import DEFAULT_PORT_BY_KIND, RendezvousConfig, parse_endpoints
from ..errors import RendezvousConnectionError, describe
from .backend import EtcdBackend, QuorumLostError
from .client import GRPC_OPTIONS, EtcdConnection, error_text

__all__ = [
    "DEFAULT_PORT",
    "MAX_ATTEMPT_TIMEOUT",
    "MIN_ATTEMPT_TIMEOUT",
    "EtcdStore",
    "attempt_timeout",
    "connect_bound",
    "create_etcd_backend",
]

#: etcd's default client port.
DEFAULT_PORT = DEFAULT_PORT_BY_KIND["etcd"]


def _bytes(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(Store):
    """``torch.distributed.Store`` over an :class:`EtcdBackend`'s connection.

    Every call goes through :meth:`EtcdBackend.call`, so it rides out connection
    errors (and fails over between members) within the backend's retry window.

    Args:
        backend: gives the connection, the run's key namespace and error mapping.
        timeout: the default timeout of ``get`` and ``wait``.
    """

    def __init__(self, backend: EtcdBackend, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self._backend = backend
        self._root = backend.key("kv/")
        # Where a read-modify-write records which attempt applied it (one key per
        # store and thread, overwritten each time): see _swap.
        self._applied_root = backend.key(f"applied/{secrets.token_hex(6)}-")
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._root + key

    def set(self, key: str, value: str | bytes) -> None:
        full, data = self._key(key), _bytes(value)
        self._backend.call(lambda c: c.put(full, data), written=len(full) + len(data))

    def _lookup(self, key: str) -> tuple[bytes | None, int]:
        """(value or None, the revision the read saw)."""
        full = self._key(key)
        response = self._backend.call(lambda c: c.get_response(full))
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
        """Atomically replace the value with ``update(old or None)`` (None: keep).

        Each attempt is a txn comparing the revision it read. A txn sent again
        after a connection error loses if the first one committed, and then
        ``update`` must not run again on the value it produced (an ``add`` would
        count twice): the txn also puts a nonce under this thread's ``applied/``
        key, and a lost txn reads that key back in its failure branch; finding
        its own nonce there, the attempt did apply.
        """
        full = self._key(key)
        marker = self._applied_root + str(threading.get_ident())
        while True:
            response = self._backend.call(lambda c: c.get_response(full))
            if response.count > 0:
                old: bytes | None = bytes(response.kvs[0].value)
                revision = int(response.kvs[0].mod_revision)
            else:
                old, revision = None, 0
            new = update(old)
            if new is None:
                return old if old is not None else b""
            nonce = secrets.token_hex(8).encode()

            def transaction(c: Any, n: bytes = new, r: int = revision, o: bytes = nonce) -> Any:
                tx = c.transactions
                compare = [tx.mod(full) == r] if r else [tx.version(full) == 0]
                return c.transaction(
                    compare=compare,
                    success=[tx.put(full, n), tx.put(marker, o)],
                    failure=[tx.get(marker)],
                )

            ok, responses = self._backend.call(transaction, written=len(full) + len(new))
            if ok or _applied(responses, nonce):
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
        return bool(self._backend.call(lambda c: c.delete(full)))

    def num_keys(self) -> int:
        return len(self._backend.call(lambda c: list(c.get_prefix(self._root))))


def _applied(responses: Any, nonce: bytes) -> bool:
    """Whether a lost ``_swap`` txn's failure branch read back its own nonce."""
    kvs = responses[0] if responses else []
    return bool(kvs) and bytes(kvs[0][0]) == nonce


def _read_pem(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as file:
        return file.read()


#: The longest one etcd request may take before it counts as a connection error
#: and the next member is tried (a stopped or partitioned member never answers,
#: and a follower holds a write for up to 7 s while the cluster elects a leader);
#: the request is retried, so this bounds failover, not the operation.
MAX_ATTEMPT_TIMEOUT = 5.0
#: ... and the shortest (a loaded server may take a while to answer).
MIN_ATTEMPT_TIMEOUT = 1.0


def attempt_timeout(config: RendezvousConfig) -> float:
    """How long one request waits for an answer: a keep-alive interval (a beat
    that takes longer is late anyway: better try another member), between
    :data:`MIN_ATTEMPT_TIMEOUT` and :data:`MAX_ATTEMPT_TIMEOUT`, and never more
    than ``read_timeout``."""
    interval = config.settings.keep_alive_interval
    return min(config.read_timeout, max(MIN_ATTEMPT_TIMEOUT, min(MAX_ATTEMPT_TIMEOUT, interval)))


def connect_bound(config: RendezvousConfig) -> float:
    """How long the first contact with etcd may take: the smaller of
    ``read_timeout`` and ``join_timeout``, the rule of every backend (an
    unreachable store fails the rendezvous no later than its join timeout)."""
    return min(config.read_timeout, config.settings.join_timeout)


def _connector(
    members: list[tuple[str, int]], config: RendezvousConfig, attempt_timeout: float
) -> Callable[[int], Any]:
    """A function that builds a pyetcd client to member ``i`` of ``members``:
    plain, or TLS with the configured CA and client certificate; authenticated
    when a user is configured (the client asks etcd for a token as it is built,
    so a new client after a restart has a token the member knows).

    Raises:
        OSError: a certificate file cannot be read.
    """
    import pyetcd

    tls, auth = config.etcd_tls, config.etcd_auth
    user, password = (auth.user, auth.password) if auth is not None else (None, None)
    credentials = None
    if tls is not None:
        import grpc

        # Built here rather than by pyetcd.client, which needs a CA file: without
        # cacert the system's trusted CAs verify the server, as for any https URL.
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read_pem(tls.cacert),
            private_key=_read_pem(tls.key),
            certificate_chain=_read_pem(tls.cert),
        )

    def connect(index: int) -> Any:
        host, port = members[index]
        # time_retry=0: pyetcd never bans the member; EtcdConnection moves on.
        member = pyetcd.Endpoint(
            host,
            port,
            secure=tls is not None,
            creds=credentials,
            time_retry=0.0,
            opts=list(GRPC_OPTIONS),
        )
        try:
            client = pyetcd.MultiEndpointEtcd3Client(
                endpoints=[member], timeout=attempt_timeout, user=user, password=password
            )
        except BaseException:
            member.close()
            raise
        if tls is None:
            # grpc refuses call credentials on a plain channel; pyetcd also sends
            # the token as request metadata, which is all etcd reads.
            client.call_credentials = None
        return client

    return connect


def _label(host: str, port: int, secure: bool) -> str:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"https://{address}" if secure else address


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
    config: RendezvousConfig,
    client: Any = None,
    *,
    diagnose: Callable[[], str | None] | None = None,
    on_close: Sequence[Callable[[], None]] = (),
    first_listed: bool = False,
) -> tuple[EtcdBackend, EtcdStore]:
    """Connect to the etcd cluster named by ``config.endpoint`` (one member or a
    comma-separated list, default port 2379), over TLS with ``config.etcd_tls``
    and as ``config.etcd_auth``'s user if set.

    Every call then rides out connection errors for ``config.read_timeout``
    seconds, moving to the next member of the list after each one; a single
    request waits :func:`attempt_timeout` seconds for an answer. The first
    contact is given :func:`connect_bound` seconds.

    Returns the backend and the store handed to the agent (same connection).
    ``diagnose`` and ``on_close`` go to :class:`EtcdBackend` (the embedded etcd's).
    ``first_listed``: use the first member of the list first (a node's own embedded
    member), not a random one.

    Raises:
        ConfigError: a malformed endpoint or endpoint list.
        RendezvousConnectionError: etcd does not answer a status request and a
            read of this run's state within :func:`connect_bound` (TLS,
            authentication and permission failures at once; the message says
            what to check).
    """
    members = parse_endpoints(config.endpoint, DEFAULT_PORT)
    secure = config.etcd_tls is not None
    labels = [_label(host, port, secure) for host, port in members]
    endpoint = ",".join(labels)
    check = _access_check(config)

    bound = connect_bound(config)

    def failed(exc: BaseException) -> RendezvousConnectionError:
        return RendezvousConnectionError(
            describe(
                f"cannot use etcd within {bound:g} s (the smaller of read_timeout and "
                f"join_timeout): {error_text(exc)}",
                run_id=config.settings.run_id,
                endpoint=endpoint,
                check=check,
            )
        )

    if client is None:
        try:
            connect = _connector(members, config, attempt_timeout(config))
        except (OSError, ValueError) as exc:  # an unreadable or malformed PEM file
            raise failed(exc) from exc
        connection = EtcdConnection(labels, connect, first_listed=first_listed)
    else:
        connection = EtcdConnection.around(client, endpoint)
    backend = EtcdBackend(
        connection,
        config.settings.run_id,
        endpoint=endpoint,
        ttl=config.etcd_ttl,
        name=config.backend_name,
        retry_window=config.read_timeout,
        diagnose=diagnose,
        on_close=on_close,
    )
    _check_access(backend, failed, bound)
    return backend, EtcdStore(backend, timedelta(seconds=config.read_timeout))


def _check_access(
    backend: EtcdBackend,
    failed: Callable[[BaseException], RendezvousConnectionError],
    bound: float,
) -> None:
    """Ask for etcd's status and read this run's state key, so that a server that
    does not answer, or refuses this client, fails here (within ``bound``
    seconds) and not mid-rendezvous."""
    state_key = backend.key("state")
    deadline = time.monotonic() + bound

    def by_deadline(request: Callable[[Any], object]) -> Callable[[Any], object]:
        def run(client: Any) -> object:
            # One request may wait an attempt timeout (up to 5 s), longer than a
            # short join_timeout: this contact's requests wait until the deadline
            # at most. Nothing else uses the client yet.
            usual = getattr(client, "timeout", None)
            if isinstance(usual, (int, float)):
                client.timeout = max(0.05, min(usual, deadline - time.monotonic()))
            try:
                return request(client)
            finally:
                if isinstance(usual, (int, float)):
                    client.timeout = usual

        return run

    try:
        backend.call(by_deadline(lambda c: c.status()), retry_window=bound)
        # A status request needs no permission: read this run's key too, so a
        # user without access to the prefix fails here.
        left = deadline - time.monotonic()
        backend.call(by_deadline(lambda c: c.get_response(state_key)), retry_window=left)
    except QuorumLostError:  # it says what is wrong; the access advice would not fit
        backend.close()
        raise
    except RendezvousConnectionError as exc:
        backend.close()
        raise failed(exc.__cause__ or exc) from exc
