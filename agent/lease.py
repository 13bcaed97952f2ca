"""The lease guard: stops this node's workers once its lease runs out (docs/design.md,
decision 7).

A node whose heartbeat has not been renewed for about a liveness window may be
declared dead by its peers, who then form a round without it. Its workers must not
keep training beside that round, so a thread of its own asks the handler
(:meth:`HandlerView.must_fence`, which reads nothing) and stops the workers without
reaping them. The agent's loop, which may sit for far longer than the lease in a call
to a store it can no longer reach (a partition), then sees them fail and joins a new
round without charging the failure to the restart budget.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from .rendezvous import HandlerView
from .workers import WorkerGroup

__all__ = ["LeaseGuard", "fence_grace"]

logger = logging.getLogger("rallypoint.agent")

#: How often the guard asks whether this node must fence (no IO: cheap).
_CHECK_PERIOD = 0.05
#: The fence grace where the handler does not say its keep-alive interval.
_DEFAULT_GRACE = 1.0


def fence_grace(view: HandlerView, stop_grace: float) -> float:
    """How long fenced workers get between SIGTERM and SIGKILL: ``stop_grace``, at
    most a quarter keep-alive interval (within the lease's margin of half an
    interval, docs/design.md decision 7)."""
    keep_alive = view.keep_alive
    if keep_alive is None:
        return min(stop_grace, _DEFAULT_GRACE)
    return min(stop_grace, keep_alive[0] / 4)


class LeaseGuard:
    """Watches this node's lease while :meth:`running` and fences ``group`` once the
    lease runs out.

    Attributes:
        fenced: set once the guard stopped the workers; the agent clears it when it
            has handled that (joined a new round).
    """

    def __init__(self, view: HandlerView, group: WorkerGroup, grace: float) -> None:
        self._view = view
        self._group = group
        self._grace = grace
        self.fenced = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lease-guard", daemon=True)

    @contextlib.contextmanager
    def running(self) -> Iterator[LeaseGuard]:
        """Watch the lease while the ``with`` block runs."""
        self._thread.start()
        try:
            yield self
        finally:
            self._closing.set()
            self._thread.join(timeout=5.0)

    def _watch(self) -> None:
        while not self._closing.wait(_CHECK_PERIOD):
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
