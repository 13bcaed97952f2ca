"""The elastic agent: rendezvous, start workers, watch them and the group, repeat.

One :class:`ElasticAgent` runs on each node. Its loop::

    rendezvous -> agree on ranks, round and master through the round's store
    -> start workers -> monitor:
         all workers exited 0        -> exit barrier, close the rendezvous, done
         a worker failed             -> restart (spends one of max_restarts) or give up
         nodes waiting / a peer gone -> restart into a new round (budget untouched)
         rendezvous closed elsewhere -> stop

A restart stops every local worker (SIGTERM, a short grace, SIGKILL) and joins the
next round. This module holds the loop; its parts live beside it:

* :mod:`.ranks`: the rank agreement through the round's store (:class:`Assignment`);
* :mod:`.worker_specs`: each worker's environment, command and log files;
* :mod:`.group_watch`: watching a round (:class:`RoundOutcome`) and the group;
* :mod:`.charging`: whether a failure spends a restart (:class:`RestartBudget`);
* :mod:`.exit_barrier`: finishing together;
* :mod:`.lease`: stopping the workers once this node's lease runs out;
* :mod:`.signals`: termination signals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
)

from ..core.newcomers import Admission, NewcomerView, admission
from .charging import Charge, FailureCase
from .config import LaunchConfig
from .errors import AgentError, ProcessFailure
from .events import EventKind, EventRecorder
from .exit_barrier import acknowledge_close, exit_barrier, wait_for_acknowledgements
from .group_watch import GroupWatch, RoundOutcome
from .handover import LiveWorkers
from .lease import LeaseGuard, fence_grace
from .logs import EventLog, StartedWorker, make_log_root
from .ranks import Assignment, RoundAbandoned, agree_ranks, choose_master
from .recovery import Recovery
from .rendezvous import HandlerView
from .signals import SignalReceived, ignore_signals, raise_on_signals
from .worker_specs import return_files, round_variables, worker_launches
from .workers import WorkerGroup, WorkerLaunch

__all__ = ["AgentState", "Assignment", "ElasticAgent", "RunResult", "SignalReceived"]

logger = logging.getLogger("rallypoint.agent")

#: How many rounds in a row may fail to agree on ranks before the agent gives up.
_ASSIGN_ATTEMPTS = 5
#: How often an agent out of the round looks whether its newcomers are ready (a
#: status file in memory: the look is cheap, and it bounds the admission's delay).
_READY_POLL = 0.01
#: The fact an agent records once its workers run the live API: a node that joins the
#: job later can start its workers before it has a round (they wait at job.rounds()).
_LIVE_SCRIPT = "live-api"
#: How long an agent that ended the job on a failure waits for the others to see it.
_CLOSE_SEEN_TIMEOUT = 5.0
#: The ends of the two messages of a rendezvous closed by another agent.
_CLOSED_WHILE_RUNNING = "while this node's workers ran (another node gave up?)"
_CLOSED_BEFORE_REJOINING = "(the job finished or gave up) before this node could rejoin"


class AgentState(enum.Enum):
    """How an agent's run ended (how one round ended is
    :class:`rallypoint.agent.group_watch.RoundOutcome`)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CLOSED = "closed"
    INTERRUPTED = "interrupted"


@dataclass
class RunResult:
    """The outcome of :meth:`ElasticAgent.run`.

    ``rounds`` counts the rounds whose workers this agent started; ``return_files``
    maps global rank to the file each worker of the last round was told to write
    its return value to (see :mod:`rallypoint.agent.api`).
    """

    state: AgentState
    exit_code: int
    failures: list[ProcessFailure] = field(default_factory=list)
    message: str = ""
    rounds: int = 0
    return_files: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Round:
    """The round this agent's workers run in."""

    assignment: Assignment
    store: Store
    #: its nodes, where the handler tells (rallypoint's)
    members: frozenset[str] | None


