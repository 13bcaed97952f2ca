"""The local channel between a live agent and each of its workers (``--live``).

Two one-way paths per worker, both private to the node:

* **agent -> worker: assignments.** A pipe whose read end the worker inherits (its
  descriptor number is in ``RALLYPOINT_LIVE_FD``). Each message is one JSON line: the
  round the worker is to join and the environment of that round (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ...). End-of-file means the agent is gone.
* **worker -> agent: status.** A small file of fixed-size fields (``RALLYPOINT_LIVE_STATUS``)
  that the worker maps into memory and overwrites in place: the round it is in, its
  committed step count, its phase and when each phase of its last regroup was reached
  (``time.monotonic()``, one clock for every process of a Linux host). Writing a field
  costs no system call, so reporting a step is cheap enough to do on every step; the
  agent reads the file when it looks at its workers. Each field is an aligned 8-byte
  word, written whole.

This module is a leaf: it imports nothing of the package, so the worker side
(:mod:`rallypoint.agent.worker.live`) and the agent side (:mod:`rallypoint.agent.handover`)
share it without importing each other. It lives with the worker's code, whose
process writes the status and reads the pipe, and the agent's handover imports it
to speak the same format (the import rule allows it that, tests/test_import_graph.py).
"""

from __future__ import annotations

import enum
import json
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "BEAT_PERIOD",
    "FD_ENV",
    "SOURCE_DISK",
    "STANDBY_ENV",
    "STATUS_ENV",
    "TIMEOUT_ENV",
    "LiveMessage",
    "Phase",
    "Status",
    "StatusFile",
    "decode_message",
    "encode_message",
]

#: the worker's end of the assignment pipe (a descriptor number)
FD_ENV = "RALLYPOINT_LIVE_FD"
#: the worker's status file
STATUS_ENV = "RALLYPOINT_LIVE_STATUS"
#: seconds a worker has to take a new round before its agent replaces it
TIMEOUT_ENV = "RALLYPOINT_LIVE_TIMEOUT"
#: set ("1") for a newcomer started outside the group: it gets ready (its script
#: up to ``job.rounds()``), reports :attr:`Phase.READY` and waits for its first round
STANDBY_ENV = "RALLYPOINT_LIVE_STANDBY"
#: seconds between two beats of a live worker
BEAT_PERIOD = 0.1
#: a status's ``source`` when no peer held some shard and the ranks restored the
#: checkpoint instead
SOURCE_DISK = -2


class Phase(enum.IntEnum):
    """Where a worker is, as its status file says."""

    #: started, not (yet) using the live API: its agent replaces it the classic way
    STARTED = 0
    #: left its old round (or has none) and is forming the process group of ``round``
    JOINING = 1
    #: process group ready; receiving the registered state
    SYNCING = 2
    #: training: ``step`` moves
    STEPPING = 3
    #: in a section the script marked as long (a checkpoint): no progress expected
    PAUSED = 4
    #: finished its last round
    DONE = 5
    #: a newcomer started outside the group, ready to be admitted: its script reached
    #: ``job.rounds()`` and waits for its first round
    READY = 6


_FORMAT = struct.Struct("<qqqqddddqqqqqd")
#: field offsets, in the order of :class:`Status`'s fields
(
    _ROUND, _STEP, _PHASE, _PAUSES, _JOINED, _GROUP, _STATE, _FIRST, _SOURCE, _BYTES, _BEAT,
    _WAIT, _SHRINK, _READY,
) = (8 * i for i in range(14))  # fmt: skip


@dataclass(frozen=True)
class Status:
    """One reading of a worker's status file."""

    #: the round the worker is in or joining (-1: none yet)
    round: int
    #: steps committed (the registered state's step counter)
    step: int
    phase: Phase
    #: how many times the worker entered :attr:`Phase.PAUSED` (a pause is progress)
    pauses: int
    #: monotonic times of this round's regroup: left the old round, process group
    #: ready, state in place, first step committed (0.0: not yet)
    joined_at: float
    group_at: float
    state_at: float
    first_step_at: float
    #: the global rank the state came from (-1: no transfer was needed;
    #: :data:`SOURCE_DISK`: the checkpoint)
    source: int
    #: bytes of state received (0 on the sender and when nothing moved)
    state_bytes: int
    #: bumped by a thread of the worker while the process runs (a frozen process,
    #: SIGSTOPped or wedged, stops it)
    beat: int
    #: 1: when last beaten, the training thread was inside a collective (waiting on
    #: peers, not the one holding them up)
    waiting: int
    #: 1: the script declared that the job may train on without this worker while
    #: its replacement starts (``live.Job(may_shrink=True)``)
    may_shrink: int
    #: monotonic time a newcomer started outside the group reported ready (0.0: it
    #: was not started that way, or is not ready yet)
    ready_at: float


