"""The typed launch configuration: everything one agent needs to run a job.

The launcher turns torchrun-style flags into a :class:`LaunchConfig`; the Python
API (:mod:`rallypoint.agent.api`) builds one directly. Validation happens here, in
:meth:`LaunchConfig.__post_init__`, so both paths reject the same bad input with
the same one-line :class:`ConfigError`.
"""

from __future__ import annotations

import enum
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_ROLE",
    "ConfigError",
    "LaunchConfig",
    "Std",
    "parse_std",
]

DEFAULT_ROLE = "default"


class ConfigError(ValueError):
    """A launch option is invalid. The message is one line a user can act on."""


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
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.monitor_interval <= 0:
            raise ConfigError(f"--monitor-interval must be positive, got {self.monitor_interval}")
        if self.stop_grace < 0:
            raise ConfigError(f"--stop-grace must be >= 0, got {self.stop_grace}")
        if not self.run_id:
            raise ConfigError("--rdzv-id must not be empty")
        if not self.role:
            raise ConfigError("--role must not be empty")
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
