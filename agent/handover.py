"""Live regroup, the agent's side (``--live``): hand running workers their new round.

The agent decides nothing about the group here: the round, the ranks and the master
come from the rendezvous and the rank agreement as for any round. This module only
carries a round to the node's workers (:mod:`rallypoint.agent.worker.live_channel`) and
watches that they take it:

* a worker that runs the live API (its status file says so) and is alive is *handed*
  the round's variables; one that is gone, or never used the API, is started afresh
  (the classic way);
* with ``live.Job(may_shrink=True)``, a lost worker's replacement can start before
  the round it will join exists (:meth:`LiveWorkers.start_outside`): it gets ready,
  says so, and waits to be handed its first round like any live worker;
* a handed worker that has not taken the round within ``--live-timeout`` is stopped and
  started again into the same round, so no path waits forever;
* with ``--progress-timeout``, a worker that commits no step for that long while
  training (not in a section it marked as a pause) is killed; the agent then treats
  it as a failed worker;
* once every local worker made its first step of the new round, one ``live_regroup``
  event says where the time went: from the failure being noticed to the workers
  told, their process group formed, the state in place and the first step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..core.live_switch import holds_state, takeover_timeout
from .config import Std
from .events import EventKind, EventRecorder
from .worker.live_channel import (
    BEAT_PERIOD,
    FD_ENV,
    SOURCE_DISK,
    STANDBY_ENV,
    STATUS_ENV,
    TIMEOUT_ENV,
    LiveMessage,
    Phase,
    StatusFile,
    encode_message,
)
from .workers import WorkerGroup, WorkerLaunch, WorkerProcess, stream_targets

__all__ = ["LiveWorkers"]

logger = logging.getLogger("rallypoint.agent")


@dataclass
class _Channel:
    """One worker's channel: the agent's end of its pipe and its status file."""

    write_fd: int
    read_fd: int | None
    status: StatusFile
    #: the descriptor number the worker knows its end by
    child_fd: int = -1

    def __post_init__(self) -> None:
        if self.read_fd is not None:
            self.child_fd = self.read_fd

    def close_read_end(self) -> None:
        """The worker holds its end now (or never will)."""
        if self.read_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.read_fd)
            self.read_fd = None

    def send(self, message: LiveMessage) -> bool:
        try:
            os.write(self.write_fd, encode_message(message))
            return True
        except OSError:  # the worker is gone: it is started afresh
            return False

    def close(self) -> None:
        for fd in (self.write_fd, self.read_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.status.close()


@dataclass
class _Spare:
    """A warm spare: its process, its channel-to-be, and the streams it pipes to the
    agent (the tee of the launches it can become)."""

    process: WorkerProcess
    channel: _Channel
    piped: Std


#: beat periods without a beat after which a worker counts as frozen
_FROZEN_BEATS = 5


@dataclass
class _Progress:
    """A worker's progress as last seen: its (round, step, phase, pauses) and since
    when, its beat and when that last moved."""

    seen: tuple[int, int, int, int]
    since: float
    beat: int
    beat_at: float


@dataclass
class _Regroup:
    """A regroup under way on this node, until every worker made its first step."""

    round: int
    noticed: float | None
    told: float
    handed: int
    started: int
    warm: int  # of ``started``, how many the warm spare became
    newcomers: frozenset[int]  # the local ranks of ``started``


class LiveWorkers:
    """The live channels of one agent's workers.

    Args:
        directory: where the workers' status files go (private to the agent).
        live_timeout: seconds a handed worker has to take the new round.
        progress_timeout: seconds a training worker may go without a step (0: never).
        recorder: where the ``live_regroup`` event goes.
    """

    def __init__(
        self,
        directory: str,
        live_timeout: float,
        progress_timeout: float,
        recorder: EventRecorder,
        *,
        spares: bool = True,
    ) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._dir = directory
        self.live_timeout = live_timeout
        self.progress_timeout = progress_timeout
        self._recorder = recorder
        self._channels: dict[int, _Channel] = {}
        #: local rank -> (its launch in the round it must take, the deadline, the
        #: seconds it was given)
        self._handed: dict[int, tuple[WorkerLaunch, float, float]] = {}
        #: local rank -> how its progress looked
        self._progress: dict[int, _Progress] = {}
        #: local ranks killed for making no progress (their exit is a failure)
        self.stalled: set[int] = set()
        self._regroup: _Regroup | None = None
        #: keep a warm spare worker ready (see :mod:`rallypoint.agent.worker.warm`)
        self.spares = spares
        self._spares: list[_Spare] = []
        self._spares_started = 0
        #: a launch of this agent's, which warm spares are made like
        self._template: WorkerLaunch | None = None
        #: newcomers started outside the group: local rank -> whether warm
        self._outside: dict[int, bool] = {}

    # ------------------------------------------------------------ starting

    def start(self, group: WorkerGroup, launches: Sequence[WorkerLaunch]) -> frozenset[int]:
        """Start ``launches`` (replacing their local ranks' workers): by adopting warm
        spares while there are, the others afresh. Each gets a new channel. Returns
        the local ranks that warm spares became."""
        warm = frozenset(
            launch.local_rank for launch in launches if self._adopt_spare(group, launch)
        )
        cold = [launch for launch in launches if launch.local_rank not in warm]
        prepared = []
        for launch in cold:
            self._forget(launch.local_rank)
            channel = self._channels[launch.local_rank] = self._new_channel(f"{launch.local_rank}")
            prepared.append(self._with_channel(launch, channel))
        try:
            group.replace(prepared)
        finally:
            for launch in prepared:  # the worker holds its end now (or never will)
                self._channels[launch.local_rank].close_read_end()
        return warm

    def start_outside(self, group: WorkerGroup, launches: Sequence[WorkerLaunch]) -> None:
        """Start replacements that get ready before their round exists: each reports
        :attr:`Phase.READY` (:meth:`ready`) and waits to be handed its first round."""
        standby = [
            dataclasses.replace(launch, env={**launch.env, STANDBY_ENV: "1"}) for launch in launches
        ]
        warm = self.start(group, standby)
        for launch in standby:
            self._outside[launch.local_rank] = launch.local_rank in warm

    def ready(self, group: WorkerGroup) -> bool:
        """Whether every newcomer started outside the group is ready to be taken in
        (one that exited counts: it is started afresh with the round)."""
        return all(
            self._channels[rank].status.read().phase is Phase.READY
            for rank in self._outside
            if self._running(group, rank)
        )

    def may_shrink(self) -> bool:
        """Whether this node's script lets the job train on without some of its
        workers for a while (every worker that reported says so)."""
        said = [channel.status.read().may_shrink for channel in self._channels.values()]
        return bool(said) and all(said)

    def _new_channel(self, name: str) -> _Channel:
        read_fd, write_fd = os.pipe()  # not inheritable: only pass_fds hands read_fd on
        path = os.path.join(self._dir, f"status-{name}")
        return _Channel(write_fd, read_fd, StatusFile(path, create=True))

    def _channel_env(self, channel: _Channel, env: Mapping[str, str]) -> dict[str, str]:
        return {
            **env,
            FD_ENV: str(channel.child_fd),
            STATUS_ENV: channel.status.path,
            TIMEOUT_ENV: f"{self.live_timeout:g}",
        }

    def _with_channel(self, launch: WorkerLaunch, channel: _Channel) -> WorkerLaunch:
        assert channel.read_fd is not None
        return dataclasses.replace(
            launch,
            env=self._channel_env(channel, launch.env),
            pass_fds=(*launch.pass_fds, channel.read_fd),
        )

    # --------------------------------------------------------- warm spares

    def _warm_argv(self, launch: WorkerLaunch) -> list[str] | None:
        """The command line a warm spare runs for workers like ``launch`` (None: such
        a worker cannot be warmed: not ``python -u ...``)."""
        argv = list(launch.argv)
        python = os.environ.get("PYTHON_EXEC") or sys.executable
        if len(argv) < 3 or argv[0] != python or argv[1] != "-u":
            return None
        return [python, "-u", "-m", "rallypoint.agent.worker.warm"]

    def prepare_spares(self, group: WorkerGroup, template: WorkerLaunch, count: int = 1) -> None:
        """Keep ``count`` warm spares for workers like ``template`` (fewer when they
        cannot be warmed, none when spares are off)."""
        argv = self._warm_argv(template)
        if not self.spares or argv is None:
            return
        self._forget_dead_spares(group)
        while len(self._spares) < count:
            # Named once for good: an adopted spare keeps its status file.
            self._spares_started += 1
            channel = self._new_channel(f"spare-{self._spares_started}")
            assert channel.read_fd is not None
            launch = dataclasses.replace(
                template,
                local_rank=-1,
                global_rank=-1,
                argv=[*argv, str(channel.read_fd), channel.status.path],
                env=dict(template.env),
                redirect=Std.NONE,
                tee=Std.NONE,
                console=True,
                duplicate_stdout=None,
                duplicate_stderr=None,
                pass_fds=(*template.pass_fds, channel.read_fd),
            )
            try:
                process = group.start_spare(launch, piped=template.tee)
            except OSError as exc:
                logger.warning("cannot start a warm spare worker (%s); going on without", exc)
                channel.close()
                return
            finally:
                channel.close_read_end()
            self._spares.append(_Spare(process, channel, template.tee))

    def _forget_dead_spares(self, group: WorkerGroup) -> None:
        """Let go of the spares that are gone: a group stop (fencing, for one) stops
        the spares with the workers, and a spare counted while dead would never be
        replaced, leaving the next lost worker to start cold."""
        for spare in [s for s in self._spares if s.process.poll() is not None]:
            self._spares.remove(spare)
            group.discard(spare.process)
            spare.channel.close()

    def spares_warm(self) -> bool:
        """Whether every warm spare has its imports done (or is gone)."""
        return all(
            spare.process.poll() is not None or spare.channel.status.read().phase is Phase.READY
            for spare in self._spares
        )

    def _adopt_spare(self, group: WorkerGroup, launch: WorkerLaunch) -> bool:
        """Make a warm spare ``launch``'s worker (True), if one is left and fits."""
        while self._spares:
            spare = self._spares.pop(0)
            process, channel = spare.process, spare.channel
            fits = spare.piped == launch.tee and self._warm_argv(launch) is not None
            if fits and process.poll() is None and self._adopt(group, spare, launch):
                logger.info(
                    "local rank %d: a warm spare (pid %d) took over", launch.local_rank, process.pid
                )
                return True
            group.discard(process)
            channel.close()
        return False

    def _adopt(self, group: WorkerGroup, spare: _Spare, launch: WorkerLaunch) -> bool:
        stdout, stderr = stream_targets(launch)
        adoption = {
            "env": self._channel_env(spare.channel, launch.env),
            "argv": list(launch.argv[2:]),
            "stdout": stdout,
            "stderr": stderr,
        }
        try:
            os.write(spare.channel.write_fd, (json.dumps(adoption) + "\n").encode())
        except OSError:
            return False
        self._forget(launch.local_rank)
        group.adopt(spare.process, launch)
        self._channels[launch.local_rank] = spare.channel
        return True

    def _forget(self, local_rank: int) -> None:
        channel = self._channels.pop(local_rank, None)
        if channel is not None:
            channel.close()
        self._handed.pop(local_rank, None)
        self._progress.pop(local_rank, None)
        self.stalled.discard(local_rank)

    # ------------------------------------------------------------ a new round

    def hand_over(
        self,
        group: WorkerGroup,
        launches: Sequence[WorkerLaunch],
        round_: int,
        variables: Callable[[WorkerLaunch], dict[str, str]],
        *,
        lost: bool,
        noticed: float | None,
    ) -> tuple[int, int]:
        """Move this node's workers to round ``round_``: hand each live worker its
        ``variables`` and start the others from ``launches``. Returns (handed, started).
        """
        fresh: list[WorkerLaunch] = []
        now = time.monotonic()
        outside, self._outside = self._outside, {}
        for launch in launches:
            rank = launch.local_rank
            # A newcomer started outside the group takes its first round from the
            # pipe even if it is not ready yet: it reads it at ``job.rounds()``.
            started_outside = rank in outside and self._running(group, rank)
            if not started_outside and not self._is_live(group, rank):
                fresh.append(launch)
                continue
            # One still forming its first group holds nothing: if its forming does
            # not break at once, starting it again is cheaper than waiting.
            status = self._channels[rank].status.read()
            holds = holds_state(
                step=status.step,
                group_formed=status.group_at > 0,
                outside_a_round=status.phase is Phase.JOINING,
            )
            wait = takeover_timeout(self.live_timeout, holds_state=holds)
            if self._channels[rank].send(LiveMessage(round_, variables(launch), lost)):
                self._handed[rank] = (launch, now + wait, wait)
            else:
                fresh.append(launch)
        self._template = launches[0] if launches else self._template
        warm = len(self.start(group, fresh)) if fresh else 0
        # A newcomer handed its first round was started for this round too.
        fresh_ranks = {launch.local_rank for launch in fresh}
        came_ready = {rank for rank in outside if rank not in fresh_ranks}
        warm += sum(outside[rank] for rank in came_ready)
        newcomers = frozenset(fresh_ranks | came_ready)
        started = len(newcomers)
        handed = len(launches) - started
        self._regroup = _Regroup(
            round_, noticed, time.monotonic(), handed, started, warm, newcomers
        )
        return handed, started

    def _running(self, group: WorkerGroup, local_rank: int) -> bool:
        worker = group.worker(local_rank)
        return worker is not None and local_rank in self._channels and worker.poll() is None

    def _is_live(self, group: WorkerGroup, local_rank: int) -> bool:
        if not self._running(group, local_rank):
            return False
        return self._channels[local_rank].status.read().phase not in (Phase.STARTED, Phase.DONE)

    def uses_live_api(self) -> bool:
        """Whether a worker of this node runs the live API (its script reached
        ``job.rounds()``)."""
        return any(c.status.read().phase is not Phase.STARTED for c in self._channels.values())

    # ----------------------------------------------------------- watching

    def check(self, group: WorkerGroup, round_: int) -> None:
        """One look at the workers (from the monitor loop): replace those that did not
        take the round in time, kill those that stopped making progress, and report
        a finished regroup."""
        now = time.monotonic()
        for rank, (launch, deadline, given) in list(self._handed.items()):
            if self._channels[rank].status.read().round >= round_:
                del self._handed[rank]
            elif now >= deadline:
                logger.warning(
                    "local rank %d did not take round %d within %g s; starting it again",
                    rank,
                    round_,
                    given,
                )
                self.start(group, [launch])
        if self.progress_timeout > 0:
            self._check_progress(group, now)
        if self._report_regroup() and self._template is not None:
            # Only now: a spare importing torch would slow the regroup it is for.
            self.prepare_spares(group, self._template)

    def _check_progress(self, group: WorkerGroup, now: float) -> None:
        """Kill the workers that hold their round up: no step for the progress timeout
        while training, and either frozen (their beat stood still for a few beat
        periods) or stuck outside any collective. A worker waiting in a collective
        for such a peer is spared: the peer's death ends its wait."""
        for rank, channel in self._channels.items():
            if rank in self.stalled:
                continue
            s = channel.status.read()
            seen = (s.round, s.step, int(s.phase), s.pauses)
            watch = self._progress.get(rank)
            if watch is None or watch.seen != seen:
                self._progress[rank] = _Progress(seen, now, s.beat, now)
                continue
            if s.beat != watch.beat:
                watch.beat, watch.beat_at = s.beat, now
            frozen = now - watch.beat_at > _FROZEN_BEATS * BEAT_PERIOD
            if (
                s.phase is not Phase.STEPPING
                or now - watch.since < self.progress_timeout
                or (s.waiting and not frozen)
            ):
                continue
            logger.warning(
                "local rank %d made no progress for %.1f s (at step %d of round %d, %s); "
                "stopping it",
                rank,
                now - watch.since,
                s.step,
                s.round,
                "frozen" if frozen else "outside any collective",
            )
            self.stalled.add(rank)
            group.kill(rank)

    def _report_regroup(self) -> bool:
        """Emit the ``live_regroup`` event once every worker made its first step of
        the round it was moved to; True when it did."""
        regroup = self._regroup
        if regroup is None:
            return False
        by_rank = {rank: c.status.read() for rank, c in self._channels.items()}
        statuses = list(by_rank.values())
        if not statuses or any(s.round != regroup.round or s.first_step_at <= 0 for s in statuses):
            return False
        self._regroup = None
        origin = regroup.noticed if regroup.noticed is not None else regroup.told

        def since(times: list[float]) -> float:
            return max(times) - origin

        sources = sorted({s.source for s in statuses if s.source >= 0})
        # A newcomer is ready when its script reaches ``job.rounds()``: it says so
        # outside the group, or starts joining at once.
        ready = [s.ready_at or s.joined_at for r, s in by_rank.items() if r in regroup.newcomers]
        self._recorder.emit(
            EventKind.LIVE_REGROUP,
            regroup.round,
            handed=regroup.handed,
            started=regroup.started,
            warm_started=regroup.warm,
            newcomer_ready_s=since(ready) if ready else None,
            told_s=regroup.told - origin,
            group_s=since([s.group_at for s in statuses]),
            state_s=since([s.state_at for s in statuses]),
            first_step_s=since([s.first_step_at for s in statuses]),
            state_from=sources,
            state_from_disk=any(s.source == SOURCE_DISK for s in statuses),
            state_bytes=sum(s.state_bytes for s in statuses),
            step=max(s.step for s in statuses),
        )
        return True

    def close(self) -> None:
        for rank in list(self._channels):
            self._forget(rank)
        for spare in self._spares:
            spare.channel.close()
        self._spares = []
