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
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, Store

from ..config import RendezvousConfig, parse_endpoint
from .backend import EtcdBackend

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
        return self._wait_one(key, time.monotonic() + self.timeout.total_seconds())

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        span = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + span
        for key in keys:
            self._wait_one(key, deadline)

    def check(self, keys: list[str]) -> bool:
        return all(self._lookup(key)[0] is not None for key in keys)

    def _swap(self, key: str, update: Any) -> bytes:
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
            ok, _ = self._backend.call(
                lambda c=compare, n=new: self._client.transaction(
                    compare=c, success=[tx.put(full, n)], failure=[]
                ),
                written=len(full) + len(new),
            )
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


def create_etcd_backend(
    config: RendezvousConfig, client: Any = None
) -> tuple[EtcdBackend, EtcdStore]:
    """Connect to the etcd server named by ``config.endpoint`` (default port 2379).

    Returns the backend and the store handed to the agent (same client).

    Raises:
        RendezvousConnectionError: etcd does not answer a status request.
    """
    host, port = parse_endpoint(config.endpoint, DEFAULT_PORT)
    if client is None:
        import pyetcd

        client = pyetcd.client(host, port, timeout=config.read_timeout)
    backend = EtcdBackend(
        client,
        config.settings.run_id,
        endpoint=f"{host}:{port}",
        ttl=config.etcd_ttl,
        name=config.backend_name,
    )
    backend.call(client.status)
    return backend, EtcdStore(backend, timedelta(seconds=config.read_timeout))
