"""A simulator run's report: per-node traffic (:class:`NodeStats`), completed
rounds (:class:`RoundStat`), what each node's join returned (:class:`JoinReturn`),
violations with their traces (:class:`SimViolation`), and the report with its
rendering (:class:`SimReport`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core import Membership, NodeDesc
from .config import SimConfig

__all__ = ["JoinReturn", "NodeStats", "RoundStat", "SimReport", "SimViolation"]


@dataclass
class NodeStats:
    """Backend traffic and work of one node slot (all its incarnations)."""

    steps: int = 0
    #: read requests (state reads, counter reads and intent-log reads alike)
    reads: int = 0
    #: reads that fetched a round's intent log
    intent_reads: int = 0
    writes: int = 0
    conflicts: int = 0
    #: appends to an intent log (joiners whose compare-and-set lost)
    announces: int = 0
    #: phase notifications received (a Wait's or the monitor's watch)
    notifications: int = 0
    #: waits ended, by a notification or a timer (driver Waits and monitor waits)
    wakeups: int = 0
    timeouts: int = 0
    #: side heartbeat counter bumps (keep-alives of members, and registrations)
    beats: int = 0
    bytes_read: int = 0
    #: state writes, published phases, announces and beats (the beats' share is
    #: ``beat_bytes``)
    bytes_written: int = 0
    beat_bytes: int = 0


@dataclass(frozen=True)
class RoundStat:
    """One completed round: when its first participant joined and when its last
    member returned (simulated seconds), and its size."""

    round: int
    size: int
    opened: float
    completed: float

    @property
    def duration(self) -> float:
        return self.completed - self.opened


@dataclass(frozen=True)
class JoinReturn:
    """One node's join returned: ``joined`` is what it was told (the core's
    :class:`~rallypoint.core.Membership`: round, rank, world size and the round's
    node -> rank map, shared by the round's returns, not copied), as the handler
    hands it to the agent; ``time`` when (simulated seconds); ``slot`` the node's
    index in the run (0 .. ``config.nodes - 1``); ``node`` the process (a slot
    restarted after a crash is a new process, with a new pid)."""

    time: float
    slot: int
    node: NodeDesc
    joined: Membership


@dataclass(frozen=True)
class SimViolation:
    """A broken property, when (simulated time) and the events that led to it."""

    time: float
    problems: tuple[str, ...]
    trace: tuple[str, ...]

    def format(self) -> str:
        lines = [f"VIOLATION at t={self.time:.6f}:", *(f"  - {p}" for p in self.problems)]
        lines.append("last events:")
        lines += [f"  {line}" for line in self.trace]
        return "\n".join(lines)


@dataclass
class SimReport:
    """The outcome of a run. :meth:`format` is a pure function of the run, so the
    same seed prints the same report; wall-clock timing is kept apart."""

    config: SimConfig
    simulated: float = 0.0
    node_steps: int = 0
    events: int = 0
    rounds: list[RoundStat] = field(default_factory=list)
    #: every returned join, in the order they returned (see :meth:`by_round`)
    returns: list[JoinReturn] = field(default_factory=list)
    stats: list[NodeStats] = field(default_factory=list)
    crashes: int = 0
    partitions: int = 0
    leaves: int = 0
    deaths: int = 0
    false_deaths: int = 0
    #: nodes that stopped their workers because their lease ran out (fenced)
    fences: int = 0
    #: nodes declared dead while their workers still ran: a broken lease, so two
    #: groups could train at once (a safety fault)
    unfenced_deaths: int = 0
    timeouts: int = 0
    #: phases published (writes that woke the nodes waiting for a lower one)
    phases: int = 0
    #: training nodes whose workers failed, and nodes that failed a health check
    worker_failures: int = 0
    health_failures: int = 0
    #: won writes that counted a failure in the restart budget, or excluded a node
    charges: int = 0
    exclusions: int = 0
    #: live (``newcomer_startup``): nodes out of the rendezvous while their
    #: newcomers started, and those in it meanwhile (the others could not go on)
    stepped_out: int = 0
    joined_unready: int = 0
    #: the restart budget's count, and whether the rendezvous is closed, at the end
    restarts: int = 0
    closed: bool = False
    violations: list[SimViolation] = field(default_factory=list)
    #: live, reachable nodes declared dead (a liveness fault, not a safety one)
    false_death_log: list[SimViolation] = field(default_factory=list)
    unfenced_log: list[SimViolation] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations and self.false_deaths == 0 and self.unfenced_deaths == 0

    @property
    def steps_per_second(self) -> float:
        return self.node_steps / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def by_round(self) -> dict[int, dict[int, JoinReturn]]:
        """What each node returned per round: round -> slot -> its return, rounds
        and slots in ascending order. A slot appears under a round only if its
        join returned from that round."""
        rounds: dict[int, dict[int, JoinReturn]] = {}
        for returned in sorted(self.returns, key=lambda r: (r.joined.round, r.slot)):
            rounds.setdefault(returned.joined.round, {})[returned.slot] = returned
        return rounds

    def totals(self) -> NodeStats:
        total = NodeStats()
        for s in self.stats:
            for name in vars(total):
                setattr(total, name, getattr(total, name) + getattr(s, name))
        return total

    def summary_rows(self) -> list[tuple[str, str]]:
        """(figure, value) rows of the report, for a table or plain text."""
        c = self.config
        settings = c.settings()
        n = max(1, len(self.stats))
        t = self.totals()
        durations = sorted(r.duration for r in self.rounds)

        def pct(q: float) -> str:
            if not durations:
                return "-"
            return f"{durations[min(len(durations) - 1, int(q * len(durations)))]:.3f} s"

        return [
            ("nodes (min, max)", f"{c.nodes} ({settings.min_nodes}, {settings.max_nodes})"),
            ("seed", str(c.seed)),
            ("simulated time", f"{self.simulated:.1f} s"),
            ("events", f"{self.events:,}"),
            ("node-steps", f"{self.node_steps:,}"),
            ("rounds completed", str(len(self.rounds))),
            ("round time p50 / p90 / max", f"{pct(0.5)} / {pct(0.9)} / {pct(1.0)}"),
            (
                "crashes / partitions / leaves",
                f"{self.crashes} / {self.partitions} / {self.leaves}",
            ),
            ("deaths declared (false)", f"{self.deaths} ({self.false_deaths})"),
            ("fences (deaths of unfenced nodes)", f"{self.fences} ({self.unfenced_deaths})"),
            ("operation timeouts", str(self.timeouts)),
            *self._failure_rows(),
            *self._newcomer_rows(),
            ("phases published", str(self.phases)),
            ("backend reads per node", f"{t.reads / n:.1f}"),
            ("backend writes per node", f"{t.writes / n:.1f}"),
            ("CAS conflicts per node", f"{t.conflicts / n:.1f}"),
            ("intent announces per node", f"{t.announces / n:.1f}"),
            ("heartbeat beats per node", f"{t.beats / n:.1f}"),
            ("wake-ups per node", f"{t.wakeups / n:.1f}"),
            ("phase notifications per node", f"{t.notifications / n:.1f}"),
            ("bytes read per node", f"{t.bytes_read / n:,.0f}"),
            ("bytes written per node", f"{t.bytes_written / n:,.0f}"),
            ("bytes per write", f"{(t.bytes_written - t.beat_bytes) / max(1, t.writes):,.0f}"),
            ("invariant violations", str(len(self.violations))),
        ]

    def _failure_rows(self) -> list[tuple[str, str]]:
        """The rows of the restart budget and exclusions (none for a run without
        them, whose table stays as it was)."""
        c = self.config
        if not (c.worker_failure_rate or c.health_failure_rate or c.restart_budget is not None):
            return []
        budget = "none" if c.restart_budget is None else str(c.restart_budget)
        return [
            (
                "worker failures / health-check failures",
                f"{self.worker_failures} / {self.health_failures}",
            ),
            ("restarts charged (budget)", f"{self.restarts} ({budget})"),
            ("exclusions", str(self.exclusions)),
            ("rendezvous closed", "yes" if self.closed else "no"),
        ]

    def _newcomer_rows(self) -> list[tuple[str, str]]:
        """The admission rule's answers (live runs only)."""
        if self.config.newcomer_startup is None:
            return []
        return [("newcomers started out / in", f"{self.stepped_out} / {self.joined_unready}")]

    def format(self) -> str:
        width = max(len(k) for k, _ in self.summary_rows())
        lines = [f"{k:<{width}}  {v}" for k, v in self.summary_rows()]
        lines += ["rounds (round, size, opened, completed, seconds):"]
        lines += [
            f"  {r.round} {r.size} {r.opened:.6f} {r.completed:.6f} {r.duration:.6f}"
            for r in self.rounds
        ]
        for v in [*self.violations, *self.false_death_log, *self.unfenced_log]:
            lines.append(v.format())
        return "\n".join(lines)
