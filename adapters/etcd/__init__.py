"""rallypoint.adapters.etcd: the rendezvous state in etcd v3 (one member or a cluster,
with failover; or members the agents run themselves, :mod:`.embedded`), and test
servers."""

from .backend import EtcdBackend
from .client import EtcdConnection
from .server import (
    EtcdCluster,
    EtcdServer,
    EtcdServerError,
    EtcdServerTLS,
    find_etcd_binary,
    free_port,
)
from .store import DEFAULT_PORT, EtcdStore, create_etcd_backend

__all__ = [
    "DEFAULT_PORT",
    "EtcdBackend",
    "EtcdCluster",
    "EtcdConnection",
    "EtcdServer",
    "EtcdServerError",
    "EtcdServerTLS",
    "EtcdStore",
    "create_etcd_backend",
    "find_etcd_binary",
    "free_port",
]
