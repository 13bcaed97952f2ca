"""Structured events: what the agent did, when, and how long each part took.

Every rendezvous round, worker start, failure, restart, exclusion, health check and
preemption is one :class:`AgentEvent`, written as one JSON line to the file given by
``--events-file`` (agents of one host may share it: each line goes out in a single
``O_APPEND`` write, so lines never interleave) and logged on the
``rallypoint.events`` logger at DEBUG (``LOGLEVEL=DEBUG`` shows them on the console).
``rallypoint events FILE`` prints them as a table.

The timings say where recovery time goes: a failure's ``restart`` event carries
how long the agent took to decide (``decide_s``: waiting for evidence that a lost
peer caused it); the next ``round`` event how long the rendezvous took
(``rendezvous_s``) and how long since the failure was noticed (``since_failure_s``);
``workers_started`` how long starting the workers took (``start_s``).
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AgentEvent",
    "EventFileError",
    "EventKind",
    "EventRecorder",
    "events_main",
    "read_events",
]

logger = logging.getLogger("rallypoint.events")


class EventKind(str, enum.Enum):
    """What happened."""

    #: the node joined a round (round, group rank and world size, timings)
    ROUND = "round"
    #: the node's workers of a round are running
    WORKERS_STARTED = "workers_started"
    #: workers of this node failed (ranks, exit codes)
    FAILURE = "failure"
    #: the node is leaving its round for a new one (cause, whether it was charged)
    RESTART = "restart"
    #: the node excluded itself for some rounds (reason, first round back)
    EXCLUSION = "exclusion"
    #: the node's pre-flight health check ran (ok, reason, seconds, import_seconds: the
    #: import of torch, which its budget does not count)
    HEALTH_CHECK = "health_check"
    #: the agent got a stop signal and left the rendezvous (signal, grace)
    PREEMPTION = "preemption"
    #: the agent is done (outcome, exit code)
    FINISHED = "finished"
    #: every worker of the node made its first step in a round it was handed live
    #: (``--live``): how many workers were handed the round (handed) and started
    #: (started), of those how many warm spares became (warm_started); seconds from
    #: the failure being noticed to the newcomers ready (newcomer_ready_s: at
    #: ``job.rounds()``; None when no worker started), the workers told, their process
    #: group formed, the state in place and the first step
    LIVE_REGROUP = "live_regroup"


@dataclass(frozen=True)
class AgentEvent:
    """One event: when (wall clock, for humans and for merging the files of several
    hosts), which node, what, in which round, and the kind's own fields."""

    time: float
    node: str
    kind: EventKind
    round: int | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        doc: dict[str, Any] = {
            "time": round(self.time, 6),
            "node": self.node,
            "kind": self.kind.value,
            "round": self.round,
        }
        doc.update(self.fields)
        return json.dumps(doc, separators=(",", ":"), default=str)


class EventFileError(ValueError):
    """An events file cannot be written or read (the message names the file)."""


