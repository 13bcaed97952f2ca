"""The simulator's options (:class:`SimConfig`) and their validation."""

from __future__ import annotations

from dataclasses import dataclass

from ...core import Settings
from ..options import Rule, check_ranges, check_settings

__all__ = ["SimConfig", "SimConfigError"]


class SimConfigError(ValueError):
    """A simulator option is out of range (the message names it)."""


@dataclass(frozen=True)
class SimConfig:
    """Everything a run depends on. The same config and seed give the same run.

    Rates are per node per simulated minute; times are simulated seconds.
    """

    nodes: int = 8
    min_nodes: int | None = None
    max_nodes: int | None = None
    seed: int = 0
    duration: float = 300.0
    #: nodes first arrive uniformly over [0, arrival_spread]
    arrival_spread: float = 2.0
    # Rendezvous settings (seconds on each node's own clock).
    last_call_timeout: float = 1.0
    join_timeout: float = 600.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    heartbeat_timeout: float = 5.0
    close_timeout: float = 30.0
    # Backend and network.
    latency: float = 0.002
    jitter: float = 0.001
    conflict_rate: float = 0.0
    request_timeout: float = 1.0
    #: a waiting node re-reads at least this often even without a notification
    poll_interval: float = 5.0
    #: a Wait(until) wakes this long (local seconds) past ``until``: a decision
    #: flips strictly after it (StateSync's timer margin)
    wake_epsilon: float = 0.002
    #: the cap of the jittered exponential backoff after lost compare-and-sets
    #: (StateSync's, ``rallypoint.core.dispatch.MAX_BACKOFF``)
    max_backoff: float = 0.05
    #: a training node checks for waiting nodes and lost peers at least this often
    #: (sooner when a phase is published)
    monitor_interval: float = 5.0
    # Clocks: offsets uniform in [-clock_offset, clock_offset] seconds, rates in
    # [1 - drift, 1 + drift].
    clock_offset: float = 0.0
    drift: float = 0.0
    # Faults.
    crash_rate: float = 0.0
    restart_delay: float = 10.0
    partition_rate: float = 0.0
    partition_duration: float = 30.0
    leave_rate: float = 0.0
    #: a training node's workers fail (it charges the restart budget, exits and
    #: joins again), per node per minute
    worker_failure_rate: float = 0.0
    #: a node fails its health check (it excludes itself and joins again as a
    #: spare), per node per minute
    health_failure_rate: float = 0.0
    #: the settings' job-wide restart budget (None: none) and the rounds an
    #: excluded node sits out
    restart_budget: int | None = None
    exclusion_rounds: int = 1
    #: live regroup: a node's new workers (those replacing failed ones, or a
    #: starting node's) take this long to be ready, and the node follows the core's
    #: admission rule meanwhile (out of the rendezvous while the others train on,
    #: or in it). None: the node joins at once (a restart, no newcomers to wait for)
    newcomer_startup: float | None = None
    #: the job's script lets the world shrink while newcomers start
    #: (``live.Job(may_shrink=...)``)
    may_shrink: bool = True
    #: stop with a violation after this many node-steps (a livelock guard)
    max_steps: int | None = None
    #: events kept for a violation's trace
    trace_length: int = 60
    #: encode the state on every write and compare with the incremental size
    verify_bytes: bool = False
    #: check the whole state (check_state, check_transition) every this many
    #: writes; the writes in between are checked on the entries they touched, and
    #: a write that completes, closes or advances a round is always checked whole.
    #: None: every write up to 256 nodes, else every ``nodes // 32`` writes.
    check_every: int | None = None

    def __post_init__(self) -> None:
        check_ranges(self, SimConfigError, _RULES)
        if self.jitter > self.latency:
            raise SimConfigError(f"jitter ({self.jitter}) must not exceed latency ({self.latency})")
        if self.drift >= 0.5:
            raise SimConfigError(f"drift must be below 0.5 (50%), got {self.drift}")
        if self.conflict_rate >= 1:
            raise SimConfigError(f"conflict_rate must be below 1, got {self.conflict_rate}")
        check_settings(self, SimConfigError)

    def settings(self) -> Settings:
        """The rendezvous settings every simulated node uses."""
        return Settings(
            run_id="sim",
            min_nodes=self.min_nodes if self.min_nodes is not None else max(1, self.nodes // 2),
            max_nodes=self.max_nodes if self.max_nodes is not None else self.nodes,
            join_timeout=self.join_timeout,
            last_call_timeout=self.last_call_timeout,
            close_timeout=self.close_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            keep_alive_interval=self.keep_alive_interval,
            keep_alive_max_attempt=self.keep_alive_max_attempt,
            restart_budget=self.restart_budget,
            exclusion_rounds=self.exclusion_rounds,
        )

    def check_interval(self) -> int:
        """Writes from one whole-state check to the next (see ``check_every``)."""
        if self.check_every is not None:
            return self.check_every
        return 1 if self.nodes <= _CHECK_ALL_UP_TO else max(1, self.nodes // 32)


#: The ranges of SimConfig's fields.
_RULES = (
    Rule(("nodes", "check_every"), 1),
    Rule(
        (
            "duration",
            "arrival_spread",
            "latency",
            "jitter",
            "clock_offset",
            "drift",
            "crash_rate",
            "partition_rate",
            "leave_rate",
            "worker_failure_rate",
            "health_failure_rate",
            "conflict_rate",
            "restart_delay",
            "partition_duration",
            "wake_epsilon",
            "max_backoff",
            "newcomer_startup",
        ),
        0,
        finite=True,
    ),
    Rule(("request_timeout", "poll_interval", "monitor_interval"), 0, strict=True),
)
#: Up to this many nodes, every write is checked whole (see SimConfig.check_every).
_CHECK_ALL_UP_TO = 256
