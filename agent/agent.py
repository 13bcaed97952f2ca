"""The elastic agent: rendezvous, start workers, watch them and the group, repeat.

One :class:`ElasticAgent` runs on each node. Its loop::

    rendezvous -> agree on ranks, round and master through the round's store
    -> start workers -> monitor:
         all workers exited 0        -> exit barrier, close the rendezvous, done
         a worker failed             -> restart (spends one of max_restarts) or give up
         nodes waiting / a peer gone -> restart into a new round (budget untouched)
         rendezvous closed elsewhere -> stop

A restart stops every local worker (SIGTERM, a short grace, SIGKILL) and joins the
next round. The group-wide round number is exported to workers as
``RALLYPOINT_ROUND``: it is the same on every worker of a round, unlike torch's
``TORCHELASTIC_RESTART_COUNT``, which counts this agent's own restarts.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
)

from .charging import Charge, FailureCase, evidence_window, judge, refund
from .config import BACKENDS, LaunchConfig, numa_command_prefix
from .errors import AgentError, ProcessFailure
from .logs import EventLog, StartedWorker, console_prefix, make_log_root, worker_logs
from .rendezvous import HandlerView
from .workers import WorkerGroup, WorkerLaunch

__all__ = ["AgentState", "Assignment", "ElasticAgent", "RunResult", "SignalReceived"]

logger = logging.getLogger("rallypoint.agent")

ROUND_ENV = "RALLYPOINT_ROUND"
_KEY_PREFIX = "rallypoint/agent"
_CLOSED_CHECK_PERIOD = 1.0
#: How often the lease guard asks whether this node must fence (no IO: cheap).
_LEASE_CHECK_PERIOD = 0.05
#: The fence grace where the handler does not say its keep-alive interval.
_FENCE_GRACE = 1.0


class _LeaseGuard:
    """Stops the workers once this node's lease runs out (docs/design.md, decision 7).

    A thread of its own: the agent's loop may sit in a call to a store it can no
    longer reach (a partition) for far longer than the lease lasts. It asks the
    handler, which reads nothing, and stops the workers without reaping them; the
    agent's loop then sees them fail and joins a new round without charging it.
    """

    def __init__(self, view: HandlerView, group: WorkerGroup, grace: float) -> None:
        self._view = view
        self._group = group
        self._grace = grace
        #: set once the guard stopped the workers; the agent clears it for a new round
        self.fenced = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lease-guard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5.0)

    def _watch(self) -> None:
        while not self._closing.wait(_LEASE_CHECK_PERIOD):
            if self.fenced.is_set() or not self._group.workers:
                continue
            try:
                due = self._view.must_fence()
            except Exception as exc:  # a handler bug must not kill the guard
                logger.debug("must_fence(): %s: %s", type(exc).__name__, exc)
                continue
            if not due:
                continue
            logger.warning(
                "this node has not renewed its heartbeat for so long that its peers may "
                "declare it dead: stopping its workers now (fencing), so that no round "
                "formed without it trains beside them"
            )
            if self._group.fence(self._grace):
                self.fenced.set()
_ASSIGN_ATTEMPTS = 5
_STORE_GET_TIMEOUT = 300.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class AgentState(enum.Enum):
    """How an agent's run ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CLOSED = "closed"
    INTERRUPTED = "interrupted"


class SignalReceived(Exception):
    """The agent received SIGINT/SIGTERM/SIGHUP/SIGQUIT; it stops its workers and exits."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}")


class _RoundAbandoned(Exception):
    """The round's store exchange cannot finish: a peer died or the store failed."""


@dataclass(frozen=True)
class Assignment:
    """This agent's place in one round, agreed through the round's store."""

    round: int
    group_rank: int
    group_world_size: int
    base_global_rank: int
    world_size: int
    base_role_rank: int
    role_world_size: int
    master_addr: str
    master_port: int
    use_agent_store: bool


