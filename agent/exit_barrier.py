"""The exit barrier: an agent whose workers all succeeded waits for the round's other
agents before it leaves, so that the job ends together (or not at all).

Phase one: agents count themselves in; the last one sets ``done``. While waiting,
a node waiting to join means a peer's workers failed and it is re-rendezvousing:
the job is not done, so this agent rejoins too. A dead peer can never arrive, so
waiting also stops when one is reported.

Phase two: an agent that saw ``done`` closes the rendezvous (the job is over;
closing a closed one costs a read), counts itself out, then waits until all have.
Whichever agent hosts the store therefore stays until every agent has seen
``done`` and closed: none of them then finds the store gone and logs a failed
close; once counted out, a vanished store is harmless.

A job that ends in failure ends the same way, shorter: the agent that gave up and
closed the rendezvous waits (bounded) until the round's other agents have seen
it closed (:func:`acknowledge_close`, :func:`wait_for_acknowledgements`), so
that, if it hosts the store, they report the failure instead of a lost store.
"""

from __future__ import annotations

import logging
import time

from torch.distributed import Store

from .group_watch import GroupWatch
from .ranks import KEY_PREFIX, Assignment
from .signals import SignalReceived

__all__ = ["acknowledge_close", "exit_barrier", "wait_for_acknowledgements"]

logger = logging.getLogger("rallypoint.agent")

#: The longest pause between looks at the count of agents gone (phase two).
_LEAVE_PAUSE = 0.05


def exit_barrier(store: Store, a: Assignment, watch: GroupWatch, timeout: float) -> bool:
    """Wait, at most ``timeout`` s, until every agent of round ``a`` has finished;
    False: rejoin instead (the job goes on). Closes the rendezvous once all have.

    ``store`` is the round's store; ``watch`` tells about the group and closes the
    rendezvous.
    """
    if a.group_world_size == 1:
        return True
    prefix = f"{KEY_PREFIX}/{a.round}/exit"
    deadline = time.monotonic() + timeout
    try:
        arrived = _arrive(store, prefix, a.group_world_size, watch, deadline, timeout)
    except SignalReceived:
        raise
    except Exception as exc:
        logger.warning("exit barrier: %s: %s", type(exc).__name__, exc)
        return True
    if arrived is not None:
        return arrived
    watch.close_rendezvous()
    try:
        _leave(store, prefix, a.group_world_size, watch, deadline)
    except SignalReceived:
        raise
    except Exception as exc:
        # Everyone has seen "done" before the store's host may leave.
        logger.debug("exit barrier, phase two: %s: %s", type(exc).__name__, exc)
    return True


def _arrive(
    store: Store, prefix: str, agents: int, watch: GroupWatch, deadline: float, timeout: float
) -> bool | None:
    """Phase one. None: every agent arrived (``done``); else the barrier's answer."""
    if store.add(f"{prefix}/count", 1) >= agents:
        store.set(f"{prefix}/done", "1")
    while not store.check([f"{prefix}/done"]):
        if time.monotonic() >= deadline:
            logger.warning("exit barrier: not every agent finished within %.0f s", timeout)
            return True
        if watch.handler.num_nodes_waiting() > 0:
            logger.info("exit barrier: a node is waiting to join; rejoining")
            return False
        if watch.peers_gone("exit barrier"):
            if store.check([f"{prefix}/done"]):
                return None  # closed by an agent that saw "done" first
            return True
        watch.view.wait(watch.interval)
    return None


def _leave(store: Store, prefix: str, agents: int, watch: GroupWatch, deadline: float) -> None:
    """Phase two: count this agent out and wait (bounded) until every agent has."""
    store.add(f"{prefix}/left", 1)
    _wait_for_count(store, f"{prefix}/left", agents, watch, deadline)


def _wait_for_count(
    store: Store, key: str, target: int, watch: GroupWatch, deadline: float
) -> None:
    """Wait until the counter ``key`` reaches ``target``, until ``deadline``, or
    until a peer is gone (it would never count itself)."""
    while store.add(key, 0) < target:
        # Not peers_gone: the rendezvous is closed now, by design.
        if time.monotonic() >= deadline or watch.view.dead_participants():
            return
        time.sleep(min(watch.interval, _LEAVE_PAUSE))


def _closed_seen(a: Assignment) -> str:
    """The counter of the agents of round ``a`` that saw the rendezvous closed."""
    return f"{KEY_PREFIX}/{a.round}/closed-seen"


def acknowledge_close(store: Store, a: Assignment) -> None:
    """Tell the agent that closed the rendezvous of round ``a`` that this one saw it
    (best effort: the store may be gone already)."""
    try:
        store.add(_closed_seen(a), 1)
    except Exception as exc:
        logger.debug("acknowledging the close: %s: %s", type(exc).__name__, exc)


def wait_for_acknowledgements(
    store: Store, a: Assignment, watch: GroupWatch, timeout: float
) -> None:
    """After closing the rendezvous of round ``a`` on a failure: wait, at most
    ``timeout`` s, until the round's other agents have seen it closed."""
    deadline = time.monotonic() + timeout
    try:
        _wait_for_count(store, _closed_seen(a), a.group_world_size - 1, watch, deadline)
    except Exception as exc:
        logger.debug("waiting for the close to be seen: %s: %s", type(exc).__name__, exc)
