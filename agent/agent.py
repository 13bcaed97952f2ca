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
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
)

from .config import LaunchConfig, Std
from .errors import AgentError, ProcessFailure
from .logs import make_log_root
from .rendezvous import HandlerView
from .workers import WorkerGroup, WorkerLaunch

__all__ = ["AgentState", "Assignment", "ElasticAgent", "RunResult", "SignalReceived"]

logger = logging.getLogger("rallypoint.agent")

ROUND_ENV = "RALLYPOINT_ROUND"
_KEY_PREFIX = "rallypoint/agent"
_CLOSED_CHECK_PERIOD = 1.0
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
def _signals_raise() -> Iterator[None]:
    """Turn termination signals into :class:`SignalReceived` in the main thread."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SignalReceived(signum)

    previous: dict[signal.Signals, Any] = {}
    try:
        for sig in _STOP_SIGNALS:
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:
                # Not the main thread: the caller handles signals itself.
                break
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _ignore_signals() -> None:
    with contextlib.suppress(ValueError):  # not the main thread: nothing was installed
        for sig in _STOP_SIGNALS:
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

    # ----------------------------------------------------------------- the loop

    def run(self) -> RunResult:
        """Run the job on this node; always stops the workers and releases the handler.

        A job that ends (success, failure beyond the budget) closes the rendezvous.
        A termination signal only takes this node out: like torchrun, the agent then
        does not close the rendezvous, so the other nodes regroup without it.
        """
        interrupted = False
        with _signals_raise():
            try:
                return self._run()
            except SignalReceived as sig:
                interrupted = True
                logger.warning("%s: stopping workers and leaving the rendezvous", sig)
                return RunResult(
                    AgentState.INTERRUPTED, 128 + sig.signum, message=str(sig), rounds=self.rounds
                )
            finally:
                # A second signal must not cut the cleanup short.
                _ignore_signals()
                self.group.stop(self.config.stop_grace)
                if interrupted:
                    self._leave_handler()
                else:
                    self._shutdown_handler()

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

    def _shutdown_handler(self) -> None:
        # torch's shutdown() closes the rendezvous; rallypoint's handler also has
        # close() to release its backend and any store it hosts.
        started = time.monotonic()
        release = getattr(self.handler, "close", None)
        if not (self._closed and callable(release)):
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
            if outcome == "succeeded":
                if not self._exit_barrier():
                    self.group.stop(config.stop_grace)
                    continue
                self._close_rendezvous()
                return RunResult(
                    AgentState.SUCCEEDED,
                    0,
                    rounds=self.rounds,
                    return_files=self._return_files(),
                )
            if outcome == "failed":
                first_failures = failures
                if self.remaining_restarts > 0:
                    self.remaining_restarts -= 1
                    logger.warning(
                        "[%s] worker group failed (%s); restarting, %d of %d restarts left",
                        config.role,
                        failures[0].message if failures else "?",
                        self.remaining_restarts,
                        config.max_restarts,
                    )
                    self.group.stop(config.stop_grace)
                    continue
                self.group.stop(config.stop_grace)
                self._close_rendezvous()
                return RunResult(
                    AgentState.FAILED,
                    1,
                    failures=failures,
                    message=f"max restarts ({config.max_restarts}) exhausted",
                    rounds=self.rounds,
                )
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
            self._store = info.store
            try:
                assignment = self._assign(info.store, info.rank, info.world_size, info)
                break
            except (_RoundAbandoned, RuntimeError) as exc:  # store errors are RuntimeErrors
                if attempt == _ASSIGN_ATTEMPTS:
                    raise AgentError(f"could not agree on ranks {attempt} times: {exc}") from exc
                logger.warning("[%s] %s; joining the next round", self.config.role, exc)
        self._assignment = assignment
        self.rounds += 1
        launches = self._launches(assignment)
        self.group.start(launches)
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
        if config.is_static:
            # torch's static rendezvous hosts its store at --master-addr:--master-port
            # for the whole job; workers share it, as under torchrun.
            bootstrap = getattr(info, "bootstrap_store_info", None)
            if bootstrap is not None:
                return str(bootstrap.master_addr), int(bootstrap.master_port), True
            return config.master_addr, config.master_port, True
        # Rank 0's first worker hosts a fresh store each round: nothing from an
        # earlier round (or from agents with a different restart count) can leak in.
        addr = config.local_addr or ("127.0.0.1" if config.standalone else socket.getfqdn())
        return addr, _free_port(addr), False

    def _launches(self, a: Assignment) -> list[WorkerLaunch]:
        config = self.config
        attempt_dir = os.path.join(self._log_root, f"attempt_{self.attempt}")
        base_env = config.worker_base_env()
        launches = []
        for local_rank in range(config.nproc_per_node):
            global_rank = a.base_global_rank + local_rank
            rank_dir = os.path.join(attempt_dir, str(local_rank))
            error_file = os.path.join(rank_dir, "error.json")
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
                    "TORCHELASTIC_ERROR_FILE": error_file,
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get(
                        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
                    ),
                    ROUND_ENV: str(a.round),
                }
            )
            if config.bind_gpus:
                env["CUDA_VISIBLE_DEVICES"] = config.visible_devices[local_rank]
            if self.return_values:
                env["RALLYPOINT_RETURN_FILE"] = os.path.join(rank_dir, "return.json")
            launches.append(
                WorkerLaunch(
                    local_rank=local_rank,
                    global_rank=global_rank,
                    argv=self.argv,
                    env=env,
                    log_dir=rank_dir,
                    error_file=error_file,
                    redirect=config.redirects.get(local_rank, Std.NONE),
                    tee=config.tee.get(local_rank, Std.NONE),
                    console=(
                        config.local_ranks_filter is None or local_rank in config.local_ranks_filter
                    ),
                    prefix=f"[{config.role}/{global_rank}]: ",
                )
            )
        return launches

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

        Phase two: an agent that saw ``done`` counts itself out, then waits until
        all have. Whichever agent hosts the store therefore stays until every
        agent has seen ``done``; once counted out, a vanished store is harmless.
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
                    return True
                self.view.wait(self.config.monitor_interval)
        except SignalReceived:
            raise
        except Exception as exc:
            logger.warning("exit barrier: %s: %s", type(exc).__name__, exc)
            return True
        try:
            store.add(f"{prefix}/left", 1)
            while store.add(f"{prefix}/left", 0) < a.group_world_size:
                if time.monotonic() >= deadline or self._peers_gone("exit barrier"):
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