class EventRecorder:
    """Where one agent's events go: a JSON-lines file (optional) and logging.

    Writing never raises into the agent: a full disk must not stop a job. The first
    failed write is logged as a warning and the file is given up.
    """

    def __init__(self, path: str | None, node: str) -> None:
        self.path = path
        self.node = node
        self._fd: int | None = None
        if path:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as exc:
                raise EventFileError(
                    f"--events-file {path!r}: cannot open for appending ({exc.strerror})"
                ) from None

    def emit(self, kind: EventKind, round_: int | None = None, **fields: Any) -> AgentEvent:
        """Record one event now."""
        event = AgentEvent(time.time(), self.node, kind, round_, fields)
        line = event.to_json()
        logger.debug("%s", line)  # the console has its own lines; the file is the record
        if self._fd is not None:
            try:
                os.write(self._fd, (line + "\n").encode())
            except OSError as exc:
                logger.warning("events file %s: %s; no more events go there", self.path, exc)
                self._close()
        return event

    def close(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def read_events(paths: Iterable[str]) -> list[AgentEvent]:
    """The events of one or more files, ordered by time. A line that is not an
    event (a torn last line of a killed agent, foreign text) is skipped.

    Raises:
        EventFileError: a file cannot be read.
    """
    events: list[AgentEvent] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as fp:
                lines = fp.readlines()
        except OSError as exc:
            raise EventFileError(f"{path}: cannot read ({exc.strerror})") from None
        events.extend(e for e in map(_parse, lines) if e is not None)
    events.sort(key=lambda e: e.time)
    return events


def _parse(line: str) -> AgentEvent | None:
    try:
        doc = json.loads(line)
        kind = EventKind(doc.pop("kind"))
        when = float(doc.pop("time"))
        node = str(doc.pop("node"))
        round_ = doc.pop("round", None)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if round_ is not None and not isinstance(round_, int):
        return None
    return AgentEvent(when, node, kind, round_, doc)


def _details(fields: Mapping[str, Any]) -> str:
    def show(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}"
        return json.dumps(value) if isinstance(value, (list, dict)) else str(value)

    return ", ".join(f"{key}={show(value)}" for key, value in fields.items())


def events_main(argv: Sequence[str]) -> int:
    """``rallypoint events FILE...``: the events as a table (or as JSON lines)."""
    parser = argparse.ArgumentParser(
        prog="rallypoint events",
        description="Print the events written by 'rallypoint run --events-file FILE'.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="events file(s) to merge")
    parser.add_argument(
        "--kind", action="append", choices=[k.value for k in EventKind], help="only these kinds"
    )
    parser.add_argument("--node", action="append", help="only these nodes (as printed)")
    parser.add_argument("--json", action="store_true", help="print JSON lines, not a table")
    parser.add_argument(
        "--recoveries",
        action="store_true",
        help="one row per live regroup: where its time went, phase by phase",
    )
    args = parser.parse_args(list(argv))
    try:
        events = read_events(args.files)
    except EventFileError as exc:
        print(f"rallypoint events: {exc}", file=sys.stderr)
        return 1
    if args.kind:
        events = [e for e in events if e.kind.value in args.kind]
    if args.node:
        events = [e for e in events if e.node in args.node]
    if args.json:
        for event in events:
            print(event.to_json())
        return 0
    if args.recoveries:
        _print_recoveries(events)
        return 0
    _print_table(events)
    return 0


def _started(fields: Mapping[str, Any]) -> str:
    """The workers a regroup started, marked ``*`` when the warm spare became one (the
    table is narrow: the mark is explained in its caption)."""
    started = str(fields.get("started", ""))
    return f"{started}*" if fields.get("warm_started") else started


#: a live regroup's phases, in order: (column, the field that holds its seconds)
_PHASES = (
    ("ready", "newcomer_ready_s"),
    ("rdzv", "rendezvous"),
    ("told", "told_s"),
    ("group", "group_s"),
    ("state", "state_s"),
    ("step", "first_step_s"),
)


def _print_recoveries(events: Sequence[AgentEvent]) -> None:
    """Each ``live_regroup`` with the ``round`` event of the same node and round (its
    ``since_failure_s``: the rendezvous done), in seconds since the failure was
    noticed."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    joined = {
        (e.node, e.round): e.fields.get("since_failure_s")
        for e in events
        if e.kind is EventKind.ROUND
    }
    table = Table(
        title="live regroups: seconds since the failure was noticed",
        title_justify="left",
        box=box.SIMPLE_HEAD,  # no column rules, one space between: eleven columns fit 80
        collapse_padding=True,
        pad_edge=False,
        caption=(
            "started*: a warm spare became one of them; ready: the newcomers reached "
            "job.rounds(); rdzv: the rendezvous done; told: the workers; group: formed; "
            "state: in place; step: every worker made one; from: the rank the state came from"
        ),
        caption_justify="left",
    )
    for column in (
        "node",
        "round",
        "handed",
        "started",
        *(name for name, _ in _PHASES),
        "from",
    ):
        table.add_column(column, justify="left" if column == "node" else "right")
    for e in events:
        if e.kind is not EventKind.LIVE_REGROUP:
            continue
        times = {**e.fields, "rendezvous": joined.get((e.node, e.round))}
        table.add_row(
            e.node,
            str(e.round),
            str(e.fields.get("handed", "")),
            _started(e.fields),
            *(_seconds(times.get(key)) for _, key in _PHASES),
            ",".join(map(str, e.fields.get("state_from", []))) or "-",
        )
    Console().print(table)


def _seconds(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def _print_table(events: Sequence[AgentEvent]) -> None:
    from rich.console import Console
    from rich.table import Table

    start = events[0].time if events else 0.0
    table = Table(title=f"{len(events)} events", title_justify="left")
    table.add_column("+s", justify="right")
    table.add_column("node")
    table.add_column("event")
    table.add_column("round", justify="right")
    table.add_column("details", overflow="fold")
    for event in events:
        table.add_row(
            f"{event.time - start:.3f}",
            event.node,
            event.kind.value,
            "" if event.round is None else str(event.round),
            _details(event.fields),
        )
    Console().print(table)
