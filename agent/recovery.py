"""How a node recovers beyond torchrun's rule: whose restart budget a failure
spends, when a node takes itself out of the job, and the pre-flight health check.

* The restart budget is this agent's (:class:`.charging.RestartBudget`,
  torchrun's rule) or, with ``--restart-scope job``, the whole job's, counted in
  the shared state by the rendezvous (docs/design.md, decision 10).
* A node excludes itself (``ExcludeOp`` through the handler) when its own health
  check fails, or when its workers fail ``--exclude-after`` times within
  ``--exclude-window``; it then stands by as a spare for ``--exclusion-rounds``.
* Each of these is also an event (:mod:`.events`).

:class:`~rallypoint.agent.agent.ElasticAgent` asks; this module decides nothing the
core decides (what counts once per round, who may join while excluded).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Set

from .charging import RestartBudget
from .config import LaunchConfig, RestartScope
from .events import EventKind, EventRecorder
from .health import FailureWindow, HealthResult, run_health_check
from .ranks import Assignment
from .rendezvous import HandlerView

__all__ = ["Recovery"]

logger = logging.getLogger("rallypoint.agent")


class Recovery:
    """One agent's restart budget, exclusions and health checks.

    Args:
        config: the launch configuration (``max_restarts``, ``restart_scope``,
            ``exclude_after``/``exclude_window``, ``health_check``).
        view: the agent's view of its rendezvous handler.
        recorder: where the events go.
    """

    def __init__(self, config: LaunchConfig, view: HandlerView, recorder: EventRecorder) -> None:
        self.config = config
        self.view = view
        self.recorder = recorder
        #: this agent's own budget (torchrun's rule; unused with a job-wide one)
        self.budget = RestartBudget(config.max_restarts)
        self._window = (
            FailureWindow(config.exclude_after, config.exclude_window)
            if config.exclude_after
            else None
        )

    # -- the restart budget ------------------------------------------------------

    @property
    def job_scope(self) -> bool:
        """Whether ``max_restarts`` is the whole job's (``--restart-scope job``)."""
        return self.config.restart_scope is RestartScope.JOB and self.view.counts_restarts

    @property
    def spent(self) -> int:
        """Restarts spent: this agent's, or the whole job's."""
        return self.view.restarts if self.job_scope else self.budget.spent

    @property
    def left(self) -> int:
        return max(0, self.config.max_restarts - self.spent)

    @property
    def spent_elsewhere(self) -> bool:
        """The job-wide budget was spent (by any node): the rendezvous is closed."""
        return self.job_scope and self.view.restarts > self.config.max_restarts

    def spend(self, round_: int, members: Set[Hashable] | None) -> bool:
        """Charge a failure of this node's workers in ``round_`` (whose nodes are
        ``members``); False: the budget is spent (a job-wide one is then closed)."""
        if self.job_scope:
            # Counted once per round, whichever node's workers failed; the failure
            # after the last restart closes the rendezvous for every node.
            return not self.view.charge_restart(round_)
        return self.budget.spend(members)

    def settle(self, round_: int, members: Set[Hashable] | None) -> None:
        """A new round formed with ``members``: refund this agent's last charge if a
        member of the failed round is missing from it (the failure was a lost
        peer's, seen early; docs/design.md, decision 6). Job-wide charges are never
        refunded: the job's count only grows."""
        if self.job_scope:
            return
        lost = self.budget.settle(members)
        if lost:
            logger.warning(
                "[%s] round %d formed without %s: the last failure came from losing it; "
                "its restart is refunded, %d of %d left",
                self.config.role,
                round_,
                ", ".join(sorted(map(str, lost))),
                self.budget.remaining,
                self.config.max_restarts,
            )

    def restarting(
        self, round_: int | None, cause: str, *, charged: bool, **fields: object
    ) -> None:
        """Record that this node leaves round ``round_`` for a new one, and why."""
        self.recorder.emit(
            EventKind.RESTART, round_, cause=cause, charged=charged, restarts=self.spent, **fields
        )

    # -- exclusion -----------------------------------------------------------------

    def failed_again(self, round_: int | None, failed_at: float) -> None:
        """Count a failure of this node's workers; exclude the node once they failed
        ``exclude_after`` times within ``exclude_window``."""
        if self._window is not None and self._window.record(failed_at):
            limit, window = self.config.exclude_after, self.config.exclude_window
            self.exclude(round_, f"{limit} failures within {window:g} s")

    def exclude(self, round_: int | None, reason: str) -> None:
        """Take this node out of the job for ``exclusion_rounds`` rounds: it leaves
        its round, and its next joins stand by as a spare."""
        until = self.view.exclude()
        logger.warning(
            "[%s] excluding this node until round %d: %s", self.config.role, until, reason
        )
        self.recorder.emit(EventKind.EXCLUSION, round_, reason=reason, until=until)
        if self._window is not None:
            self._window.reset()

    # -- the health check ----------------------------------------------------------

    def healthy(self, a: Assignment) -> bool:
        """Run the pre-flight health check of round ``a`` (``--health-check``);
        False: this node must not start workers in it (it excluded itself, or a
        peer failed its check) and joins the next round instead."""
        check = self.config.health_check
        if not check.enabled:
            return True
        env = {
            "MASTER_ADDR": a.master_addr,
            "MASTER_PORT": str(a.master_port),
            "RANK": str(a.group_rank),
            "WORLD_SIZE": str(a.group_world_size),
            "RALLYPOINT_ROUND": str(a.round),
        }
        result = run_health_check(check, round_env=env, device=_check_device())
        self._record(a.round, result)
        if result.ok:
            return True
        logger.warning(
            "[%s] round %d: health check failed (%s): %s",
            self.config.role,
            a.round,
            result.stage,
            result.reason,
        )
        reason = f"health check failed in stage {result.stage}: {result.reason}"
        if result.exclude_self:
            self.exclude(a.round, reason)
        elif result.fault == "group":
            # Nobody's own check failed, the collective did: a failure of the group,
            # counted like a failure of this node's workers.
            self.failed_again(a.round, time.monotonic())
        return False

    def _record(self, round_: int, result: HealthResult) -> None:
        self.recorder.emit(
            EventKind.HEALTH_CHECK,
            round_,
            ok=result.ok,
            seconds=result.seconds,
            import_seconds=result.import_seconds,
            stage=result.stage,
            fault=result.fault,
            reason=result.reason,
        )


def _check_device() -> str:
    """The device the health check's matmul runs on: every visible CUDA device where
    there is one."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
