"""The typed launch configuration: everything one agent needs to run a job.

The launcher turns torchrun-style flags into a :class:`LaunchConfig`; the Python
API (:mod:`rallypoint.agent.api`) builds one directly. Validation happens here, in
:meth:`LaunchConfig.__post_init__`, so both paths reject the same bad input with
the same one-line :class:`ConfigError`. The checks of the rendezvous (backend
names, endpoints, run ids, hosts, durations) and the error type are
:mod:`rallypoint.adapters.config`'s, which also checks what torchrun hands
rallypoint's handler: the flags' names in the messages are the only difference.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..adapters import config as rdzv_config
from ..adapters import options as rdzv_options
from ..adapters.config import (
    MAX_RUN_ID_LENGTH,
    MAX_SECONDS,
    ConfigError,
    check_host,
    check_seconds,
    format_endpoint,
)
from .health import HealthCheckConfig

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing import LogsSpecs
    from torch.numa.binding import NumaOptions

__all__ = [
    "BACKEND_IMPLEMENTATIONS",
    "DEFAULT_PORT_BY_BACKEND",
    "DEFAULT_ROLE",
    "DEFAULT_SIGNALS_TO_HANDLE",
    "DEFAULT_STOP_GRACE",
    "MAX_NPROC_PER_NODE",
    "MAX_RUN_ID_LENGTH",
    "MAX_SECONDS",
    "MAX_WORLD_SIZE",
    "NUMA_BINDING_MODES",
    "SHUTDOWN_TIMEOUT_ENV",
    "START_METHODS",
    "TORCH_BACKENDS",
    "ConfigError",
    "LaunchConfig",
    "RestartScope",
    "Std",
    "check_host",
    "check_nnodes",
    "check_nproc",
    "check_rdzv_id",
    "check_world_size",
    "numa_command_prefix",
    "parse_rdzv_endpoint",
    "parse_signals",
    "parse_std",
    "rdzv_options_read",
    "render_rdzv_conf_table",
    "sort_rdzv_conf",
]

logger = logging.getLogger("rallypoint.agent")

DEFAULT_ROLE = "default"


def _check_events_file(path: str) -> None:
    """``--events-file`` names a file this agent can append to (checked before the
    rendezvous, so a typo costs no round)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"--events-file {path!r}: is a directory, not a file")
    if not os.path.isdir(folder):
        raise ConfigError(
            f"--events-file {path!r}: cannot open for appending (no directory {folder!r})"
        )
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise ConfigError(f"--events-file {path!r}: cannot open for appending (not writable)")


class RestartScope(enum.Enum):
    """What ``--max-restarts`` counts (``--restart-scope``)."""

    #: each agent its own restarts, as torchrun does
    AGENT = "agent"
    #: the whole job's failure-caused rounds, in the shared state (rallypoint's
    #: rendezvous only; docs/design.md, decision 10)
    JOB = "job"


#: torchrun's ``--signals-to-handle`` default: the signals that stop the agent gracefully.
DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

#: Seconds between SIGTERM and SIGKILL when neither ``--shutdown-timeout`` nor
#: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is given (torch's default is 30).
DEFAULT_STOP_GRACE = 5.0

#: torch reads the shutdown timeout from here when ``shutdown_timeout`` is not given.
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"

#: torchrun's ``--start-method`` choices (accepted; workers are always fresh processes).
START_METHODS = ("spawn", "fork", "forkserver")

#: torchrun's ``--numa-binding`` choices: the values of ``torch.numa.binding.AffinityMode``
#: (a test compares them with the installed torch's).
NUMA_BINDING_MODES = ("node", "socket", "exclusive", "core-complex")

#: Most workers one agent starts. Far above any real node, yet a typo (10**30)
#: fails here instead of exhausting memory in the per-rank tables.
MAX_NPROC_PER_NODE = 4096

#: Largest world size (``--nnodes`` max times ``--nproc-per-node``): ranks and
#: world sizes are 32-bit integers in torch (its stores and process groups).
MAX_WORLD_SIZE = 2**31 - 1

#: The launcher's names for the options of the rendezvous, in messages.
_BACKEND_FLAG = "--rdzv-backend"
_ENDPOINT_FLAG = "--rdzv-endpoint"

