"""The agent reacts to its group by the core's checked rule: with rallypoint's
handlers, whether a node whose workers run carries on, regroups or stops is
:func:`rallypoint.core.driver.member_response`, the function the node's member
lifecycle and the simulator's agent decide by, over the same verdict and view."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from rallypoint.adapters import RallypointHandler
from rallypoint.adapters import handler as handler_module
from rallypoint.agent.config import LaunchConfig
from rallypoint.agent.group_watch import GroupWatch
from rallypoint.agent.rendezvous import HandlerView
from rallypoint.core import NodeDesc, RendezvousState, driver
from rallypoint.core.driver import MemberResponse, Verdict
from rallypoint.spec.simulator import agent as simulator_agent

PEERS = [NodeDesc("10.0.0.1", 7, 0), NodeDesc("10.0.0.2", 8, 0), NodeDesc("10.0.0.3", 9, 1)]


class _Looked:
    """A StateSync stand-in: the verdict of a look and the view it came from."""

    def __init__(self, verdict: Verdict, state: RendezvousState) -> None:
        self.verdict, self.state = verdict, state

    def watch(self, joined: Any, max_age: float = 0.0) -> Verdict:
        return self.verdict


class _Handler:
    """rallypoint's handler as far as a look at the group goes: its own
    ``member_response`` over a stand-in for its StateSync."""

    member_response = RallypointHandler.member_response
    cache_duration = 0.0
    _joined = None

    def __init__(self) -> None:
        self._sync = _Looked(Verdict(0, frozenset()), RendezvousState())


_HANDLER = _Handler()
_WATCH = GroupWatch(HandlerView(_HANDLER), LaunchConfig(1, 3, 1))  # type: ignore[arg-type]


def test_the_agent_and_the_simulator_decide_by_the_same_function() -> None:
    assert handler_module.member_response is driver.member_response
    assert simulator_agent.member_response is driver.member_response


@given(
    waiting=st.integers(0, 3),
    lost=st.frozensets(st.sampled_from(PEERS)),
    closed=st.booleans(),
)
def test_the_agents_reaction_is_the_cores_over_any_view(
    waiting: int, lost: frozenset[NodeDesc], closed: bool
) -> None:
    verdict = Verdict(waiting, lost)
    state = replace(RendezvousState(), closed=closed)
    _HANDLER._sync = _Looked(verdict, state)
    response, reason = _WATCH.look_at_group()
    assert response is driver.member_response(verdict, state)
    if response is MemberResponse.REGROUP:
        named = [str(waiting)] if waiting else [str(node) for node in lost]
        assert reason and all(name in reason for name in named), reason
    else:
        assert reason == ""
