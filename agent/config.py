"""The typed launch configuration: everything one agent needs to run a job.

The launcher turns torchrun-style flags into a :class:`LaunchConfig`; the Python
API (:mod:`rallypoint.agent.api`) builds one directly. Validation happens here, in
:meth:`LaunchConfig.__post_init__`, so both paths reject the same bad input with
the same one-line :class:`ConfigError`.
"""

from __future__ import annotations

import enum
import ipaddress
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "BACKENDS",
    "DEFAULT_PORTS",
    "DEFAULT_ROLE",
    "MAX_NPROC_PER_NODE",
    "MAX_RUN_ID_LENGTH",
    "MAX_SECONDS",
    "ConfigError",
    "LaunchConfig",
    "Std",
    "check_host",
    "check_run_id",
    "parse_endpoint",
    "parse_std",
]

DEFAULT_ROLE = "default"

#: Most workers one agent starts. Far above any real node, yet a typo (10**30)
#: fails here instead of exhausting memory in the per-rank tables.
MAX_NPROC_PER_NODE = 4096

#: Longest duration a seconds option takes (a week): longer ones overflow the
#: store client's timeouts, and nobody means them.
MAX_SECONDS = 7 * 24 * 3600.0

#: Longest ``--rdzv-id``: it prefixes every store key, so a pasted blob would
#: make every key as large.
MAX_RUN_ID_LENGTH = 255

#: Accepted ``--rdzv-backend`` values and the implementation behind each.
BACKENDS: dict[str, str] = {
    "c10d": "rallypoint",
    "etcd": "rallypoint",
    "rallypoint-c10d": "rallypoint",
    "rallypoint-etcd": "rallypoint",
    "torch-c10d": "torch",
    "torch-etcd": "torch",
    "static": "torch",
}

#: Default port when an endpoint names only a host (None: the port is required).
DEFAULT_PORTS: dict[str, int | None] = {
    "c10d": None,
    "rallypoint-c10d": None,
    "torch-c10d": None,
    "etcd": 2379,
    "rallypoint-etcd": 2379,
    "torch-etcd": 2379,
    "static": None,
}

# A DNS name or an IPv4 address: dot-separated labels of letters, digits, '-' and
# '_' (underscores appear in container and cluster host names).
_HOST_LABEL = re.compile(r"[A-Za-z0-9_-]{1,63}")
_PORT = re.compile(r"[0-9]{1,5}")


class ConfigError(ValueError):
    """A launch option is invalid. The message is one line a user can act on."""


def check_host(host: str, option: str) -> str:
    """Return ``host`` if it is a host name, an IPv4 or an IPv6 address.

    A malformed host (a space, a stray ``:``) would otherwise reach the resolver
    and the store client, which retry it for a minute before failing.

    Raises:
        ConfigError: naming ``option`` and the accepted forms.
    """
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{option} {host!r}: not a valid IPv6 address") from None
        return host
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ConfigError(
            f"{option} {host!r}: expected a host name (letters, digits, '-', '_' "
            "between dots), an IPv4 address or an IPv6 address"
        )
    return host


def parse_endpoint(endpoint: str, backend: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:port``); fill a backend's default port.

    Raises:
        ConfigError: empty or malformed host, missing port where the backend has no
            default, or a port that is not a decimal integer in 0..65535.
    """
    option = "--rdzv-endpoint"
    text = endpoint.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ConfigError(f"{option} {endpoint!r}: missing ']' after the IPv6 host")
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{option} {endpoint!r}: expected [IPv6]:PORT")
        port_text = rest[1:]
    elif text.count(":") > 1:
        raise ConfigError(
            f"{option} {endpoint!r}: expected HOST:PORT with one ':' "
            "(an IPv6 address goes in brackets, [::1]:29400)"
        )
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ConfigError(f"{option} {endpoint!r}: missing host (expected host:port)")
    check_host(host, f"{option} {endpoint!r}: host")
    if not port_text:
        default = DEFAULT_PORTS.get(backend)
        if default is None:
            raise ConfigError(f"{option} {endpoint!r}: the {backend} backend needs host:port")
        return host, default
    if not _PORT.fullmatch(port_text):
        raise ConfigError(f"{option} {endpoint!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise ConfigError(f"{option} {endpoint!r}: port {port} is out of range 0..65535")
    return host, port


def _check_seconds(value: float, option: str, *, allow_zero: bool) -> None:
    if allow_zero:
        ok, accepted = value >= 0, f"between 0 and {MAX_SECONDS:.0f} seconds"
    else:
        ok, accepted = value > 0, f"more than 0 and at most {MAX_SECONDS:.0f} seconds"
    # NaN fails every comparison, infinity the upper bound.
    if not (ok and value <= MAX_SECONDS):
        raise ConfigError(f"{option} must be {accepted}, got {value}")


def check_run_id(run_id: str) -> None:
    """Reject a run id that would break the store's key layout or the log directory.

    Keys live under ``rallypoint/<run_id>/``: a ``/`` in one run id can reach into
    another run's keys.

    Raises:
        ConfigError: the id is empty, too long, or has a ``/`` or a control character.
    """
    if not run_id:
        raise ConfigError("--rdzv-id must not be empty")
    if len(run_id) > MAX_RUN_ID_LENGTH:
        raise ConfigError(
            f"--rdzv-id must be at most {MAX_RUN_ID_LENGTH} characters, got {len(run_id)}"
        )
    if "/" in run_id or not run_id.isprintable():
        raise ConfigError(f"--rdzv-id {run_id!r}: must not contain '/' or control characters")


class Std(enum.IntFlag):
    """Which of a worker's streams are redirected or teed (torchrun's 0..3)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