#: torch's own handlers, which the launcher also offers: ``torch-<kind>`` for each
#: kind of rallypoint's backends (for comparisons) and ``static``, torchrun's
#: default -> the name torch's handler registry knows each by.
TORCH_BACKENDS: dict[str, str] = {
    **{f"torch-{kind}": kind for kind in sorted(set(rdzv_config.BACKEND_KINDS.values()))},
    "static": "static",
}

#: Accepted ``--rdzv-backend`` values and the implementation behind each:
#: rallypoint's backends (:data:`rallypoint.adapters.config.BACKEND_KINDS`) and torch's.
BACKEND_IMPLEMENTATIONS: dict[str, str] = {
    **dict.fromkeys(rdzv_config.BACKEND_KINDS, "rallypoint"),
    **dict.fromkeys(TORCH_BACKENDS, "torch"),
}

#: Default port when an endpoint names only a host: etcd's, for every etcd backend
#: (rallypoint's and torch's); None: the port is required.
DEFAULT_PORT_BY_BACKEND: dict[str, int | None] = {
    name: rdzv_config.DEFAULT_PORT_BY_KIND["etcd"] if kind == "etcd" else None
    for name, kind in {**rdzv_config.BACKEND_KINDS, **TORCH_BACKENDS}.items()
}


_CONF_FLAG = "--rdzv-conf"

#: The rendezvous options the launcher sets from its own flags
#: (:attr:`rallypoint.adapters.options.Option.flag`): never handed on from
#: ``--rdzv-conf``.
_SET_BY_FLAGS = frozenset(o.name for o in rdzv_options.TABLE if o.flag)

#: Those of them ``--rdzv-conf`` refuses, naming the flag: rallypoint's, which it
#: would override (torchrun has no such keys) -> the flag.
_FLAG_OPTIONS = {o.name: o.flag for o in rdzv_options.TABLE if o.flag and o.flag_refuses}


def rdzv_options_read(backend: str) -> frozenset[str]:
    """The ``--rdzv-conf`` keys the handler of ``backend`` reads: rallypoint's
    (:data:`rallypoint.adapters.config.OPTIONS`) or torch's
    (:func:`rallypoint.adapters.config.torch_options`), less those the launcher
    sets from its flags (``local_addr``: ``--local-addr``, ``rank``: ``--node-rank``...)."""
    if BACKEND_IMPLEMENTATIONS[backend] == "rallypoint":
        read = rdzv_config.backend_options(backend)
    else:
        read = rdzv_config.torch_options(TORCH_BACKENDS[backend])
    return read - _SET_BY_FLAGS


def sort_rdzv_conf(configs: Mapping[str, object], backend: str) -> dict[str, str]:
    """Sort ``--rdzv-conf``'s keys for ``backend``: the rule of
    :func:`rallypoint.adapters.options.check_options`, and a key the launcher sets
    from a flag is refused naming the flag.

    Returns:
        {key: the one-line warning}, for each key ``backend`` ignores.

    Raises:
        ConfigError: a key set from a flag, unknown, or asking for a protection
            ``backend`` cannot give.
    """
    for key, flag in _FLAG_OPTIONS.items():
        if key in configs:
            raise ConfigError(f"{_CONF_FLAG} {key}: give it as {flag}")
    return rdzv_options.check_options(configs, rdzv_options_read(backend), backend, _CONF_FLAG)


#: docs/agent.md's table of ``--rdzv-conf`` keys: the launcher's backends it shows.
_DOCS_BACKENDS = ("c10d", "etcd", "etcd-embedded", "torch-c10d", "torch-etcd", "static")


def _rdzv_conf_outcome(backend: str, key: str, value: str) -> str:
    try:
        return "warning" if sort_rdzv_conf({key: value}, backend) else "read"
    except ConfigError:
        return "refused"