@dataclass
class RunResult:
    """The outcome of :meth:`ElasticAgent.run`.

    ``return_files`` maps global rank to the file each worker of the last round
    was told to write its return value to (see :mod:`rallypoint.agent.api`).
    """

    state: AgentState
    exit_code: int
    failures: list[ProcessFailure] = field(default_factory=list)
    message: str = ""
    rounds: int = 0
    return_files: dict[int, str] = field(default_factory=dict)


@contextlib.contextmanager
def _signals_raise(signals: Sequence[signal.Signals] = _STOP_SIGNALS) -> Iterator[None]:
    """Turn termination signals into :class:`SignalReceived` in the main thread."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SignalReceived(signum)

    previous: dict[signal.Signals, Any] = {}
    try:
        for sig in signals:
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:
                # Not the main thread: the caller handles signals itself.
                break
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _ignore_signals(signals: Sequence[signal.Signals] = _STOP_SIGNALS) -> None:
    with contextlib.suppress(ValueError):  # not the main thread: nothing was installed
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            sock.bind(("", 0))
        return int(sock.getsockname()[1])


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
        self.remaining_restarts = config.max_restarts
        self.attempt = 0
        self.rounds = 0
        self._last_round = -1
        self._assignment: Assignment | None = None
        self._store: Store | None = None
        self._log_root = log_root or make_log_root(config.log_dir, config.run_id)
        self._next_closed_check = 0.0
        self._closed = False
        #: the nodes of the current round, where the handler tells (rallypoint's)
        self._members: frozenset[str] | None = None
        #: the nodes of a failed round whose failure was charged, until the next round
        self._charged_round: frozenset[str] | None = None
        self._guard = (
            _LeaseGuard(self.view, self.group, self._fence_grace()) if self.view.fences else None
        )
        self.events = EventLog(
            config.event_log_handler,
            run_id=config.run_id,
            role=config.role,
            max_restarts=config.max_restarts,
            entry_point=os.path.basename(self.argv[0]) if self.argv else "",
        )

    # ----------------------------------------------------------------- the loop

    def run(self) -> RunResult:
        """Run the job on this node; always stops the workers and releases the handler.

        A job that ends (success, failure beyond the budget) closes the rendezvous.
        A termination signal only takes this node out: like torchrun, the agent then
        does not close the rendezvous, so the other nodes regroup without it.
        """
        interrupted = unreachable = False
        stop_with = signal.SIGTERM
        with _signals_raise(self.config.stop_signals), self._lease_guard():
            try:
                return self._run()
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
                _ignore_signals(self.config.stop_signals)
                self.group.stop(self.config.stop_grace, stop_with)
                if interrupted:
                    self._leave_handler()
                else:
                    self._shutdown_handler(close_rendezvous=not unreachable)

    @contextlib.contextmanager
    def _lease_guard(self) -> Iterator[None]:
        if self._guard is None:
            yield
            return
        self._guard.start()
        try:
            yield
        finally:
            self._guard.close()

    def _leave_handler(self) -> None:
        # rallypoint's handler may offer leave() (take this node out of the shared
        # state now) and close() (stop heartbeats, release the backend); without
        # leave() the peers notice the silence after the liveness window.
        for name in ("leave", "close"):
            method = getattr(self.handler, name, None)
            if callable(method):
                try:
                    method()
                except Exception as exc:
                    logger.debug("handler.%s(): %s: %s", name, type(exc).__name__, exc)

    def _shutdown_handler(self, close_rendezvous: bool = True) -> None:
        # torch's shutdown() closes the rendezvous; rallypoint's handler also has
        # close() to release its backend and any store it hosts.
        started = time.monotonic()
        release = getattr(self.handler, "close", None)
        if not callable(release) or (close_rendezvous and not self._closed):
            with contextlib.suppress(Exception):
                self.handler.shutdown()
        if callable(release):
            with contextlib.suppress(Exception):
                release()
        logger.debug("handler shut down in %.3f s", time.monotonic() - started)

    def _run(self) -> RunResult:
        config = self.config
        first_failures: list[ProcessFailure] = []
        while True:
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
                return RunResult(
                    AgentState.CLOSED,
                    1,
                    failures=first_failures,
                    message=(
                        f"the rendezvous of run {config.run_id!r} was closed by another "
                        "agent (the job finished or gave up) before this node could rejoin"
                    ),
                    rounds=self.rounds,
                )
            outcome, failures = self._monitor()
            if outcome == "failed" and self._guard is not None and self._guard.fenced.is_set():
                # The lease guard stopped them: a new round, without spending a restart.
                self.group.stop(config.stop_grace)
                self._guard.fenced.clear()
                logger.warning("[%s] workers fenced; joining a new round", config.role)
                continue
            if outcome == "succeeded":
                if not self._exit_barrier():
                    self.group.stop(config.stop_grace)
                    continue
                if not self._closed:  # the exit barrier closes it while every agent is up
                    self._close_rendezvous()
                return RunResult(
                    AgentState.SUCCEEDED,
                    0,
                    rounds=self.rounds,
                    return_files=self._return_files(),
                )
            if outcome == "failed":
                first_failures = failures
                failed_at = time.monotonic()
                # The other local workers may hang in a collective: stop them first.
                self.group.stop(config.stop_grace)
                charge = self._charge_for(failures, failed_at)
                if charge is Charge.FREE:
                    continue
                if charge is Charge.CHARGE and self.remaining_restarts > 0:
                    self.remaining_restarts -= 1
                    self._charged_round = self._members
                    logger.warning(
                        "[%s] worker group failed (%s); restarting, %d of %d restarts left",
                        config.role,
                        failures[0].message if failures else "?",
                        self.remaining_restarts,
                        config.max_restarts,
                    )
                    continue
                if charge is Charge.CHARGE:
                    self._close_rendezvous()
                    return RunResult(
                        AgentState.FAILED,
                        1,
                        failures=failures,
                        message=f"max restarts ({config.max_restarts}) exhausted",
                        rounds=self.rounds,
                    )
                outcome = "closed"  # while this agent waited for evidence
            if outcome == "closed":
                self.group.stop(config.stop_grace)
                return RunResult(
                    AgentState.CLOSED,
                    1,
                    failures=first_failures,
                    message=(
                        f"the rendezvous of run {config.run_id!r} was closed by another agent "
                        "while this node's workers ran (another node gave up?)"
                    ),
                    rounds=self.rounds,
                )
            # Membership changed: a new round, without spending the restart budget.
            self.group.stop(config.stop_grace)

    def _monitor(self) -> tuple[str, list[ProcessFailure]]:
        """Watch workers and group until something calls for action; return what happened."""
        interval = self.config.monitor_interval
        while True:
            exits = self.group.poll()
            failed = [rank for rank, code in exits.items() if code not in (None, 0)]
            if failed:
                return "failed", self._failures(failed)
            if all(code == 0 for code in exits.values()):
                logger.debug("[%s] all local workers succeeded", self.config.role)
                return "succeeded", []
            reason = self._membership_change()
            if reason:
                logger.info("[%s] %s; starting a new round", self.config.role, reason)
                return "membership", []
            if self._closed_elsewhere():
                return "closed", []
            self.view.wait(interval)

    def _charge_for(self, failures: Sequence[ProcessFailure], failed_at: float) -> Charge | None:
        """Whether a local failure spends the restart budget (:mod:`.charging`):
        FREE when the round's membership changes around it, else CHARGE; an agent
        with no restart left first waits, bounded, for that evidence. None: the
        rendezvous was closed meanwhile."""
        a = self._assignment
        case = FailureCase(
            failed_at=failed_at,
            peers=a.group_world_size - 1 if a is not None else 0,
            window=self._evidence_window(),
        )
        what = failures[0].message if failures else "?"
        announced = False
        while True:
            reason = self._membership_change()
            charge = judge(
                case,
                now=time.monotonic(),
                membership_changed=bool(reason),
                remaining=self.remaining_restarts,
            )
            if charge is Charge.FREE:
                logger.warning(
                    "[%s] worker group failed (%s) as the round changed (%s); "
                    "starting a new round without spending a restart",
                    self.config.role,
                    what,
                    reason,
                )
            if charge is not Charge.WAIT:
                return charge
            if not announced:
                logger.warning(
                    "[%s] worker group failed (%s) and no restart is left; waiting up to "
                    "%.1f s for a lost peer that would explain it before giving up",
                    self.config.role,
                    what,
                    case.deadline - time.monotonic(),
                )
                announced = True
            if self._closed_elsewhere():
                return None
            left = case.deadline - time.monotonic()
            self.view.wait(max(0.0, min(self.config.monitor_interval, left)))

    def _fence_grace(self) -> float:
        """How long fenced workers get between SIGTERM and SIGKILL: the stop grace, at
        most a quarter keep-alive interval (within the lease's margin of half an
        interval, docs/design.md decision 7)."""
        keep_alive = self.view.keep_alive
        if keep_alive is None:
            return min(self.config.stop_grace, _FENCE_GRACE)
        return min(self.config.stop_grace, keep_alive[0] / 4)

    def _evidence_window(self) -> float:
        """:func:`.charging.evidence_window` of the handler's keep-alive settings;
        0 for handlers that do not report dead peers (torch's)."""
        keep_alive = self.view.keep_alive
        if not self.view.detects_dead_peers or keep_alive is None:
            return 0.0
        return evidence_window(*keep_alive)

    def _round_members(self) -> frozenset[str] | None:
        """The nodes of the round just joined, where the handler shows them
        (rallypoint's: the state its join returned on); None elsewhere."""
        state = getattr(getattr(self.handler, "sync", None), "state", None)
        participants = getattr(state, "participants", None)
        if participants is None or getattr(state, "round", None) != getattr(
            self.handler, "round", None
        ):
            return None
        return frozenset(str(node) for node in participants)

    def _membership_change(self) -> str:
        waiting = self.handler.num_nodes_waiting()
        if waiting > 0:
            return f"{waiting} node(s) waiting to join"
        dead = self.view.dead_participants()
        if dead:
            names = ", ".join(sorted(map(str, dead)))
            return f"peer(s) left the round or stopped heartbeating: {names}"
        return ""

    def _closed_elsewhere(self) -> bool:
        now = time.monotonic()
        if now < self._next_closed_check:
            return False
        self._next_closed_check = now + _CLOSED_CHECK_PERIOD
        try:
            return bool(self.handler.is_closed())
        except RendezvousError:
            return False

    # ------------------------------------------------------------ a new round

    def _rendezvous_and_start(self) -> None:
        for attempt in range(1, _ASSIGN_ATTEMPTS + 1):
            info = self.handler.next_rendezvous()
            members = self._round_members()
            self._store = info.store
            try:
                assignment = self._assign(info.store, info.rank, info.world_size, info)
                break
            except (_RoundAbandoned, RuntimeError) as exc:  # store errors are RuntimeErrors
                if attempt == _ASSIGN_ATTEMPTS:
                    raise AgentError(f"could not agree on ranks {attempt} times: {exc}") from exc
                logger.warning("[%s] %s; joining the next round", self.config.role, exc)
        self._assignment = assignment
        charged, self._charged_round = self._charged_round, None
        if refund(charged, members) and self.remaining_restarts < self.config.max_restarts:
            # The failure was a peer's loss seen early (docs/design.md, decision 6).
            self.remaining_restarts += 1
            assert charged is not None and members is not None
            logger.warning(
                "[%s] round %d formed without %s: the last failure came from losing it; "
                "its restart is refunded, %d of %d left",
                self.config.role,
                assignment.round,
                ", ".join(sorted(charged - members)),
                self.remaining_restarts,
                self.config.max_restarts,
            )
        self._members = members
        self.rounds += 1
        launches = self._launches(assignment)
        self.group.start(launches)
        self._record_started(assignment)
        self.attempt += 1
        logger.info(
            "[%s] round %d: group rank %d of %d, global ranks %d..%d of %d, master %s:%d",
            self.config.role,
            assignment.round,
            assignment.group_rank,
            assignment.group_world_size,
            assignment.base_global_rank,
            assignment.base_global_rank + self.config.nproc_per_node - 1,
            assignment.world_size,
            assignment.master_addr,
            assignment.master_port,
        )

    def _assign(
        self, store: Store, group_rank: int, group_world_size: int, info: Any
    ) -> Assignment:
        """Agree on ranks, the round number and the master address through the store.

        Every agent publishes its role and worker count; group rank 0 computes each
        agent's base ranks (ordered by group rank) and the master, and publishes them.
        Without a handler-provided round, rank 0 also picks the round as one past the
        largest round any participant has seen, so all agents agree on it.
        """
        config = self.config
        knows_round = self.view.knows_round
        round_hint = self.view.round if knows_round else None
        prefix = f"{_KEY_PREFIX}/{round_hint if round_hint is not None else 'r'}"
        mine = {"role": config.role, "nproc": config.nproc_per_node, "seen": self._last_round}
        store.set(f"{prefix}/info/{group_rank}", json.dumps(mine))
        if group_rank == 0:
            infos = [
                json.loads(self._get(store, f"{prefix}/info/{rank}"))
                for rank in range(group_world_size)
            ]
            round_number = (
                round_hint if round_hint is not None else max(int(i["seen"]) for i in infos) + 1
            )
            master_addr, master_port, agent_store = self._choose_master(info)
            world = sum(int(i["nproc"]) for i in infos)
            role_sizes: dict[str, int] = {}
            for i in infos:
                role_sizes[i["role"]] = role_sizes.get(i["role"], 0) + int(i["nproc"])
            base, role_base = 0, dict.fromkeys(role_sizes, 0)
            for rank, i in enumerate(infos):
                assigned = {
                    "round": round_number,
                    "base": base,
                    "world": world,
                    "role_base": role_base[i["role"]],
                    "role_world": role_sizes[i["role"]],
                    "master_addr": master_addr,
                    "master_port": master_port,
                    "agent_store": agent_store,
                }
                store.set(f"{prefix}/assigned/{rank}", json.dumps(assigned))
                base += int(i["nproc"])
                role_base[i["role"]] += int(i["nproc"])
        got = json.loads(self._get(store, f"{prefix}/assigned/{group_rank}"))
        self._last_round = int(got["round"])
        return Assignment(
            round=int(got["round"]),
            group_rank=group_rank,
            group_world_size=group_world_size,
            base_global_rank=int(got["base"]),
            world_size=int(got["world"]),
            base_role_rank=int(got["role_base"]),
            role_world_size=int(got["role_world"]),
            master_addr=str(got["master_addr"]),
            master_port=int(got["master_port"]),
            use_agent_store=bool(got["agent_store"]),
        )

    def _get(self, store: Store, key: str) -> bytes:
        """``store.get`` that gives up when a peer dies instead of blocking for minutes.

        Raises:
            _RoundAbandoned: a peer left the round or stopped heartbeating, the
                store failed, or the key did not appear in time.
        """
        deadline = time.monotonic() + _STORE_GET_TIMEOUT
        pause = 0.002
        try:
            while not store.check([key]):
                if time.monotonic() > deadline:
                    raise _RoundAbandoned(f"no {key!r} in the store after {_STORE_GET_TIMEOUT} s")
                dead = self.view.dead_participants()
                if dead:
                    names = ", ".join(sorted(map(str, dead)))
                    raise _RoundAbandoned(
                        f"peer(s) {names} left the round or stopped heartbeating "
                        "while ranks were assigned"
                    )
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
            return bytes(store.get(key))
        except (RuntimeError, ValueError) as exc:  # torch's store errors are RuntimeErrors
            raise _RoundAbandoned(f"the round's store failed: {exc}") from exc

    def _choose_master(self, info: Any) -> tuple[str, int, bool]:
        config = self.config
        if BACKENDS.get(config.rdzv_backend) == "torch":
            # torch's handlers decide, as under torchrun: the static one hosts its store
            # at the master address for the whole job; the dynamic ones share the
            # rank-0 agent's store unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, when
            # they publish a free port for rank 0's first worker to host.
            bootstrap = getattr(info, "bootstrap_store_info", None)
            shared = bool(getattr(self.handler, "use_agent_store", True))
            if bootstrap is not None:
                return str(bootstrap.master_addr), int(bootstrap.master_port), shared
            if config.is_static:
                return config.master_addr, config.master_port, True
        # rallypoint's rendezvous: rank 0's first worker hosts a fresh store each
        # round (torch's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 behaviour), so nothing
        # from an earlier round (or from agents with a different restart count) leaks in.
        addr = config.local_addr or ("127.0.0.1" if config.standalone else socket.getfqdn())
        return addr, _free_port(addr), False

    def _launches(self, a: Assignment) -> list[WorkerLaunch]:
        config = self.config
        attempt_dir = os.path.join(self._log_root, f"attempt_{self.attempt}")
        base_env = config.worker_base_env()
        envs: dict[int, dict[str, str]] = {}
        for local_rank in range(config.nproc_per_node):
            global_rank = a.base_global_rank + local_rank
            env = dict(base_env)
            env.update(
                {
                    "LOCAL_RANK": str(local_rank),
                    "RANK": str(global_rank),
                    "GROUP_RANK": str(a.group_rank),
                    "ROLE_RANK": str(a.base_role_rank + local_rank),
                    "ROLE_NAME": config.role,
                    "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
                    "WORLD_SIZE": str(a.world_size),
                    "GROUP_WORLD_SIZE": str(a.group_world_size),
                    "ROLE_WORLD_SIZE": str(a.role_world_size),
                    "MASTER_ADDR": a.master_addr,
                    "MASTER_PORT": str(a.master_port),
                    "TORCHELASTIC_RESTART_COUNT": str(
                        config.max_restarts - self.remaining_restarts
                    ),
                    "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
                    "TORCHELASTIC_RUN_ID": config.run_id,
                    "TORCHELASTIC_USE_AGENT_STORE": str(a.use_agent_store),
                    "TORCHELASTIC_SIGNALS_TO_HANDLE": config.signals_to_handle,
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get(
                        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
                    ),
                    ROUND_ENV: str(a.round),
                }
            )
            if config.virtual_local_rank:
                # torch's virtual local rank: each worker sees its device as device 0.
                env["LOCAL_RANK"] = "0"
                env["CUDA_VISIBLE_DEVICES"] = config.virtual_device(local_rank)
            elif config.bind_gpus:
                env["CUDA_VISIBLE_DEVICES"] = config.visible_devices[local_rank]
            if self.return_values:
                rank_dir = os.path.join(attempt_dir, str(local_rank))
                env["RALLYPOINT_RETURN_FILE"] = os.path.join(rank_dir, "return.json")
            envs[local_rank] = env
        # Sets TORCHELASTIC_ERROR_FILE (torch's LogsSpecs does it when one is given).
        logs = worker_logs(config, attempt_dir, envs)
        launches = []
        for local_rank, env in envs.items():
            global_rank = a.base_global_rank + local_rank
            numa: tuple[str, ...] = ()
            if config.numa_options is not None:
                numa = numa_command_prefix(config.numa_options, local_rank)
            where = logs[local_rank]
            launches.append(
                WorkerLaunch(
                    local_rank=local_rank,
                    global_rank=global_rank,
                    argv=[*numa, *self.argv],
                    env=env,
                    log_dir=os.path.join(attempt_dir, str(local_rank)),
                    error_file=where.error_file,
                    redirect=where.redirect,
                    tee=where.tee,
                    console=where.console,
                    prefix=console_prefix(
                        config.log_line_prefix_template, config.role, global_rank, local_rank
                    ),
                    stdout_file=where.stdout_file,
                    stderr_file=where.stderr_file,
                    duplicate_stdout=where.duplicate_stdout,
                    duplicate_stderr=where.duplicate_stderr,
                )
            )
        return launches

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
            restarts=self.config.max_restarts - self.remaining_restarts,
            backend=str(self.handler.get_backend()),
        )

    # ------------------------------------------------------------- endings

    def _failures(self, local_ranks: Sequence[int]) -> list[ProcessFailure]:
        assert self._assignment is not None
        by_rank = {w.launch.local_rank: w for w in self.group.workers}
        failures = []
        for local_rank in local_ranks:
            worker = by_rank[local_rank]
            code = worker.poll()
            failures.append(
                ProcessFailure.from_exit(
                    role=self.config.role,
                    local_rank=local_rank,
                    global_rank=worker.launch.global_rank,
                    pid=worker.pid,
                    exitcode=code if code is not None else 0,
                    exit_time=worker.exit_time or time.time(),
                    error_file=worker.launch.error_file,
                )
            )
        return sorted(failures, key=lambda f: f.time)

    def _exit_barrier(self) -> bool:
        """Wait until every agent of the round has finished; False: rejoin instead.

        Phase one: agents count themselves in; the last one sets ``done``. While
        waiting, a node waiting to join means a peer's workers failed and it is
        re-rendezvousing: the job is not done, so this agent rejoins too (False).
        A dead peer can never arrive, so waiting also stops when one is reported.

        Phase two: an agent that saw ``done`` closes the rendezvous (the job is
        over; closing a closed one costs a read), counts itself out, then waits
        until all have. Whichever agent hosts the store therefore stays until every
        agent has seen ``done`` and closed: none of them then finds the store gone
        and logs a failed close (issue 12, point 6); once counted out, a vanished
        store is harmless.
        """
        a, store = self._assignment, self._store
        if a is None or store is None or a.group_world_size == 1:
            return True
        prefix = f"{_KEY_PREFIX}/{a.round}/exit"
        deadline = time.monotonic() + self.config.exit_barrier_timeout
        try:
            if store.add(f"{prefix}/count", 1) >= a.group_world_size:
                store.set(f"{prefix}/done", "1")
            while not store.check([f"{prefix}/done"]):
                if time.monotonic() >= deadline:
                    logger.warning(
                        "exit barrier: not every agent finished within %.0f s",
                        self.config.exit_barrier_timeout,
                    )
                    return True
                if self.handler.num_nodes_waiting() > 0:
                    logger.info("exit barrier: a node is waiting to join; rejoining")
                    return False
                if self._peers_gone("exit barrier"):
                    if store.check([f"{prefix}/done"]):
                        break  # closed by an agent that saw "done" first
                    return True
                self.view.wait(self.config.monitor_interval)
        except SignalReceived:
            raise
        except Exception as exc:
            logger.warning("exit barrier: %s: %s", type(exc).__name__, exc)
            return True
        self._close_rendezvous()
        try:
            store.add(f"{prefix}/left", 1)
            while store.add(f"{prefix}/left", 0) < a.group_world_size:
                # Not _peers_gone: the rendezvous is closed now, by design.
                if time.monotonic() >= deadline or self.view.dead_participants():
                    break
                time.sleep(min(self.config.monitor_interval, 0.05))
        except SignalReceived:
            raise
        except Exception as exc:
            # Everyone has seen "done" before the store's host may leave.
            logger.debug("exit barrier, phase two: %s: %s", type(exc).__name__, exc)
        return True

    def _peers_gone(self, where: str) -> bool:
        dead = self.view.dead_participants()
        if dead:
            logger.warning(
                "%s: peer(s) %s left the round or stopped heartbeating; not waiting for them",
                where,
                ", ".join(sorted(map(str, dead))),
            )
            return True
        return self._closed_elsewhere()

    def _close_rendezvous(self) -> None:
        started = time.monotonic()
        try:
            # torch declares RendezvousHandler.set_closed without annotations.
            self.handler.set_closed()  # type: ignore[no-untyped-call]
            self._closed = True
        except Exception as exc:
            logger.debug("closing the rendezvous: %s: %s", type(exc).__name__, exc)
        logger.debug("rendezvous closed in %.3f s", time.monotonic() - started)

    def _return_files(self) -> dict[int, str]:
        if not self.return_values or self._assignment is None:
            return {}
        attempt_dir = os.path.join(self._log_root, f"attempt_{self.attempt - 1}")
        return {
            self._assignment.base_global_rank + lr: os.path.join(
                attempt_dir, str(lr), "return.json"
            )
            for lr in range(self.config.nproc_per_node)
        }

    @property
    def log_root(self) -> str:
        """The directory holding this agent's ``attempt_N/<local_rank>/`` logs."""
        return self._log_root