def _provisional(config: LaunchConfig) -> Assignment:
    """A place in no round yet: what warm spares started before the first round
    are made from (their environment is replaced when they become workers)."""
    return Assignment(
        round=-1,
        group_rank=0,
        group_world_size=1,
        base_global_rank=0,
        world_size=config.nproc_per_node,
        base_role_rank=0,
        role_world_size=config.nproc_per_node,
        master_addr="",
        master_port=0,
        use_agent_store=False,
    )


class ElasticAgent:
    """Runs one node's workers through rounds of a rendezvous until the job ends.

    Args:
        config: the launch configuration.
        argv: the command every worker runs (the same on every local rank).
        handler: the rendezvous handler (from :func:`rallypoint.agent.rendezvous.build_handler`).
        return_values: tell each worker where to write its return value
            (``RALLYPOINT_RETURN_FILE``); used by the function API.
        log_root: this agent's log directory, already made by
            :func:`rallypoint.agent.logs.make_log_root` (None: make it now).

    Raises:
        ConfigError: the log directory cannot be created.
    """

    def __init__(
        self,
        config: LaunchConfig,
        argv: Sequence[str],
        handler: RendezvousHandler,
        *,
        return_values: bool = False,
        log_root: str | None = None,
    ) -> None:
        self.config = config
        self.argv = list(argv)
        self.view = HandlerView(handler)
        self.handler = handler
        self.return_values = return_values
        self.group = WorkerGroup()
        self.watch = GroupWatch(self.view, config)
        #: rounds whose workers this agent started (``attempt_N`` numbers them from 0)
        self.rounds = 0
        self._round: _Round | None = None
        #: the failures of the last failed round, reported if the job then closes
        self._last_failures: list[ProcessFailure] = []
        self._log_root = log_root or make_log_root(config.log_dir, config.run_id)
        self._guard = (
            LeaseGuard(self.view, self.group, fence_grace(self.view, config.stop_grace))
            if self.view.fences
            else None
        )
        #: rallypoint's structured events (``--events-file``, and logging)
        self.recorder = EventRecorder(config.events_file, self.view.node_name)
        #: the restart budget, exclusions and the health check
        self.recovery = Recovery(config, self.view, self.recorder)
        self.budget = self.recovery.budget
        #: whether this agent recorded that the job's workers use the live API
        self._told_live_script = False
        #: when the failure that ends the current round was noticed (monotonic)
        self._failure_noticed: float | None = None
        #: live regroup (``--live``): the workers' channels
        self.live = (
            LiveWorkers(
                os.path.join(self._log_root, "live"),
                config.live_timeout,
                config.progress_timeout,
                self.recorder,
                spares=config.live_spare,
            )
            if config.live
            else None
        )
        self.events = EventLog(
            config.event_log_handler,
            run_id=config.run_id,
            role=config.role,
            max_restarts=config.max_restarts,
            entry_point=os.path.basename(self.argv[0]) if self.argv else "",
        )

    @property
    def log_root(self) -> str:
        """The directory holding this agent's ``attempt_N/<local_rank>/`` logs."""
        return self._log_root

    @property
    def remaining_restarts(self) -> int:
        """Restarts left in the ``max_restarts`` budget (this agent's, or the job's)."""
        return self.recovery.left

    @property
    def restarts_spent(self) -> int:
        """Restarts spent so far (torch's ``TORCHELASTIC_RESTART_COUNT``)."""
        return self.recovery.spent

    # ------------------------------------------------------------- the run

    def run(self) -> RunResult:
        """Run the job on this node; always stops the workers and releases the handler.

        A job that ends (success, failure beyond the budget) closes the rendezvous.
        A termination signal only takes this node out: like torchrun, the agent then
        does not close the rendezvous, so the other nodes regroup without it.
        """
        interrupted = unreachable = False
        stop_with = signal.SIGTERM
        guard = self._guard.running() if self._guard is not None else contextlib.nullcontext()
        with raise_on_signals(self.config.stop_signals), guard:
            try:
                result = self._run()
                self.recorder.emit(
                    EventKind.FINISHED,
                    self._round_number,
                    state=result.state.value,
                    exit_code=result.exit_code,
                    message=result.message,
                )
                return result
            except SignalReceived as sig:
                interrupted = True
                stop_with = signal.Signals(sig.signum)  # forwarded to the workers
                logger.warning("%s: stopping workers and leaving the rendezvous", sig)
                return RunResult(
                    AgentState.INTERRUPTED, 128 + sig.signum, message=str(sig), rounds=self.rounds
                )
            except RendezvousConnectionError:
                # The backend is gone (a c10d store's host was lost): trying to close
                # the rendezvous there would only add a second error to the first.
                unreachable = True
                raise
            finally:
                # A second signal must not cut the cleanup short.
                ignore_signals(self.config.stop_signals)
                if interrupted:
                    self._preempted(stop_with)
                else:
                    self.group.stop(self.config.stop_grace, stop_with)
                    self.view.shut_down(close_rendezvous=not unreachable and not self.watch.closed)
                if self.live is not None:
                    self.live.close()
                self.recorder.close()

    def _preempted(self, sig: signal.Signals) -> None:
        """Stop on a signal (a preemption notice): the workers get the signal first
        and ``stop_grace`` to checkpoint, but the node leaves the rendezvous at once,
        so its peers regroup without waiting for that grace (or a liveness window)."""
        started = time.monotonic()
        self.group.forward(sig)
        self.view.leave()
        # Recorded before the grace: a second, harder stop may not leave time after.
        self.recorder.emit(
            EventKind.PREEMPTION,
            self._round_number,
            signal=sig.name,
            left_s=time.monotonic() - started,
            grace_s=self.config.stop_grace,
        )
        self.group.stop(self.config.stop_grace, None)

    # ------------------------------------------------------------ the loop

    def _run(self) -> RunResult:
        while True:
            ended = self._start_round()
            if ended is None:
                outcome, failures = self.watch.wait_for_outcome(self.group, self._live_check)
                ended = self._after_round(outcome, failures)
            if ended is not None:
                return ended

    def _start_round(self) -> RunResult | None:
        """Join the next round and start its workers; a result: the job ended first."""
        try:
            self._rendezvous_and_start()
        except RendezvousGracefulExitError:
            return RunResult(
                AgentState.SUCCEEDED,
                0,
                message="the job closed while this node waited as a spare",
                rounds=self.rounds,
            )
        except RendezvousClosedError:
            return self._closed_result(_CLOSED_BEFORE_REJOINING)
        return None

    def _after_round(
        self, outcome: RoundOutcome, failures: list[ProcessFailure]
    ) -> RunResult | None:
        """The step after a round's ``outcome``: a result ends the run, None joins the
        next round."""
        if outcome is RoundOutcome.FAILED and self._clear_fence():
            # The lease guard stopped them: a new round, without spending a restart.
            self.group.stop(self.config.stop_grace)
            logger.warning("[%s] workers fenced; joining a new round", self.config.role)
            self.recovery.restarting(self._round_number, "fenced", charged=False)
            return None
        if outcome is RoundOutcome.SUCCEEDED:
            return self._finish()
        if outcome is RoundOutcome.FAILED:
            ended = self._on_failure(failures)
            if ended is None and self.live is not None:
                self._replace_outside_the_group()
            return ended
        if outcome is RoundOutcome.CLOSED:
            self.group.stop(self.config.stop_grace)
            return self._closed_result(_CLOSED_WHILE_RUNNING)
        if self.live is None:  # live workers keep running into the next round
            self.group.stop(self.config.stop_grace)
        # The membership changed: a new round, the budget untouched.
        self._failure_noticed = time.monotonic()
        self.recovery.restarting(self._round_number, "membership", charged=False)
        return None

    def _clear_fence(self) -> bool:
        """Clear the lease guard's mark; True: the guard had stopped the workers."""
        if self._guard is None or not self._guard.fenced.is_set():
            return False
        self._guard.fenced.clear()
        return True

    def _finish(self) -> RunResult | None:
        """Every local worker succeeded: wait for the other agents, then end the job
        (None: a node waits to join, so the job goes on)."""
        current = self._current
        if not exit_barrier(
            current.store, current.assignment, self.watch, self.config.exit_barrier_timeout
        ):
            self.group.stop(self.config.stop_grace)
            return None
        if not self.watch.closed:  # the exit barrier closes it while every agent is up
            self.watch.close_rendezvous()
        attempt_dir = self._attempt_dir(self.rounds - 1)
        files = self._return_files(attempt_dir, current.assignment)
        return RunResult(AgentState.SUCCEEDED, 0, rounds=self.rounds, return_files=files)

    def _on_failure(self, failures: list[ProcessFailure]) -> RunResult | None:
        """A local worker failed: regroup, spending a restart unless the failure is
        explained by the group changing, or give up."""
        self._last_failures = failures
        failed_at = self._failure_noticed = time.monotonic()
        self.recorder.emit(
            EventKind.FAILURE,
            self._round_number,
            failures=[
                {"rank": f.global_rank, "local_rank": f.local_rank, "exitcode": f.exitcode,
                 "message": f.message}
                for f in failures
            ],
        )  # fmt: skip
        # The other local workers may hang in a collective: stop them first (live
        # workers leave it by themselves, or are replaced if they do not).
        if self.live is None:
            self.group.stop(self.config.stop_grace)
        current = self._current
        case = FailureCase(
            failed_at=failed_at,
            peers=current.assignment.group_world_size - 1,
            window=self.watch.evidence_window(),
        )
        charge = self.watch.judge_failure(failures, case, self.recovery.left)
        decide_s = time.monotonic() - failed_at
        if charge is None:  # closed while this agent waited for evidence
            return self._closed_result(_CLOSED_WHILE_RUNNING)
        recovery = self.recovery
        if charge is Charge.FREE:
            recovery.restarting(self._round_number, "failure", charged=False, decide_s=decide_s)
            return None
        if not recovery.spend(current.assignment.round, current.members):
            recovery.restarting(
                self._round_number, "failure", charged=True, decide_s=decide_s, budget_spent=True
            )
            return self._give_up(failures)
        logger.warning(
            "[%s] worker group failed (%s); restarting, %d of %d %srestarts left",
            self.config.role,
            failures[0].message if failures else "?",
            recovery.left,
            self.config.max_restarts,
            "job-wide " if recovery.job_scope else "",
        )
        recovery.restarting(self._round_number, "failure", charged=True, decide_s=decide_s)
        recovery.failed_again(self._round_number, failed_at)
        return None

    def _give_up(self, failures: list[ProcessFailure]) -> RunResult:
        """The budget is spent: end the job (close the rendezvous), and wait a little
        for the round's other agents to see it closed."""
        current = self._current
        if self.recovery.job_scope:  # the last charge closed the rendezvous
            why = f"the job-wide restart budget ({self.config.max_restarts}) is spent"
        else:
            self.watch.close_rendezvous()
            why = f"max restarts ({self.config.max_restarts}) exhausted"
        wait_for_acknowledgements(
            current.store, current.assignment, self.watch, _CLOSE_SEEN_TIMEOUT
        )
        return self._failed(why, failures)

    def _failed(self, message: str, failures: list[ProcessFailure]) -> RunResult:
        return RunResult(
            AgentState.FAILED, 1, failures=failures, message=message, rounds=self.rounds
        )

    def _closed_result(self, when: str) -> RunResult:
        if self._round is not None:
            acknowledge_close(self._round.store, self._round.assignment)
        if self.recovery.spent_elsewhere:
            return self._failed(
                f"the job-wide restart budget ({self.config.max_restarts}) was spent "
                "(the last failure was on another node)",
                self._last_failures,
            )
        return RunResult(
            AgentState.CLOSED,
            1,
            failures=self._last_failures,
            message=f"the rendezvous of run {self.config.run_id!r} was closed by another agent "
            + when,
            rounds=self.rounds,
        )

    # ------------------------------------------------------- a new round

    @property
    def _current(self) -> _Round:
        """The round joined last (the loop only asks once it has joined one)."""
        assert self._round is not None
        return self._round

    @property
    def _round_number(self) -> int | None:
        return self._round.assignment.round if self._round is not None else None

    def _rendezvous_and_start(self) -> None:
        if self.live is not None and self._round is None:
            self._warm_up()
        joined = self._join()
        while not self.recovery.healthy(joined.assignment):
            self._round = joined  # its events and an exclusion name this round
            joined = self._join()
        self.recovery.settle(joined.assignment.round, joined.members)
        previous, self._round = self._round, joined
        a = joined.assignment
        started = time.monotonic()
        handed = 0
        if self.live is None:
            self.group.start(self._launches(a))
        else:
            handed = self._hand_over(previous, joined)
        self._record_started(a)
        self.rounds += 1
        self.recorder.emit(
            EventKind.WORKERS_STARTED,
            a.round,
            workers=self.config.nproc_per_node - handed,
            handed=handed,
            start_s=time.monotonic() - started,
            since_failure_s=self._since_failure(),
        )
        self._failure_noticed = None
        logger.info(
            "[%s] round %d: group rank %d of %d, global ranks %d..%d of %d, master %s:%d",
            self.config.role,
            a.round,
            a.group_rank,
            a.group_world_size,
            a.base_global_rank,
            a.base_global_rank + self.config.nproc_per_node - 1,
            a.world_size,
            a.master_addr,
            a.master_port,
        )

    def _hand_over(self, previous: _Round | None, joined: _Round) -> int:
        """Live regroup: hand the round ``joined`` to the live workers, start the
        others; returns how many were handed."""
        assert self.live is not None
        a = joined.assignment
        lost = bool(
            previous is not None
            and previous.members is not None
            and joined.members is not None
            and previous.members - joined.members
        ) or any(code is not None for code in self.group.poll().values())
        restarts = self.recovery.spent
        handed, started = self.live.hand_over(
            self.group,
            self._launches(a),
            a.round,
            lambda launch: round_variables(self.config, a, launch.local_rank, restarts),
            lost=lost,
            noticed=self._failure_noticed,
        )
        logger.info(
            "[%s] round %d: %d worker(s) handed the round live, %d started",
            self.config.role,
            a.round,
            handed,
            started,
        )
        return handed

    def _replace_outside_the_group(self) -> None:
        """Live regroup after a local failure: while the exited workers' replacements
        start, be out of the rendezvous if the others may train on without this node
        (the core's admission rule decides), and join once they are ready."""
        assert self.live is not None
        gone = {rank for rank, code in self.group.poll().items() if code is not None}
        if not gone:
            return
        a = self._current.assignment
        me = self.view.node_name
        lost = {str(node) for node in self.view.dead_participants()} - {me}
        view = NewcomerView(
            ready=False,
            member=True,
            may_shrink=self.live.may_shrink(),
            others=a.group_world_size - 1 - len(lost),
            min_nodes=self.config.min_nodes,
        )
        if admission(view) is not Admission.STEP_OUT or not self.view.step_out():
            return
        live = self.live
        live.start_outside(
            self.group, [launch for launch in self._launches(a) if launch.local_rank in gone]
        )
        logger.info(
            "[%s] out of the round while %d replacement(s) start; the others train on",
            self.config.role,
            len(gone),
        )
        # Bounded: this node's surviving workers wait for their next round no longer
        # than --live-timeout, and a replacement not ready by then is started again.
        self._join_when_admitted(
            view, functools.partial(live.ready, self.group), self.config.live_timeout / 2
        )

    def _warm_up(self) -> None:
        """Live, before this agent's first round: start a warm spare per local rank,
        so that the workers' interpreters and imports overlap the rendezvous. When
        the job already trains without this node (a replacement, a spare, a node
        scaling it up), join only once they are warm (the core's admission rule)."""
        assert self.live is not None
        live = self.live
        launches = self._launches(_provisional(self.config))
        live.prepare_spares(self.group, launches[0], self.config.nproc_per_node)
        view = NewcomerView(
            ready=False,
            member=False,
            may_shrink=False,
            others=self.view.running_round_size(),
            min_nodes=self.config.min_nodes,
        )
        if admission(view) is not Admission.STEP_OUT:
            return
        ready = live.spares_warm
        if self.view.knows(_LIVE_SCRIPT):
            # The job's script takes its rounds from the live API: its workers can
            # run it up to job.rounds() before they have a round.
            live.start_outside(self.group, launches)
            ready = functools.partial(live.ready, self.group)
        logger.info("[%s] the job runs: joining once the workers are ready", self.config.role)
        self._join_when_admitted(view, ready, self.config.live_timeout)

    @staticmethod
    def _join_when_admitted(view: NewcomerView, ready: Callable[[], bool], timeout: float) -> None:
        """Wait (up to ``timeout``) until the admission rule says to join, asking
        ``ready`` whether this node's newcomers are."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if admission(dataclasses.replace(view, ready=ready())) is Admission.JOIN:
                return
            time.sleep(_READY_POLL)

    def _live_check(self) -> None:
        if self.live is not None and self._round is not None:
            self.live.check(self.group, self._round.assignment.round)
            if not self._told_live_script and self.live.uses_live_api():
                self.view.tell(_LIVE_SCRIPT)
                self._told_live_script = True

    def _since_failure(self) -> float | None:
        noticed = self._failure_noticed
        return None if noticed is None else time.monotonic() - noticed

    def _join(self) -> _Round:
        """The next round, with this agent's ranks in it agreed.

        Raises:
            AgentError: the agents could not agree on ranks in several rounds in a row.
        """
        attempt = 0
        while True:
            attempt += 1
            started = time.monotonic()
            info = self.handler.next_rendezvous()
            rendezvous_s = time.monotonic() - started
            members = self.watch.round_members()
            last = self._round.assignment.round if self._round is not None else -1
            try:
                assignment = agree_ranks(
                    info.store,
                    info.rank,
                    info.world_size,
                    role=self.config.role,
                    nproc=self.config.nproc_per_node,
                    last_round=last,
                    round_hint=self.view.round if self.view.knows_round else None,
                    choose_master=functools.partial(choose_master, self.config, self.handler, info),
                    dead_peers=self.view.dead_participants,
                )
                self.recorder.emit(
                    EventKind.ROUND,
                    assignment.round,
                    group_rank=assignment.group_rank,
                    group_world_size=assignment.group_world_size,
                    rendezvous_s=rendezvous_s,
                    since_failure_s=self._since_failure(),
                )
                return _Round(assignment, info.store, members)
            except (RoundAbandoned, RuntimeError) as exc:  # store errors are RuntimeErrors
                if attempt == _ASSIGN_ATTEMPTS:
                    raise AgentError(f"could not agree on ranks {attempt} times: {exc}") from exc
                logger.warning("[%s] %s; joining the next round", self.config.role, exc)

    def _launches(self, a: Assignment) -> list[WorkerLaunch]:
        """The launches of this agent's workers in the round ``a`` it is about to start."""
        return worker_launches(
            self.config,
            self.argv,
            a,
            attempt_dir=self._attempt_dir(self.rounds),
            restarts=self.recovery.spent,
            return_values=self.return_values,
        )

    def _attempt_dir(self, index: int) -> str:
        return os.path.join(self._log_root, f"attempt_{index}")

    def _return_files(self, attempt_dir: str, a: Assignment) -> dict[int, str]:
        if not self.return_values:
            return {}
        return return_files(attempt_dir, a, self.config.nproc_per_node)

    def _record_started(self, a: Assignment) -> None:
        """torch's START event for each worker (``--event-log-handler``)."""
        if not self.events.enabled:
            return
        started = [
            StartedWorker(
                local_rank=w.launch.local_rank,
                global_rank=w.launch.global_rank,
                role_rank=a.base_role_rank + w.launch.local_rank,
                role_world_size=a.role_world_size,
                pid=w.pid,
            )
            for w in self.group.workers
        ]
        self.events.workers_started(
            started,
            group_rank=a.group_rank,
            group_world_size=a.group_world_size,
            restarts=self.recovery.spent,
            backend=str(self.handler.get_backend()),
        )