def render_rdzv_conf_table() -> str:
    """docs/agent.md's table of ``--rdzv-conf`` keys, rendered from the options
    table (:data:`rallypoint.adapters.options.TABLE`) by the rule the launcher
    runs (:func:`sort_rdzv_conf`): what each backend does with each key (read, a
    warning, refused) and what the warning says; consecutive keys alike share a row."""
    rows: list[tuple[list[str], list[str], str]] = []
    for opt in rdzv_options.TABLE:
        cells = []
        for backend in _DOCS_BACKENDS:
            cell = _rdzv_conf_outcome(backend, opt.name, "5")
            values = () if isinstance(opt.protects, bool) else sorted(opt.protects)
            refused = [v for v in values if _rdzv_conf_outcome(backend, opt.name, v) == "refused"]
            if refused and cell != "refused":
                cell += ", " + ", ".join(f"refused for `{v}`" for v in refused)
            cells.append(cell)
        # What the warning says (its '<run id>' escaped for markdown).
        readers = rdzv_options.ignored_meaning(opt.name).replace("<", "&lt;")
        if opt.name in _FLAG_OPTIONS:
            readers += f"; give {_FLAG_OPTIONS[opt.name]}"
        if rows and rows[-1][1:] == (cells, readers):
            rows[-1][0].append(opt.name)
        else:
            rows.append(([opt.name], cells, readers))
    misspelt = [_rdzv_conf_outcome(backend, "join_timout", "5") for backend in _DOCS_BACKENDS]
    lines = [
        f"| key | {' | '.join(f'`{b}`' for b in _DOCS_BACKENDS)} | who reads it (what a warning "
        "says) |",
        "|---" * (len(_DOCS_BACKENDS) + 2) + "|",
        *(
            f"| {', '.join(f'`{n}`' for n in names)} | {' | '.join(cells)} | {readers} |"
            for names, cells, readers in rows
        ),
        f"| any other key | {' | '.join(misspelt)} | none (a misspelling: the error names "
        "the closest key) |",
    ]
    return "\n".join(lines) + "\n"


def parse_rdzv_endpoint(endpoint: str, backend: str) -> tuple[str, int]:
    """``--rdzv-endpoint`` for ``backend``: ``host:port`` (IPv6 as ``[::1]:port``),
    with the backend's default port filled in (:data:`DEFAULT_PORT_BY_BACKEND`).

    rallypoint's etcd backends (``etcd``, ``rallypoint-etcd``) also take the
    members of one etcd cluster, comma-separated (``h1:2379,h2:2379,h3:2379``):
    each member is checked and the first is returned; the backend gets the list
    as given and fails over along it. Every other backend takes one endpoint.
    The rules are :func:`rallypoint.adapters.config.parse_backend_endpoint`'s.

    Raises:
        ConfigError: empty or malformed host, missing port where the backend has no
            default, or a port that is not a decimal integer in 0..65535; a list
            for a backend that takes one endpoint, an empty list entry, or a
            member named twice.
    """
    return _rdzv_members(endpoint, backend)[0]


def _rdzv_members(endpoint: str, backend: str) -> list[tuple[str, int]]:
    """``--rdzv-endpoint``'s members (one, but for an etcd cluster's list)."""
    return rdzv_config.parse_backend_endpoint(
        endpoint, backend, DEFAULT_PORT_BY_BACKEND.get(backend), option=_ENDPOINT_FLAG
    )


def check_rdzv_id(run_id: str) -> None:
    """Refuse a ``--rdzv-id`` that would break the store's key layout or the log
    directory (:func:`rallypoint.adapters.config.check_run_id`).

    Raises:
        ConfigError: the id is empty, too long, or has a ``/`` or a control character.
    """
    rdzv_config.check_run_id(run_id, "--rdzv-id")


def check_nnodes(min_nodes: int, max_nodes: int) -> None:
    """Refuse a ``--nnodes MIN:MAX`` no round can have.

    Raises:
        ConfigError: the minimum is below 1 or above the maximum.
    """
    if min_nodes < 1:
        raise ConfigError(f"--nnodes: the minimum must be at least 1, got {min_nodes}")
    if min_nodes > max_nodes:
        raise ConfigError(
            f"--nnodes {min_nodes}:{max_nodes}: the minimum is larger than the maximum"
        )


def check_world_size(max_nodes: int, nproc: int) -> None:
    """Refuse a ``--nnodes`` whose largest world size torch cannot hold
    (:data:`MAX_WORLD_SIZE`): torch's static store failed with a dump of its
    binding's arguments.

    Raises:
        ConfigError: naming the largest ``--nnodes`` for ``nproc`` workers per node.
    """
    if max_nodes * nproc > MAX_WORLD_SIZE:
        raise ConfigError(
            f"--nnodes {max_nodes}: with {nproc} worker(s) per node the world size would "
            f"exceed {MAX_WORLD_SIZE} (torch's largest); at most {MAX_WORLD_SIZE // nproc} nodes"
        )


