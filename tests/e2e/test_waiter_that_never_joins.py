"""A node that announces itself and then never joins costs one round, not a storm.

Two real agents (``python -m rallypoint.run``, tiny workers, loopback c10d) train
in a round with room for a third node. A third node, made in this process from the
same handler the agents use, puts itself on the wait list and then never runs its
join again (an agent whose main thread is stuck after announcing itself), while
its heartbeat thread keeps its heartbeat moving, so nobody can declare it dead.
The agents regroup for it once; the round that forms without it moves it to the
redundancy list, and nobody regroups for it again. Before that rule the agents
started a new round for it over and over (hundreds of rounds in seconds). No peer
admits it to the new round on its behalf either: from the wait list alone it would
hold a place in a round it never trains in, and every peer would wait on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_agent_e2e import FAST_CONF, Procs, _c10d_args, _full_round, _rounds, procs
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rallypoint.adapters import RallypointHandler, create_handler
from rallypoint.core import Action, Context, JoinOp

pytestmark = pytest.mark.integration

__all__ = ["procs"]  # the fixture, imported for the tests below

#: How long the test watches the agents after the node announced itself: the
#: storm started a round every few milliseconds.
WATCH_S = 5.0


class _AnnounceOnly:
    """The join operator until this node waits; then done: it never joins."""

    def __init__(self) -> None:
        self._join = JoinOp()

    def __call__(self, ctx: Context, deadline: float) -> Action:
        if ctx.is_waiting:
            return Action.FINISH
        return self._join(ctx, deadline)


@pytest.fixture
def stuck_node(free_port: Callable[[], int]) -> Iterator[Callable[[int, str], RallypointHandler]]:
    """Makes the third node (a handler joined to the agents' store); closes it."""
    made: list[RallypointHandler] = []

    def make(port: int, run_id: str) -> RallypointHandler:
        conf = dict(item.split("=") for item in FAST_CONF.split(","))
        params = RendezvousParameters(
            "c10d",
            f"127.0.0.1:{port}",
            run_id,
            2,
            3,
            **conf,
            local_addr="127.0.0.1",
            is_host="false",
        )
        handler = create_handler(params)
        made.append(handler)
        return handler

    try:
        yield make
    finally:
        for handler in made:
            handler.close()


def test_a_node_that_announces_itself_and_never_joins_costs_one_round(
    procs: Procs,
    free_port: Callable[[], int],
    stuck_node: Callable[[int, str], RallypointHandler],
) -> None:
    port = free_port()
    args = _c10d_args(port, "stuck", "2:3", 1, "--max-restarts", "0")
    cmd = [str(procs.worker), str(procs.dir), "wait"]
    procs.start(*args, "--rdzv-conf", FAST_CONF + ",is_host=true", *cmd, name="a")
    procs.start(*args, "--rdzv-conf", FAST_CONF + ",is_host=false", *cmd, name="b")
    first = procs.wait_records(lambda rs: bool(_full_round(rs, 2, 1)), "a round of 2 agents")
    announced_in = int(_full_round(first, 2, 1)[0]["RALLYPOINT_ROUND"])

    stuck = stuck_node(port, "stuck")
    sync = stuck.sync
    done = sync.run(_AnnounceOnly(), sync.now() + 30.0)
    assert done.action is Action.FINISH and stuck.node in done.state.wait_list
    assert done.state.round == announced_in and done.state.complete
    stuck._start_heartbeats()  # its heartbeat thread beats on; its join never runs again

    def regrouped(rs: list[dict[str, Any]]) -> bool:
        return any(r > announced_in for r in _rounds(rs))

    procs.wait_records(regrouped, "the agents to regroup once for the waiting node")
    time.sleep(WATCH_S)
    state = sync.refresh()
    rounds = sorted(_rounds(procs.records()))
    # One new round (the regroup for the node that asked to join), not a storm.
    assert state.round == announced_in + 1 and state.complete, (state, procs.logs())
    assert rounds == [announced_in, announced_in + 1], procs.logs()
    assert procs.logs().count("waiting to join; starting a new round") <= 2, procs.logs()
    # It is still alive to its peers (its heartbeat moved): it was not declared
    # dead, which would have ended a storm too. It stands by: no peer admitted it
    # to the new round on its behalf, where everyone would have waited on it.
    assert stuck.node in state.redundancy_list, state
    assert stuck.node not in state.participants, state
    assert not state.wait_list, state
    procs.finish()
