"""rallypoint.adapters.etcd: the rendezvous state in etcd v3, and a test server."""

from .backend import EtcdBackend
from .server import EtcdServer, EtcdServerError, EtcdServerTLS, find_etcd_binary, free_port
from .store import DEFAULT_PORT, EtcdStore, create_etcd_backend

__all__ = [
    "DEFAULT_PORT",
    "EtcdBackend",
    "EtcdServer",
    "EtcdServerError",
    "EtcdServerTLS",
    "EtcdStore",
    "create_etcd_backend",
    "find_etcd_binary",
    "free_port",
]