def check_nproc(nproc: int) -> None:
    """Refuse a ``--nproc-per-node`` out of 1..:data:`MAX_NPROC_PER_NODE`.

    Raises:
        ConfigError: naming the accepted range.
    """
    if not 1 <= nproc <= MAX_NPROC_PER_NODE:
        raise ConfigError(
            f"--nproc-per-node must be at least 1 and at most {MAX_NPROC_PER_NODE}, got {nproc}"
        )


_UNCATCHABLE = frozenset({"SIGKILL", "SIGSTOP"})


def parse_signals(text: str, option: str = "--signals-to-handle") -> tuple[signal.Signals, ...]:
    """Parse torchrun's comma-separated signal names (``SIGTERM,SIGUSR1``).

    An empty value handles no signal at all.

    Raises:
        ConfigError: a name that is not a signal of this platform, or SIGKILL/SIGSTOP,
            which no process can catch.
    """
    found: list[signal.Signals] = []
    for name in (part.strip() for part in text.split(",")):
        if not name:
            continue
        member = signal.Signals.__members__.get(name)
        if member is None:
            raise ConfigError(
                f"{option} {text!r}: {name!r} is not a signal name "
                "(expected names like SIGTERM,SIGUSR1)"
            )
        if name in _UNCATCHABLE:
            raise ConfigError(f"{option} {text!r}: {name} cannot be caught by any process")
        if member not in found:
            found.append(member)
    return tuple(found)