def _std(text: str) -> Std:
    number = int(text)
    if not 0 <= number <= 3:
        raise ValueError(number)
    return Std(number)


def parse_std(value: str, nprocs: int, flag: str) -> dict[int, Std]:
    """Parse torchrun's ``-r``/``-t`` value: ``3`` for every local rank or ``0:1,1:2``.

    Raises:
        ConfigError: the value is neither form, or names a local rank out of range.
    """
    value = value.strip()
    try:
        if not value:
            return dict.fromkeys(range(nprocs), Std.NONE)
        if ":" not in value:
            std = _std(value)
            return dict.fromkeys(range(nprocs), std)
        result = dict.fromkeys(range(nprocs), Std.NONE)
        for item in value.split(","):
            rank_text, _, std_text = item.partition(":")
            rank = int(rank_text)
            if not 0 <= rank < nprocs:
                raise ConfigError(
                    f"{flag} {value!r}: local rank {rank} is out of range 0..{nprocs - 1}"
                )
            result[rank] = _std(std_text)
        return result
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(
            f"{flag} {value!r}: expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) "
            "or a per-local-rank map like 0:1,1:2"
        ) from None


@dataclass
class LaunchConfig:
    """One agent's configuration (the meaning of every field follows torchrun).

    Attributes:
        min_nodes: fewest agents a round may have (``--nnodes MIN:MAX``).
        max_nodes: most agents a round may have.
        nproc_per_node: workers this agent starts (already resolved from gpu/cpu/auto).
        run_id: the job id every agent of the job shares (``--rdzv-id``).
        rdzv_backend: ``c10d``, ``etcd`` (rallypoint's handler), ``torch-c10d``,
            ``torch-etcd`` (torch's handler, for comparison) or ``static``.
        rdzv_endpoint: ``host:port`` of the backend ('' for standalone).
        rdzv_configs: extra backend options (``--rdzv-conf``).
        role: the worker role name (``--role``).
        max_restarts: local failures this agent may restart before giving up.
        monitor_interval: seconds between two looks at the workers.
        stop_grace: seconds between SIGTERM and SIGKILL when stopping workers.
        exit_barrier_timeout: seconds a finished agent waits for the others.
        log_dir: where per-attempt, per-rank logs and error files go (None: a temp dir).
        redirects: per local rank, which streams go only to the log files.
        tee: per local rank, which streams go to the log files and the console.
        local_ranks_filter: local ranks whose output reaches the console (None: all).
        node_rank: this node's rank, only for the static backend.
        master_addr: the static backend's store host.
        master_port: the static backend's store port.
        local_addr: the address other nodes reach this one at (None: the fqdn).
        bind_gpus: set CUDA_VISIBLE_DEVICES to one device per local rank.
        visible_devices: the device ids ``bind_gpus`` hands out, in local-rank order.
        env: extra environment for every worker.
        standalone: whether this agent hosts an embedded c10d store on a free port.
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    run_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""
    rdzv_configs: dict[str, str] = field(default_factory=dict)
    role: str = DEFAULT_ROLE
    max_restarts: int = 0
    monitor_interval: float = 0.1
    stop_grace: float = 5.0
    exit_barrier_timeout: float = 300.0
    log_dir: str | None = None
    redirects: Mapping[int, Std] = field(default_factory=dict)
    tee: Mapping[int, Std] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    local_addr: str | None = None
    bind_gpus: bool = False
    visible_devices: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    standalone: bool = False

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ConfigError(f"--nnodes: the minimum must be at least 1, got {self.min_nodes}")
        if self.min_nodes > self.max_nodes:
            raise ConfigError(
                f"--nnodes {self.min_nodes}:{self.max_nodes}: "
                "the minimum is larger than the maximum"
            )
        if not 1 <= self.nproc_per_node <= MAX_NPROC_PER_NODE:
            raise ConfigError(
                f"--nproc-per-node must be at least 1 and at most {MAX_NPROC_PER_NODE}, "
                f"got {self.nproc_per_node}"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        _check_seconds(self.monitor_interval, "--monitor-interval", allow_zero=False)
        _check_seconds(self.stop_grace, "--stop-grace", allow_zero=True)
        _check_seconds(self.exit_barrier_timeout, "--exit-barrier-timeout", allow_zero=True)
        check_run_id(self.run_id)
        if not self.role:
            raise ConfigError("--role must not be empty")
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port must be between 0 and 65535, got {self.master_port}")
        check_host(self.master_addr, "--master-addr")
        if self.local_addr is not None:
            check_host(self.local_addr, "--local-addr")
        if self.rdzv_backend == "static" and self.min_nodes != self.max_nodes:
            raise ConfigError(
                "the static backend needs a fixed --nnodes N (use c10d or etcd to be elastic)"
            )
        if self.rdzv_backend == "static" and not 0 <= self.node_rank < self.max_nodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is out of range 0..{self.max_nodes - 1}"
            )
        if self.bind_gpus and len(self.visible_devices) < self.nproc_per_node:
            raise ConfigError(
                f"binding GPUs needs one device per local rank: {self.nproc_per_node} "
                f"workers but {len(self.visible_devices)} visible devices"
            )

    @property
    def is_static(self) -> bool:
        """Whether the job uses torch's fixed-membership static rendezvous."""
        return self.rdzv_backend == "static"

    def worker_base_env(self) -> dict[str, str]:
        """The environment every worker starts from: the agent's own plus ``env``."""
        base = dict(os.environ)
        for name in base.pop("RALLYPOINT_AGENT_ONLY_ENV", "").split(","):
            base.pop(name, None)
        base.update(self.env)
        return base