class StatusFile:
    """A worker's status file, mapped into memory (both sides use this class)."""

    SIZE = _FORMAT.size

    def __init__(self, path: str, *, create: bool = False) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.SIZE)
            self._map = mmap.mmap(fd, self.SIZE)
        finally:
            os.close(fd)
        self.path = path
        if create:
            self.write_round(-1)

    def read(self) -> Status:
        fields = list(_FORMAT.unpack_from(self._map))
        try:
            fields[2] = Phase(fields[2])
        except ValueError:
            fields[2] = Phase.STARTED
        return Status(*fields)

    def write_round(self, round_: int, *, joined_at: float = 0.0) -> None:
        """A new round begins: its times and source are cleared, then the round set."""
        m = self._map
        for offset in (_GROUP, _STATE, _FIRST):
            struct.pack_into("<d", m, offset, 0.0)
        struct.pack_into("<q", m, _SOURCE, -1)
        struct.pack_into("<q", m, _BYTES, 0)
        struct.pack_into("<d", m, _JOINED, joined_at)
        struct.pack_into("<q", m, _ROUND, round_)

    def write_phase(self, phase: Phase) -> None:
        if phase is Phase.PAUSED:
            struct.pack_into("<q", self._map, _PAUSES, self.read().pauses + 1)
        struct.pack_into("<q", self._map, _PHASE, int(phase))

    def write_step(self, step: int) -> None:
        struct.pack_into("<q", self._map, _STEP, step)

    def write_group_ready(self, at: float) -> None:
        struct.pack_into("<d", self._map, _GROUP, at)

    def write_state(self, at: float, source: int, size: int) -> None:
        struct.pack_into("<q", self._map, _SOURCE, source)
        struct.pack_into("<q", self._map, _BYTES, size)
        struct.pack_into("<d", self._map, _STATE, at)

    def write_beat(self, beat: int, waiting: bool) -> None:
        struct.pack_into("<q", self._map, _WAIT, int(waiting))
        struct.pack_into("<q", self._map, _BEAT, beat)

    def write_first_step(self, at: float) -> None:
        struct.pack_into("<d", self._map, _FIRST, at)

    def write_may_shrink(self, may_shrink: bool) -> None:
        struct.pack_into("<q", self._map, _SHRINK, int(may_shrink))

    def write_ready(self, at: float) -> None:
        """A newcomer outside the group (or a warm spare) is ready: the time, then
        the phase."""
        struct.pack_into("<d", self._map, _READY, at)
        self.write_phase(Phase.READY)

    def write_adopted(self) -> None:
        """A warm spare becomes a worker: it starts as any worker does."""
        self.write_phase(Phase.STARTED)
        struct.pack_into("<d", self._map, _READY, 0.0)

    def close(self) -> None:
        self._map.close()


@dataclass(frozen=True)
class LiveMessage:
    """An assignment: join ``round`` with the environment ``env`` (torchrun's worker
    variables of that round). ``lost``: a member of the old round is gone, so a
    collective of the old round may never finish (a worker then aborts it rather
    than waiting for a step boundary)."""

    round: int
    env: Mapping[str, str]
    lost: bool


def encode_message(message: LiveMessage) -> bytes:
    doc = {"round": message.round, "env": dict(message.env), "lost": message.lost}
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


def decode_message(line: bytes) -> LiveMessage:
    """Raises ValueError for a line that is not an assignment."""
    doc = json.loads(line)
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("round"), int)
        or not isinstance(doc.get("env"), dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc["env"].items())
    ):
        raise ValueError(f"not a live assignment: {line[:200]!r}")
    return LiveMessage(doc["round"], doc["env"], bool(doc.get("lost", False)))