def _cpu_ranges(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (numactl's CPU list syntax)."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    start = 0
    for index in range(1, len(ordered) + 1):
        if index == len(ordered) or ordered[index] != ordered[index - 1] + 1:
            first, last = ordered[start], ordered[index - 1]
            parts.append(str(first) if first == last else f"{first}-{last}")
            start = index
    return ",".join(parts)


def numa_command_prefix(options: NumaOptions, gpu_index: int) -> tuple[str, ...]:
    """The ``numactl --physcpubind=CPUS`` that torchrun puts before a worker's command.

    The CPUs come from torch's own topology code (``torch.numa.binding``) for
    ``options.affinity_mode`` and the device ``gpu_index`` (the local rank, as in
    torch), so the binding is torch's. With ``should_fall_back_if_binding_fails``
    a failure means no binding (empty prefix), as in torch.

    Raises:
        ConfigError: the binding cannot be computed on this machine (no CUDA device,
            no NUMA information in sysfs, no ``numactl``).
    """
    mode = getattr(options.affinity_mode, "value", options.affinity_mode)
    try:
        from torch.numa import binding

        compute = getattr(binding, "_get_validated_logical_cpus_to_bind_to", None)
        if compute is None:
            raise RuntimeError("this torch has no NUMA binding support")
        cpus = compute(gpu_index=gpu_index, numa_options=options)
    except Exception as exc:
        if options.should_fall_back_if_binding_fails:
            logger.warning(
                "--numa-binding %s: local rank %d runs unbound (%s: %s)",
                mode,
                gpu_index,
                type(exc).__name__,
                exc,
            )
            return ()
        raise ConfigError(
            f"--numa-binding {mode}: cannot bind local rank {gpu_index} to the CPUs near "
            f"device {gpu_index} ({type(exc).__name__}: {exc}); it needs a CUDA device per "
            "local rank, NUMA information in /sys and numactl"
        ) from None
    return ("numactl", f"--physcpubind={_cpu_ranges(sorted(cpus))}")


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
        run_id: the job id every agent of the job shares (``--rdzv-id``); empty: a
            random one, as torch generates.
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
        start_method: torch's multiprocessing start method (``spawn``, ``fork``,
            ``forkserver``): checked and accepted; workers are always fresh processes.
        log_line_prefix_template: the console prefix of teed lines, a
            ``string.Template`` with ``${role_name}``, ``${rank}`` and ``${local_rank}``
            (None: torch's ``[${role_name}${local_rank}]:``).
        event_log_handler: where torch's agent events go (``null``, ``console``, or any
            name registered in ``torch.distributed.elastic.events.handlers``).
        numa_options: bind each worker to the CPUs near the device of its local rank,
            as torch does (``torch.numa.binding.NumaOptions``; None: no binding).
        signals_to_handle: the signals (``SIGTERM,SIGUSR1``) on which the agent stops
            its workers and leaves; exported to workers as
            ``TORCHELASTIC_SIGNALS_TO_HANDLE``.
        duplicate_stdout_filters: teed stdout lines containing any of these strings are
            also written, prefixed, to the attempt's ``filtered_stdout.log``.
        duplicate_stderr_filters: the same for stderr (``filtered_stderr.log``).
        virtual_local_rank: every worker gets ``LOCAL_RANK=0`` and sees only its own
            device (``CUDA_VISIBLE_DEVICES``), as torch does.
        shutdown_timeout: torch's name for ``stop_grace``; when given (or when
            ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is set and ``stop_grace`` is left at its
            default) it sets ``stop_grace``.
        logs_specs: a torch ``LogsSpecs`` deciding where each worker's output and error
            file go (``--logs-specs``); None: rallypoint's private log directory.
        restart_scope: whether ``max_restarts`` counts this agent's restarts
            (torchrun's rule) or the whole job's (``--restart-scope job``).
        exclusion_rounds: how many rounds a node that excluded itself sits out,
            standing by as a spare (``--exclusion-rounds``; every node the same).
        exclude_after: a node whose workers fail this many times within
            ``exclude_window`` seconds excludes itself (0: never).
        exclude_window: see ``exclude_after``.
        health_check: the pre-flight check before each round's workers start
            (``--health-check``); a node failing it excludes itself.
        events_file: where rallypoint's structured events go, as JSON lines
            (``--events-file``; None: logging only).
        live: live regroup (``--live``): on a membership change, workers that use
            :mod:`rallypoint.agent.worker.live` keep running and are handed the new round;
            only workers that are gone are started again.
        live_timeout: seconds a live worker has to take a new round before it is
            stopped and started again (``--live-timeout``).
        progress_timeout: seconds a live worker may go without committing a step
            before it counts as failed (``--progress-timeout``; 0: never).
        live_spare: with ``live``, keep one warm spare process per node (torch
            imported) to take a lost worker's place (``--no-live-spare``: none).
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
    stop_grace: float = DEFAULT_STOP_GRACE
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
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    event_log_handler: str = "null"
    numa_options: NumaOptions | None = None
    signals_to_handle: str = DEFAULT_SIGNALS_TO_HANDLE
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: float | None = None
    logs_specs: LogsSpecs | None = None
    restart_scope: RestartScope = RestartScope.AGENT
    exclusion_rounds: int = 1
    exclude_after: int = 0
    exclude_window: float = 600.0
    health_check: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    events_file: str | None = None
    live: bool = False
    live_timeout: float = 30.0
    progress_timeout: float = 0.0
    live_spare: bool = True
    #: ``signals_to_handle`` parsed (set by validation).
    stop_signals: tuple[signal.Signals, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if not self.run_id:
            # torch's rule for an empty run id (its launch_agent).
            self.run_id = str(uuid.uuid4().int)
            logger.warning("no run id given: using the random run id %s", self.run_id)
        if self.start_method not in START_METHODS:
            raise ConfigError(
                f"--start-method {self.start_method!r}: expected one of {', '.join(START_METHODS)}"
            )
        self.stop_signals = parse_signals(self.signals_to_handle)
        self._resolve_shutdown_timeout()
        self.duplicate_stdout_filters = list(self.duplicate_stdout_filters or [])
        self.duplicate_stderr_filters = list(self.duplicate_stderr_filters or [])
        check_nnodes(self.min_nodes, self.max_nodes)
        check_nproc(self.nproc_per_node)
        check_world_size(self.max_nodes, self.nproc_per_node)
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        check_seconds(self.monitor_interval, "--monitor-interval")
        check_seconds(self.exit_barrier_timeout, "--exit-barrier-timeout", allow_zero=True)
        check_rdzv_id(self.run_id)
        if not self.role:
            raise ConfigError("--role must not be empty")
        self._check_rendezvous()
        self._check_recovery()
        self._check_devices()
        self._check_torch_options()

    def _check_recovery(self) -> None:
        """The job-wide budget, exclusions and the health check: their values, and
        that the rendezvous keeps them (rallypoint's; torch's cannot)."""
        try:
            self.restart_scope = RestartScope(self.restart_scope)
        except ValueError:
            raise ConfigError(
                f"--restart-scope {self.restart_scope!r}: expected agent or job"
            ) from None
        for value, flag, low in (
            (self.exclusion_rounds, "--exclusion-rounds", 1),
            (self.exclude_after, "--exclude-after", 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{flag} must be an integer >= {low}, got {value!r}")
        check_seconds(self.exclude_window, "--exclude-window")
        check_seconds(self.live_timeout, "--live-timeout")
        check_seconds(self.progress_timeout, "--progress-timeout", allow_zero=True)
        if self.events_file is not None:
            _check_events_file(self.events_file)
        if not isinstance(self.health_check, HealthCheckConfig):
            raise ConfigError("health_check must be a HealthCheckConfig")
        wanted = [
            flag
            for flag, used in (
                ("--restart-scope job", self.restart_scope is RestartScope.JOB),
                ("--exclude-after", self.exclude_after > 0),
                ("--health-check", self.health_check.enabled),
                ("--live", self.live),
            )
            if used
        ]
        if wanted and BACKEND_IMPLEMENTATIONS[self.rdzv_backend] != "rallypoint":
            raise ConfigError(
                f"{', '.join(wanted)} needs rallypoint's rendezvous (--rdzv-backend c10d, "
                f"etcd or etcd-embedded), which keeps restarts and exclusions in the shared "
                f"state; "
                f"{self.rdzv_backend} cannot"
            )

    def shared_recovery_settings(self) -> dict[str, object]:
        """The rendezvous settings every node of the job must agree on that come
        from the launcher's flags: the job-wide restart budget and the length of
        an exclusion."""
        budget = self.max_restarts if self.restart_scope is RestartScope.JOB else None
        return {"restart_budget": budget, "exclusion_rounds": self.exclusion_rounds}

    def _check_rendezvous(self) -> None:
        """The backend, its endpoint and options, and the addresses; the endpoint's
        presence is checked where it is used (:meth:`rendezvous_endpoint`): a
        config whose handler is built elsewhere needs none."""
        rdzv_config.check_backend(self.rdzv_backend, BACKEND_IMPLEMENTATIONS, _BACKEND_FLAG)
        if self.rdzv_endpoint.strip():
            parse_rdzv_endpoint(self.rdzv_endpoint, self.rdzv_backend)
        self._check_rdzv_configs()
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port must be between 0 and 65535, got {self.master_port}")
        check_host(self.master_addr, "--master-addr")
        if self.local_addr is not None:
            check_host(self.local_addr, "--local-addr")
        if self.is_static and self.min_nodes != self.max_nodes:
            raise ConfigError(
                "the static backend needs a fixed --nnodes N (use c10d or etcd to be elastic)"
            )
        if self.is_static and not 0 <= self.node_rank < self.max_nodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is out of range 0..{self.max_nodes - 1}"
            )

    def _check_rdzv_configs(self) -> None:
        """``--rdzv-conf``'s keys (their values: when the handler is built). One
        torchrun accepts but this backend does not read is dropped with a warning
        (:func:`sort_rdzv_conf`)."""
        for note in sort_rdzv_conf(self.rdzv_configs, self.rdzv_backend).values():
            logger.warning("%s", note)

    def _check_devices(self) -> None:
        if self.bind_gpus and len(self.visible_devices) < self.nproc_per_node:
            raise ConfigError(
                f"binding GPUs needs one device per local rank: {self.nproc_per_node} "
                f"workers but {len(self.visible_devices)} visible devices"
            )
        if self.virtual_local_rank:
            visible = self._visible_devices_env()
            if visible is not None and len(visible.split(",")) < self.nproc_per_node:
                raise ConfigError(
                    f"--virtual-local-rank: {self.nproc_per_node} workers but "
                    f"CUDA_VISIBLE_DEVICES={visible} names fewer devices"
                )

    def rendezvous_endpoint(self) -> str:
        """The endpoint the rendezvous handler gets.

        The static backend: ``--rdzv-endpoint``, else ``--master-addr:--master-port``
        (torchrun's rule). A standalone agent: ``127.0.0.1:0`` (it hosts the store
        on a free port). Every other: ``--rdzv-endpoint`` with the backend's
        default port filled in; an etcd member list as given (each member checked).

        Raises:
            ConfigError: no ``--rdzv-endpoint`` where the backend needs one.
        """
        return self._store()[0]

    def _store(self) -> tuple[str, list[tuple[str, int]], str]:
        """The store the handler reaches: (its endpoint, as :meth:`rendezvous_endpoint`
        says; its members (host, port); the option that names their hosts)."""
        given = self.rdzv_endpoint.strip()
        if self.is_static and not given:
            member = (self.master_addr, self.master_port)
            return format_endpoint(*member), [member], "--master-addr"
        if self.standalone and not self.is_static:
            return "127.0.0.1:0", [("127.0.0.1", 0)], "--standalone"
        if not given:
            raise ConfigError(
                f"{_ENDPOINT_FLAG} is required for the {self.rdzv_backend} backend "
                "(or use --standalone for a single node)"
            )
        members = _rdzv_members(self.rdzv_endpoint, self.rdzv_backend)
        # An etcd cluster's members go as given (each was checked on construction).
        endpoint = self.rdzv_endpoint if "," in given else format_endpoint(*members[0])
        return endpoint, members, f"{_ENDPOINT_FLAG} host"

    def check_endpoint_resolves(self) -> None:
        """Refuse a store host name the resolver says does not exist: the
        endpoint's (an etcd list: when none of its members' does), or the static
        store's ``--master-addr``. Store clients retry such a name for their
        whole timeout (:func:`rallypoint.adapters.config.check_resolves`).

        Raises:
            ConfigError: naming the flag and the host.
        """
        if self.standalone or str(self.rdzv_configs.get("store_type", "")).strip() == "file":
            return
        _, members, option = self._store()
        rdzv_config.check_resolves([host for host, _ in members], option)

    def _resolve_shutdown_timeout(self) -> None:
        check_seconds(self.stop_grace, "--stop-grace", allow_zero=True)
        timeout, option = self.shutdown_timeout, "--shutdown-timeout"
        if timeout is None and self.stop_grace == DEFAULT_STOP_GRACE:
            text = os.environ.get(SHUTDOWN_TIMEOUT_ENV)
            if text is not None:
                option = SHUTDOWN_TIMEOUT_ENV
                try:
                    timeout = float(int(text))
                except ValueError:
                    raise ConfigError(
                        f"{SHUTDOWN_TIMEOUT_ENV}={text!r}: expected whole seconds"
                    ) from None
        if timeout is not None:
            check_seconds(float(timeout), option, allow_zero=True)
            self.stop_grace = float(timeout)

    def _check_torch_options(self) -> None:
        # Only options that name torch objects import torch (the launcher reports
        # other bad input before torch loads).
        if self.event_log_handler != "null":
            from torch.distributed.elastic.events import handlers

            try:
                handlers.get_logging_handler(self.event_log_handler)
            except KeyError:
                known = ", ".join(sorted(getattr(handlers, "_log_handlers", {}))) or "null"
                raise ConfigError(
                    f"--event-log-handler {self.event_log_handler!r}: unknown; "
                    f"torch's registered handlers are {known}"
                ) from None
        if self.logs_specs is not None:
            from torch.distributed.elastic.multiprocessing import LogsSpecs

            if not isinstance(self.logs_specs, LogsSpecs):
                raise ConfigError(
                    f"logs_specs must be a torch LogsSpecs, got {type(self.logs_specs).__name__}"
                )
        if self.numa_options is not None:
            for local_rank in range(self.nproc_per_node):
                numa_command_prefix(self.numa_options, local_rank)

    def _visible_devices_env(self) -> str | None:
        return self.env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))

    def virtual_device(self, local_rank: int) -> str:
        """``CUDA_VISIBLE_DEVICES`` for ``local_rank`` under ``virtual_local_rank``.

        torch's rule: the local rank's entry of the agent's ``CUDA_VISIBLE_DEVICES``,
        or the local rank itself when that is unset (``--bind-gpus``' devices first).
        """
        if self.bind_gpus:
            return self.visible_devices[local_rank]
        visible = self._visible_devices_env()
        if visible is not None:
            return visible.split(",")[local_rank].strip()
        return str(local_rank)

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
