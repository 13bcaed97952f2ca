"""``RallypointHandler``: torch's ``RendezvousHandler`` on rallypoint's core.

torch's interface (``next_rendezvous``, ``is_closed``, ``set_closed``,
``num_nodes_waiting``, ``get_run_id``, ``get_backend``, ``shutdown``,
``use_agent_store``), so torch's own elastic agent can drive it, plus what torch
lacks: :meth:`RallypointHandler.dead_participants` (participants of this node's
round that left it or whose heartbeat stopped, timed on this node's monotonic
clock), :meth:`RallypointHandler.leave` (leave the round now, so that the peers
regroup at once), :meth:`RallypointHandler.wait_for_change` (react to a change at
once instead of polling), the ``round`` and ``endpoint`` properties, and the
``stable_ranks`` setting. Every decision behind them is the core's
(:class:`rallypoint.core.RendezvousNode`); :class:`StateSync` carries it out.

The store handed out by ``next_rendezvous`` is namespaced per run and round
(``rallypoint/<run_id>/round/<round>``). The workers' bootstrap store
(``MASTER_ADDR``/``MASTER_PORT``) is a TCPStore server that each handler starts
when it is created and publishes under ``rallypoint/<run_id>/boot/<node>`` before
it ever joins; the rank-0 node's server serves the round (torch also keeps one
server per rank-0 agent across rounds). Publishing ahead means that when a round
completes, no node waits for rank 0 to start a server and announce it: the
address is one read away.

The settings every node must share (:data:`rallypoint.core.codec.SHARED_SETTINGS`:
node counts, keep-alive, stable ranks, restart budget, exclusion rounds) are published under
``rallypoint/<run_id>/settings`` by the first node that joins; every later node
compares its own with them before it touches the state, and one started with other
settings gets a :class:`RendezvousSettingsError` naming each difference, instead of
a state that is valid only for some of the nodes.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from ..core import (
    Action,
    ChargeRestartOp,
    CloseOp,
    Done,
    ExcludeOp,
    ExitOp,
    JoinOp,
    KeepAliveOp,
    LeaveOp,
    Membership,
    NodeDesc,
    Operator,
    Settings,
    keep_alive_period,
)
from ..core import errors as core_errors
from ..core.codec import encode_shared_settings, shared_settings_differences
from ..core.driver import MemberResponse, Verdict, member_response
from .backend import RendezvousBackend
from .c10d.store import StoreBindError, host_tcp_store
from .errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousSettingsError,
    RendezvousStateError,
    RendezvousTimeoutError,
    describe,
)
from .sync import StateSync

__all__ = ["RallypointHandler"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_local_ids = itertools.count()


class RallypointHandler(RendezvousHandler):
    """A rendezvous handler driven by rallypoint's pure core.

    Args:
        backend: where the shared state lives (memory, c10d, etcd).
        settings: the rendezvous settings (same on every node).
        local_addr: this node's address (node identity and bootstrap store host).
        store: the torch Store every node reaches, handed to the agent with a
            per-round prefix; defaults to the c10d backend's own store (required
            for other backends: e.g. an EtcdStore, or a HashStore in one process).
        poll_interval: the longest a wait lasts without a change notification.
        retry_window: how long a rendezvous keeps retrying an unreachable backend
            before it raises RendezvousConnectionError (see :class:`StateSync`).
        local_id: distinguishes handlers in one process (default: a counter).
    """

    def __init__(
        self,
        backend: RendezvousBackend,
        settings: Settings,
        *,
        local_addr: str,
        store: Store | None = None,
        poll_interval: float = 1.0,
        retry_window: float = 0.0,
        local_id: int | None = None,
    ) -> None:
        if store is None:
            store = getattr(backend, "store", None)
            if store is None:
                raise ValueError(f"backend {backend.name!r} has no c10d store: pass a store")
        self._backend = backend
        self._settings = settings
        self._local_addr = local_addr
        self._store = store
        local = next(_local_ids) if local_id is None else local_id
        self.node = NodeDesc(local_addr, os.getpid(), local)
        self._sync = StateSync(
            backend,
            self.node,
            settings,
            poll_interval=poll_interval,
            retry_window=retry_window,
        )
        self._round = -1
        self._joined: Membership | None = None
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._boot_prefix = f"rallypoint/{settings.run_id}/boot"
        self._boot_store = PrefixStore(self._boot_prefix, store)
        # What the job's agents tell one another beside the state (no decision
        # reads it: a hint that lets a node get ready sooner).
        self._facts = PrefixStore(f"rallypoint/{settings.run_id}/facts", store)
        self._settings_checked = False
        self._bootstrap_server: TCPStore | None = None
        self._bootstrap_info: RendezvousStoreInfo | None = None
        #: Monitor queries re-read the backend at most this often.
        self.cache_duration = min(1.0, settings.keep_alive_interval / 2)
        self._publish_bootstrap()

    # -- properties ---------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def sync(self) -> StateSync:
        """The sync engine (state view, counters) of this handler."""
        return self._sync

    @property
    def round(self) -> int:
        """The round of the last completed ``next_rendezvous()`` (-1 before the first)."""
        return self._round

    @property
    def endpoint(self) -> str:
        """The backend's ``host:port`` (or path) actually in use."""
        return self._backend.endpoint

    @property
    def use_agent_store(self) -> bool:
        """Whether workers share the rendezvous store (torchrun's agent asks): yes,
        unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as with torch's handler."""
        return os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"

    def get_backend(self) -> str:
        return self._backend.name

    def get_run_id(self) -> str:
        return self._settings.run_id

    # -- errors -------------------------------------------------------------------

    def _describe(self, what: str, check: str) -> str:
        return describe(what, run_id=self._settings.run_id, endpoint=self.endpoint, check=check)

    def _raise_for(self, action: Action, what: str, timeout: float) -> None:
        if action is Action.FINISH:
            return
        if action is Action.ERROR_CLOSED:
            raise RendezvousClosedError(
                self._describe(
                    f"{what}: the rendezvous is closed",
                    "whether the job already finished; start a new run id to run again",
                )
            )
        if action is Action.ERROR_GRACEFUL_EXIT:
            raise RendezvousGracefulExitError(
                self._describe(
                    f"{what}: the rendezvous closed while {self.node} was redundant",
                    "nothing: this node was not needed and may exit",
                )
            )
        if action is Action.ERROR_TIMEOUT:
            raise RendezvousTimeoutError(
                self._describe(
                    f"{what} did not finish within {timeout:g} s",
                    f"that at least min_nodes={self._settings.min_nodes} nodes start with the "
                    "same run id and endpoint, and that the timeout is long enough",
                )
            )
        raise AssertionError(f"unexpected terminal action {action}")  # pragma: no cover

    # -- the rendezvous -----------------------------------------------------------

    def next_rendezvous(self) -> RendezvousInfo:
        """Leave the current round (if any) and join the next; block until it completes.

        No random initial delay (torch sleeps 0-0.3 s): simultaneous joiners are
        spread by the jittered backoff on lost compare-and-sets instead.

        Raises:
            RendezvousClosedError, RendezvousTimeoutError, RendezvousGracefulExitError,
            RendezvousConnectionError, RendezvousStateError.
        """
        self._stop_heartbeats()
        self._publish_bootstrap()
        self._check_settings()
        join_timeout = self._settings.join_timeout
        deadline = self._sync.now() + join_timeout
        log.info("%s joins the next round of rendezvous %r", self.node, self._settings.run_id)
        while True:
            left = self._sync.run(ExitOp(), deadline)
            self._raise_for(left.action, "leaving the round", join_timeout)
            # ExitOp has just read (or written) the state: JoinOp starts from it.
            done = self._sync.run(JoinOp(), deadline, fresh=True)
            self._raise_for(done.action, "joining the rendezvous", join_timeout)
            if not done.rejoin:
                break
            log.warning("%s: round %d lost its rank 0; rejoining", self.node, done.state.round)
        joined = done.joined
        assert joined is not None
        rank0 = next(node for node, r in done.state.participants.items() if r == 0)
        self._round, self._joined = joined.round, joined
        self._start_heartbeats()
        log.info(
            "%s joined round %d of rendezvous %r as rank %d of %d",
            self.node,
            joined.round,
            self._settings.run_id,
            joined.rank,
            joined.world_size,
        )
        store = PrefixStore(f"rallypoint/{self._settings.run_id}/round/{self._round}", self._store)
        return RendezvousInfo(store, joined.rank, joined.world_size, self._bootstrap_of(rank0))

    def _publish_bootstrap(self) -> None:
        """Start this node's bootstrap server and publish its address (once)."""
        if self._bootstrap_info is not None:
            return
        try:
            # listening only on local_addr: the store is unauthenticated (docs/security.md)
            server = host_tcp_store(
                self._local_addr, 0, timedelta(seconds=self._settings.join_timeout)
            )
        except (RuntimeError, ValueError, StoreBindError) as exc:
            raise RendezvousConnectionError(
                self._describe(
                    f"cannot host the workers' store on {self._local_addr} ({exc})",
                    "that local_addr is an address of this host",
                )
            ) from exc
        info = RendezvousStoreInfo(self._local_addr, server.port)
        self._call_store(
            lambda: self._boot_store.set(str(self.node), f"{info.master_addr}:{info.master_port}"),
            "publishing this node's bootstrap store address",
        )
        self._bootstrap_server, self._bootstrap_info = server, info

    def _check_settings(self) -> None:
        """Publish this node's shared settings if it is the run's first, else compare
        them with the published ones (once per handler, before the first join).

        Raises:
            RendezvousSettingsError: they differ (each difference is named).
            RendezvousStateError: the settings key holds something else.
        """
        if self._settings_checked:
            return
        key = f"rallypoint/{self._settings.run_id}/settings"
        ours = encode_shared_settings(self._settings)
        # compare_set with an empty expected value creates a missing key and returns
        # what is stored either way: the first node's settings win, atomically.
        published = self._call_store(
            # torch's Store stub says str; the binding takes bytes.
            lambda: bytes(self._store.compare_set(key, "", ours)),  # type: ignore[arg-type]
            "publishing this node's settings",
        )
        if published != ours:
            try:
                differences = shared_settings_differences(self._settings, published)
            except core_errors.RendezvousStateError as exc:
                raise RendezvousStateError(
                    self._describe(
                        f"{exc}, read from key {key!r} of the rendezvous store",
                        "that nothing else writes to this run id; start a fresh run id",
                    )
                ) from exc
            if differences:
                raise RendezvousSettingsError(
                    self._describe(
                        f"{self.node} was started with other settings than the run it joins; "
                        f"the nodes disagree on {'; '.join(differences)}",
                        "that every node is started with the same --nnodes (min:max) and "
                        "rendezvous options; if an earlier job used this run id, start with "
                        "a fresh run id",
                    )
                )
        self._settings_checked = True

    def _bootstrap_of(self, node: NodeDesc) -> RendezvousStoreInfo:
        if node == self.node and self._bootstrap_info is not None:
            return self._bootstrap_info
        raw = self._call_store(
            lambda: self._boot_store.get(str(node)), "reading the rank-0 bootstrap store address"
        )
        host, _, port = bytes(raw).decode("utf-8", "replace").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RendezvousStateError(
                self._describe(
                    f"the bootstrap store address of rank 0 ({node}) under key "
                    f"{self._boot_prefix}/{node!s} of the rendezvous store is "
                    f"{bytes(raw)[:60]!r}, not <host>:<port>",
                    "that nothing else writes to this run id; start a fresh run id",
                )
            )
        return RendezvousStoreInfo(host, int(port))

    def _call_store(self, op: Callable[[], _T], what: str) -> _T:
        try:
            return op()
        except (RuntimeError, ValueError) as exc:
            raise RendezvousConnectionError(
                self._describe(
                    f"{what} failed ({exc.__class__.__name__}: {str(exc)[:200]})",
                    "that the rendezvous store is reachable",
                )
            ) from exc

    def tell(self, fact: str) -> None:
        """Record ``fact`` for the job's other agents (see :meth:`knows`).

        Raises:
            RendezvousConnectionError: the store cannot be reached.
        """
        self._call_store(lambda: self._facts.set(fact, "1"), f"recording {fact!r}")

    def knows(self, fact: str) -> bool:
        """Whether an agent of the job recorded ``fact`` (:meth:`tell`).

        Raises:
            RendezvousConnectionError: the store cannot be reached.
        """
        return bool(self._call_store(lambda: self._facts.check([fact]), f"reading {fact!r}"))

    def is_closed(self) -> bool:
        return self._sync.refresh(self.cache_duration).closed

    def set_closed(self) -> None:
        self._run_briefly(CloseOp(), "closing the rendezvous")

    def _run_briefly(self, op: Operator, what: str) -> Done:
        """Run a one-write operator within ``close_timeout``; raise on its error."""
        timeout = self._settings.close_timeout
        done = self._sync.run(op, self._sync.now() + timeout)
        self._raise_for(done.action, what, timeout)
        return done

    def _step_out(self, op: Operator, what: str) -> Done:
        """Stop this node's round (heartbeats, membership) and run ``op``: it leaves
        the shared state."""
        self._stop_heartbeats()
        self._joined = None
        return self._run_briefly(op, what)

    def member_response(self) -> tuple[MemberResponse, Verdict]:
        """What this node, whose workers run, does about its group now: the core's
        checked rule (:func:`rallypoint.core.driver.member_response`, the one the
        node's own member lifecycle and the simulator's agent follow) over the
        verdict of a look at the round (:meth:`StateSync.watch`) and the view it
        came from. Reads the backend at most every ``cache_duration`` seconds."""
        verdict = self._sync.watch(self._joined, self.cache_duration)
        return member_response(verdict, self._sync.state), verdict

    def num_nodes_waiting(self) -> int:
        """Nodes in the wait list (after removing the ones this node sees dead).
        Reads the backend at most every ``cache_duration`` seconds."""
        return self._sync.watch(self._joined, self.cache_duration).waiting

    def must_fence(self) -> bool:
        """Whether this node's workers must stop now: it has not renewed its
        heartbeat for so long that its peers may declare it dead (a lease;
        docs/design.md, decision 7). Reads nothing, so it answers while the
        backend is unreachable; False before this node joined a round."""
        return self._joined is not None and self._sync.must_fence()

    def dead_participants(self) -> frozenset[NodeDesc]:
        """Participants of this node's current round that are gone: they left the
        round, or this node (or a peer) saw their heartbeat counter stand still for
        ``keep_alive_interval * keep_alive_max_attempt`` of its own monotonic time.
        Contains this node itself when its peers removed it. Reads the backend at
        most every ``cache_duration`` seconds."""
        if self._joined is None:
            return frozenset()
        return self._sync.watch(self._joined, self.cache_duration).lost

    def leave(self) -> None:
        """Leave the current round now (an agent stopping on a signal or a
        preemption notice): the peers see the state change and regroup at once,
        instead of waiting out the liveness window. Does not close the rendezvous.

        Raises:
            RendezvousTimeoutError, RendezvousConnectionError, RendezvousStateError.
        """
        self._step_out(LeaveOp(), "leaving the rendezvous")

    @property
    def restarts(self) -> int:
        """Failure-caused rounds the whole job has started (the job-wide restart
        budget's count). Reads the backend at most every ``cache_duration`` seconds."""
        return self._sync.refresh(self.cache_duration).restarts

    def charge_restart(self, round_: int) -> bool:
        """Count the failure of this node's workers in round ``round_`` in the job's
        restarts (once per round, whichever node's workers failed; a failure
        reported after its round ended costs nothing). True when it spent the last
        of ``restart_budget``: the rendezvous is then closed for every node.

        Raises:
            RendezvousTimeoutError, RendezvousConnectionError, RendezvousStateError.
        """
        done = self._run_briefly(ChargeRestartOp(round_), "counting a restart")
        budget = self._settings.restart_budget
        return budget is not None and done.state.restarts > budget

    def exclude(self) -> int:
        """Take this node out of the job for ``exclusion_rounds`` rounds: it leaves
        its round now, and its next joins stand by as a spare until the round
        returned (the first it may take part in again) opens.

        Raises:
            RendezvousTimeoutError, RendezvousConnectionError, RendezvousStateError.
        """
        done = self._step_out(ExcludeOp(), "excluding this node")
        return done.state.excluded.get(self.node, done.state.round)

    def wait_for_change(self, timeout: float) -> None:
        """Block until the shared state changes or ``timeout`` seconds pass; the next
        query (``num_nodes_waiting``, ``is_closed``, ...) then reads afresh."""
        self._sync.wait_for_change(timeout)
        self._sync.refresh()

    def shutdown(self) -> bool:
        """Stop heartbeats and close the rendezvous (torch's semantics): True on success."""
        self._stop_heartbeats()
        try:
            self.set_closed()
            return True
        except core_errors.RendezvousError as exc:
            log.warning("closing rendezvous %r failed: %s", self._settings.run_id, exc)
            return False

    def close(self) -> None:
        """Stop heartbeats and release the backend and hosted stores (not in torch's API)."""
        self._stop_heartbeats()
        self._bootstrap_server = None
        self._backend.close()

    # -- heartbeats ---------------------------------------------------------------

    def _start_heartbeats(self) -> None:
        self._hb_stop = threading.Event()
        stop = self._hb_stop
        self._hb_thread = threading.Thread(
            target=self._heartbeat_loop,
            args=(stop,),
            name=f"rallypoint-heartbeat-{self._settings.run_id}",
            daemon=True,
        )
        self._hb_thread.start()

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        settings = self._settings
        while not stop.wait(keep_alive_period(settings)):
            try:
                deadline = self._sync.now() + settings.heartbeat_timeout
                self._sync.run(KeepAliveOp(), deadline, fresh=True)
            except core_errors.RendezvousError as exc:
                log.warning("heartbeat of %s failed: %s", self.node, exc)

    def _stop_heartbeats(self) -> None:
        thread, self._hb_thread = self._hb_thread, None
        self._hb_stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._settings.heartbeat_timeout + 1.0)
