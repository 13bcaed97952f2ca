"""One etcd connection over several cluster members: failover, reconnection, and
which client errors are worth a retry.

pyetcd (etcd-sdk-python) does not survive an outage by itself: after one
``UNAVAILABLE`` it marks its endpoint failed and then refuses every call for five
minutes with ``ValueError: Trying to use a failed node``; it authenticates once, so
a member that restarted (and forgot its tokens) answers ``invalid auth token``
forever; and its gRPC channel backs off for up to two minutes between connection
attempts. :class:`EtcdConnection` keeps one pyetcd client at a time, to one member
of the list it was given, and replaces it after a connection error with a new
client to the *next* member (a new channel, authenticated again), so a killed
member, a leader election or a restarted server are ridden out the same way; a
forgotten token gets a new client to the *same* member (it is up, it only needs a
new login). The backend (:class:`~rallypoint.adapters.etcd.EtcdBackend`) decides
when to retry; this module says what (:func:`classify`) and with which client.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "FATAL",
    "GRPC_OPTIONS",
    "REAUTH",
    "RETRY",
    "EtcdConnection",
    "classify",
    "error_text",
    "grpc_error",
]

#: A client error worth retrying: the member is down, restarting, partitioned, in
#: an election, or the connection was replaced under a call in flight.
RETRY = "retry"
#: The member no longer knows this client's auth token (it restarted, or the auth
#: store changed): authenticate again, then retry.
REAUTH = "reauth"
#: An answer that will not change by asking again (bad credentials, no permission,
#: a request too large, a TLS mismatch): report it at once.
FATAL = "fatal"

#: gRPC channel options: reconnect quickly once a member is back (gRPC's default
#: backoff grows to two minutes between attempts).
GRPC_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

# pyetcd's messages for the states it invents on top of gRPC's.
_FAILED_NODE = "Trying to use a failed node"
_CLOSED_CHANNEL = "closed channel"


def grpc_error(exc: BaseException) -> Any:
    """The ``grpc.RpcError`` behind ``exc`` (pyetcd raises its own exception types
    while handling one), or None."""
    try:
        import grpc
    except ImportError:  # pragma: no cover - grpc comes with pyetcd
        return None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, grpc.RpcError) and callable(getattr(current, "code", None)):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _details(error: Any) -> str:
    try:
        return str(error.details() or "")
    except Exception:  # a message is best effort
        return ""


def error_text(exc: BaseException) -> str:
    """``exc`` for a message: its class and, for a gRPC error (also one pyetcd
    wrapped), etcd's own words (``etcdserver: leader changed``) rather than
    pyetcd's ``etcd connection failed``."""
    error = grpc_error(exc)
    if error is not None:
        details = _details(error)
        if details:
            return f"{exc.__class__.__name__}: {details[:300]}"
    return f"{exc.__class__.__name__}: {str(exc)[:300]}"


def classify(exc: BaseException) -> str | None:
    """What to do about ``exc`` raised by an etcd client call.

    Returns :data:`RETRY`, :data:`REAUTH` or :data:`FATAL` for a client error, and
    None for anything else (a bug or a :class:`RendezvousStateError` raised while
    reading a result: not the client's business).
    """
    try:
        import grpc
        from pyetcd import exceptions as pyetcd_errors
    except ImportError:  # pragma: no cover
        return RETRY if isinstance(exc, (ConnectionError, TimeoutError)) else None
    if isinstance(exc, ValueError) and not isinstance(exc, UnicodeError):
        text = str(exc)
        # pyetcd's five-minute ban of an endpoint, and a call on a client that
        # another thread replaced (and closed) a moment ago.
        if _FAILED_NODE in text or _CLOSED_CHANNEL in text:
            return RETRY
        return None
    if isinstance(exc, pyetcd_errors.RevisionCompactedError):
        return FATAL
    error = grpc_error(exc)
    if error is not None:
        code = error.code()
        details = _details(error).lower()
        if "ssl" in details or "certificate" in details or "handshake" in details:
            return FATAL  # a TLS mismatch: the next attempt fails the same way
        if code == grpc.StatusCode.UNAUTHENTICATED or "auth store is old" in details:
            return REAUTH
        if code in (
            grpc.StatusCode.UNAVAILABLE,  # down, restarting, no leader, leader changed
            grpc.StatusCode.DEADLINE_EXCEEDED,  # a stopped or partitioned member
            grpc.StatusCode.CANCELLED,  # the channel was replaced under the call
            grpc.StatusCode.ABORTED,
            grpc.StatusCode.UNKNOWN,  # a stream torn down with the server
            grpc.StatusCode.INTERNAL,
        ):
            return RETRY
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "too many requests" in details:
            return RETRY
        return FATAL
    if isinstance(
        exc,
        (
            pyetcd_errors.ConnectionFailedError,
            pyetcd_errors.ConnectionTimeoutError,
            pyetcd_errors.InternalServerError,
            pyetcd_errors.NoServerAvailableError,
            pyetcd_errors.WatchTimedOut,
            ConnectionError,
            TimeoutError,
        ),
    ):
        return RETRY
    if isinstance(exc, (pyetcd_errors.Etcd3Exception, grpc.RpcError)):
        return FATAL
    return None


