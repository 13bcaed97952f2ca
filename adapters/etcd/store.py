"""The per-round torch Store for etcd rendezvous, and the backend factory.

etcd is not a torch ``Store``, so the node of rank 0 hosts a TCPStore server for
each completed round and publishes its ``host:port`` under ``store/<round>``; the
other participants watch that key and connect. The store lives as long as the
rank-0 agent stays in the round, like the workers it serves.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore

from ..config import RendezvousConfig, parse_endpoint
from ..errors import RendezvousConnectionError, describe
from .backend import EtcdBackend

__all__ = ["DEFAULT_PORT", "HostedStoreProvider", "create_etcd_backend"]

#: etcd's default client port.
DEFAULT_PORT = 2379


class HostedStoreProvider:
    """Rank 0 hosts the round's TCPStore and publishes its address in etcd.

    Args:
        backend: the etcd backend of the same run (its client and key namespace).
        timeout: how long a non-zero rank waits for the address, and the store's
            operation timeout.
    """

    def __init__(self, backend: EtcdBackend, timeout: float) -> None:
        self._backend = backend
        self._timeout = timeout
        self._server: TCPStore | None = None

    def store_for_round(self, run_id: str, round: int, rank: int, local_addr: str) -> Store:
        key = self._backend.key(f"store/{round}")
        timeout = timedelta(seconds=self._timeout)
        client: Any = self._backend.client
        if rank == 0:
            # Replace the previous round's server: its workers are gone.
            self._server = None
            try:
                self._server = TCPStore(
                    local_addr, 0, is_master=True, multi_tenant=True, timeout=timeout
                )
            except (RuntimeError, ValueError) as exc:
                raise RendezvousConnectionError(
                    describe(
                        f"cannot host the round store on {local_addr} ({exc})",
                        run_id=run_id,
                        endpoint=self._backend.endpoint,
                        check="that local_addr is an address of this host",
                    )
                ) from exc
            address = f"{local_addr}:{self._server.port}".encode()
            self._backend.call(lambda: client.put(key, address), written=len(key) + len(address))
            store: Store = self._server
        else:
            host, port = parse_endpoint(self._wait_for_address(key, run_id), 0)
            try:
                store = TCPStore(host, port, is_master=False, timeout=timeout)
            except (RuntimeError, ValueError) as exc:
                raise RendezvousConnectionError(
                    describe(
                        f"cannot reach the round store of rank 0 at {host}:{port} ({exc})",
                        run_id=run_id,
                        endpoint=self._backend.endpoint,
                        check="that the rank-0 node is alive and its local_addr is reachable "
                        "from this node",
                    )
                ) from exc
        return PrefixStore(f"rallypoint/{run_id}/round/{round}/", store)

    def _wait_for_address(self, key: str, run_id: str) -> str:
        client: Any = self._backend.client
        deadline = time.monotonic() + self._timeout
        while True:
            response = self._backend.call(lambda: client.get_response(key))
            if response.count > 0:
                return bytes(response.kvs[0].value).decode()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousConnectionError(
                    describe(
                        f"rank 0 did not publish the round store address within {self._timeout} s",
                        run_id=run_id,
                        endpoint=self._backend.endpoint,
                        check="that the rank-0 node is alive (its log shows the round)",
                    )
                )
            self._backend.watch(key, int(response.header.revision) + 1, min(left, 1.0))

    def close(self) -> None:
        self._server = None


def create_etcd_backend(
    config: RendezvousConfig, client: Any = None
) -> tuple[EtcdBackend, HostedStoreProvider]:
    """Connect to the etcd server named by ``config.endpoint`` (default port 2379).

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
    return backend, HostedStoreProvider(backend, config.read_timeout)
