"""The one seam between the agent and a rendezvous implementation.

:func:`build_handler` maps the launcher's ``--rdzv-backend`` onto a handler:

* ``c10d``, ``etcd``, ``etcd-embedded`` (and the entry-point names
  ``rallypoint-c10d``, ``rallypoint-etcd``, ``rallypoint-etcd-embedded``): rallypoint's
  own handler, :func:`rallypoint.adapters.create_handler` (``etcd-embedded`` also
  starts this node's etcd member, which the handler's ``close`` stops);
* ``torch-c10d``, ``torch-etcd``: torch's dynamic rendezvous, kept for comparisons
  (``bench/recovery.py``);
* ``static``: torch's fixed-membership rendezvous (``--rdzv-endpoint``, else
  ``--master-addr/--master-port``; ``--node-rank``), torchrun's default.

The agent uses the optional extras of rallypoint's handler (``round``,
``dead_participants``, ``wait_for_change``) through :class:`HandlerView`, which
degrades to polling when a handler lacks them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from ..core.driver import MemberResponse, Verdict
from .config import (
    BACKEND_IMPLEMENTATIONS,
    TORCH_BACKENDS,
    ConfigError,
    LaunchConfig,
    rdzv_options_read,
)
from .errors import AgentError

logger = logging.getLogger("rallypoint.agent")

_CONF_FLAG = "--rdzv-conf"

__all__ = ["HandlerView", "build_handler"]


def build_handler(config: LaunchConfig) -> RendezvousHandler:
    """Create the rendezvous handler ``config`` asks for (``config`` checked the
    backend, the endpoint and the options when it was made).

    Raises:
        ConfigError: no endpoint where the backend needs one, an endpoint host
            (or ``--master-addr``) the resolver says does not exist, or an
            ``--rdzv-conf`` value the backend's handler cannot take.

    The handler gets only the ``--rdzv-conf`` keys it reads.
    """
    backend = config.rdzv_backend
    # Keys this backend does not read were reported by ``config`` (a warning each).
    read = rdzv_options_read(backend)
    configs: dict[str, Any] = {k: v for k, v in config.rdzv_configs.items() if k in read}
    if config.is_static:
        configs["rank"] = config.node_rank
    elif config.standalone:
        configs.setdefault("is_host", True)
    rallypoint = BACKEND_IMPLEMENTATIONS[backend] == "rallypoint"
    if rallypoint:
        configs.update(config.shared_recovery_settings())
    if not rallypoint:  # rallypoint's handler checks its endpoint itself
        config.check_endpoint_resolves()
    params = RendezvousParameters(
        backend=backend if rallypoint else TORCH_BACKENDS[backend],
        endpoint=config.rendezvous_endpoint(),
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **configs,
    )
    if rallypoint:
        from ..adapters import create_handler

        return create_handler(params)
    try:
        return get_rendezvous_handler(params)
    except ValueError as exc:
        # torch's handlers parse their options as they are built: a value they
        # cannot take (read_timeout=abc, timeout=1.5) is the user's input.
        raise ConfigError(f"{_CONF_FLAG} for the {backend} backend: {exc}") from None


class HandlerView:
    """The agent's view of a handler: torch's interface plus rallypoint's optional extras."""

    def __init__(self, handler: RendezvousHandler) -> None:
        self.handler = handler
        self._dead = getattr(handler, "dead_participants", None)
        self._wait = getattr(handler, "wait_for_change", None)
        self._fence = getattr(handler, "must_fence", None)
        self._charge = getattr(handler, "charge_restart", None)
        self._exclude = getattr(handler, "exclude", None)
        self._respond = getattr(handler, "member_response", None)

    @property
    def node_name(self) -> str:
        """This node as the handler names it (rallypoint's: ``addr_pid_localid``),
        else ``host_pid`` of this agent."""
        node = getattr(self.handler, "node", None)
        return str(node) if node is not None else f"{socket.gethostname()}_{os.getpid()}"

    @property
    def counts_restarts(self) -> bool:
        """Whether the handler keeps the job-wide restart count (rallypoint's)."""
        return self._charge is not None

    @property
    def restarts(self) -> int:
        """The job-wide restart count (only where :attr:`counts_restarts`)."""
        return int(self.handler.restarts)  # type: ignore[attr-defined]

    def charge_restart(self, round_: int) -> bool:
        """Count a failure of round ``round_`` job-wide; True: that spent the
        budget (the rendezvous is closed). Only where :attr:`counts_restarts`."""
        assert self._charge is not None
        return bool(self._charge(round_))

    def exclude(self) -> int:
        """Exclude this node; the first round it may take part in again."""
        if self._exclude is None:
            raise AgentError(
                "this rendezvous backend cannot exclude a node (use c10d, etcd or etcd-embedded, "
                "rallypoint's own)"
            )
        return int(self._exclude())

    @property
    def knows_round(self) -> bool:
        """Whether the handler reports a group-wide round number itself."""
        return isinstance(getattr(type(self.handler), "round", None), property)

    @property
    def round(self) -> int:
        """The round of the last completed rendezvous (only if :attr:`knows_round`)."""
        return int(self.handler.round)  # type: ignore[attr-defined]

    @property
    def detects_dead_peers(self) -> bool:
        """Whether the handler reports participants that left or stopped heartbeating."""
        return self._dead is not None

    @property
    def keep_alive(self) -> tuple[float, int] | None:
        """The handler's (keep-alive interval, attempts before a node is dead), where
        it says (rallypoint's: its settings); None elsewhere."""
        settings = getattr(self.handler, "settings", None)
        interval = getattr(settings, "keep_alive_interval", None)
        attempts = getattr(settings, "keep_alive_max_attempt", None)
        if not isinstance(interval, (int, float)) or not isinstance(attempts, int):
            return None
        return float(interval), attempts

    @property
    def fences(self) -> bool:
        """Whether the handler keeps a lease this node must fence on (rallypoint's)."""
        return self._fence is not None

    def must_fence(self) -> bool:
        """Whether this node's lease ran out: it could not renew its heartbeat for so
        long that its peers may declare it dead, so its workers must stop now
        (docs/design.md, decision 7). Asks no backend; False if unsupported."""
        return self._fence is not None and bool(self._fence())

    @property
    def follows_core(self) -> bool:
        """Whether the handler answers :meth:`member_response` (rallypoint's: the
        core's rule), rather than only torch's questions."""
        return self._respond is not None

    def member_response(self) -> tuple[MemberResponse, Verdict]:
        """The core's response to the group now, and the verdict it was decided on
        (only where :attr:`follows_core`)."""
        assert self._respond is not None
        response, verdict = self._respond()
        return response, verdict

    def dead_participants(self) -> frozenset[Any]:
        """Participants of the current round presumed dead (empty if unsupported)."""
        if self._dead is None:
            return frozenset()
        return frozenset(self._dead())

    def wait(self, timeout: float) -> None:
        """Block until the shared state may have changed or ``timeout`` passes."""
        if self._wait is not None:
            self._wait(timeout)
        else:
            time.sleep(timeout)

    def leave(self) -> None:
        """Take this node out of the rendezvous now and release the handler (a stop
        signal). rallypoint's handler has ``leave()`` (out of the shared state at
        once) and ``close()`` (stop heartbeats, release the backend); torch's have
        neither, and their peers notice the silence after the liveness window."""
        for name in ("leave", "close"):
            method = getattr(self.handler, name, None)
            if callable(method):
                try:
                    method()
                except Exception as exc:
                    logger.debug("handler.%s(): %s: %s", name, type(exc).__name__, exc)

    def running_round_size(self) -> int:
        """How many nodes train in the complete round this node is not part of (0:
        none, or the handler does not tell: torch's)."""
        sync = getattr(self.handler, "sync", None)
        if sync is None or not self.detects_dead_peers:
            return 0
        try:
            state = sync.refresh()
        except Exception as exc:
            logger.debug("reading the rendezvous state: %s: %s", type(exc).__name__, exc)
            return 0
        running = state.complete and not state.closed
        return len(state.participants) if running else 0

    def tell(self, fact: str) -> None:
        """Record ``fact`` for the job's other agents (rallypoint's handler; a no-op
        on torch's). Never raises: a fact is a hint."""
        tell = getattr(self.handler, "tell", None)
        if callable(tell):
            try:
                tell(fact)
            except Exception as exc:
                logger.debug("recording %r: %s: %s", fact, type(exc).__name__, exc)

    def knows(self, fact: str) -> bool:
        """Whether an agent of the job recorded ``fact`` (False where unknown)."""
        knows = getattr(self.handler, "knows", None)
        if not callable(knows):
            return False
        try:
            return bool(knows(fact))
        except Exception as exc:
            logger.debug("reading %r: %s: %s", fact, type(exc).__name__, exc)
            return False

    def step_out(self) -> bool:
        """Take this node out of its round but keep the handler, to join again later
        (its newcomers start meanwhile). True when it is out: rallypoint's handler
        can; torch's cannot (False), so the node stays in and its peers wait."""
        if self._dead is None or not callable(getattr(self.handler, "leave", None)):
            return False
        try:
            self.handler.leave()  # type: ignore[attr-defined]
        except Exception as exc:
            logger.warning(
                "cannot step out of the round (%s: %s); staying in", type(exc).__name__, exc
            )
            return False
        return True

    def shut_down(self, *, close_rendezvous: bool) -> None:
        """Release the handler at the end of the run, closing the rendezvous first
        when ``close_rendezvous`` (torch's ``shutdown()`` closes it; rallypoint's
        handler also has ``close()`` to release its backend and any store it
        hosts). Never raises: the run's own result is what matters now."""
        started = time.monotonic()
        release = getattr(self.handler, "close", None)
        if not callable(release) or close_rendezvous:
            with contextlib.suppress(Exception):
                self.handler.shutdown()
        if callable(release):
            with contextlib.suppress(Exception):
                release()
        logger.debug("handler shut down in %.3f s", time.monotonic() - started)

    def endpoint(self) -> str:
        """The endpoint in use, when the handler tells (rallypoint), else ''."""
        return str(getattr(self.handler, "endpoint", "") or "")