def _reset_failed_marks(client: Any) -> None:
    """Forget pyetcd's "failed" marking of a client's endpoints (its ``Endpoint``
    objects refuse calls for ``time_retry`` seconds, 300 by default)."""
    endpoints = getattr(client, "endpoints", None)
    if isinstance(endpoints, dict):
        for endpoint in endpoints.values():
            if hasattr(endpoint, "last_failed"):
                endpoint.last_failed = 0


class EtcdConnection:
    """The client to use now, for a list of etcd members.

    Args:
        endpoints: the members' ``host:port`` (for messages), in failover order;
            the first client goes to a random member (so the nodes of a job spread
            over the cluster), or to the first with ``first_listed``; each
            replacement goes to the next one in the list.
        connect: builds a client to member ``i`` (authenticating if configured);
            may raise a client error, which the caller classifies.
        client: a ready client instead of ``connect`` (one endpoint; a failure
            only resets pyetcd's failed-endpoint marking on it).

    Thread-safe. A client that failed is replaced once, however many threads saw
    it fail: :meth:`failed` only acts if the client it is given is still current.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        connect: Callable[[int], Any] | None = None,
        *,
        client: Any = None,
        first_listed: bool = False,
    ) -> None:
        if not endpoints:
            raise ValueError("an etcd connection needs at least one endpoint")
        if (connect is None) == (client is None):
            raise ValueError("give either connect or client")
        self._endpoints = tuple(endpoints)
        self._connect = connect
        self._client = client
        self._index = 0 if first_listed else random.randrange(len(self._endpoints))
        self._closed = False
        self._lock = threading.Lock()
        #: how many times a client was replaced or reset
        self.reconnects = 0

    @classmethod
    def around(cls, client: Any, endpoint: str) -> EtcdConnection:
        """A connection that always uses ``client`` (built by the caller)."""
        return cls([endpoint], client=client)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._endpoints

    @property
    def endpoint_in_use(self) -> str:
        """The member the current (or next) client talks to."""
        with self._lock:
            return self._endpoints[self._index]

    @property
    def closed(self) -> bool:
        return self._closed

    def current(self) -> Any:
        """The client to call now; connects to the current member if needed.

        Raises:
            ConnectionError: the connection was closed.
            whatever ``connect`` raises (a client error to classify).
        """
        with self._lock:
            if self._closed:
                raise ConnectionError("the etcd connection was closed")
            if self._client is None:
                assert self._connect is not None
                # Held while connecting: other threads would only connect again.
                self._client = self._connect(self._index)
            return self._client

    def failed(self, client: Any, kind: str) -> None:
        """``client`` (None: connecting failed) raised a client error of ``kind``
        (:func:`classify`): replace it by a client to the next member; a
        :data:`REAUTH` keeps the member and authenticates again."""
        with self._lock:
            if self._closed or client is not self._client:
                # Another thread replaced the client already (or, for a failed
                # connect, connected since): that one is not known to be bad.
                return
            self.reconnects += 1
            if self._connect is None:
                _reset_failed_marks(self._client)
                return
            old, self._client = self._client, None
            if kind != REAUTH:
                self._index = (self._index + 1) % len(self._endpoints)
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()

    def close(self) -> None:
        """Close the current client; every later :meth:`current` raises."""
        with self._lock:
            self._closed = True
            old, self._client = self._client, None
        if old is not None:
            close = getattr(old, "close", None)
            if close is not None:
                close()
