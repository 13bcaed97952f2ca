"""The agent's parts, each on its own: the restart budget, the rank agreement, the
worker launch specs, the round monitor, the exit barrier and the lease guard.

The agent's loop (``rallypoint.agent.agent``) only strings these together; the
end-to-end tests (``test_agent_e2e.py``, ``test_reliability.py``,
``test_chaos.py``) run them in real jobs. Here each part runs against an in-memory
store (``torch.distributed.HashStore``) and a scripted handler, and, where a part
watches processes, real short-lived workers.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import HashStore

from rallypoint.agent.charging import RestartBudget
from rallypoint.agent.config import LaunchConfig
from rallypoint.agent.exit_barrier import exit_barrier
from rallypoint.agent.group_watch import GroupWatch, RoundOutcome
from rallypoint.agent.lease import LeaseGuard, fence_grace
from rallypoint.agent.logs import EventStatus
from rallypoint.agent.ranks import Assignment, RoundAbandoned, agree_ranks, assign_ranks
from rallypoint.agent.rendezvous import HandlerView
from rallypoint.agent.worker_specs import ROUND_ENV, return_files, worker_launches
from rallypoint.agent.workers import WorkerGroup, WorkerLaunch

WAIT = 30.0


class ScriptedHandler:
    """The parts of a rendezvous handler the agent's monitor and exit barrier ask,
    answering what the test sets."""

    def __init__(self) -> None:
        self.waiting = 0
        self.closed = False
        self.dead: frozenset[str] = frozenset()
        self.close_calls = 0
        self.fence = False

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def is_closed(self) -> bool:
        return self.closed

    def set_closed(self) -> None:
        self.close_calls += 1
        self.closed = True

    def dead_participants(self) -> frozenset[str]:
        return self.dead

    def must_fence(self) -> bool:
        return self.fence


def _assignment(**fields: Any) -> Assignment:
    values: dict[str, Any] = {
        "round": 0, "group_rank": 0, "group_world_size": 1, "base_global_rank": 0,
        "world_size": 2, "base_role_rank": 0, "role_world_size": 2,
        "master_addr": "127.0.0.1", "master_port": 29400, "use_agent_store": False,
    }  # fmt: skip
    values.update(fields)
    return Assignment(**values)


def _watch(handler: ScriptedHandler, tmp_path: Path) -> GroupWatch:
    config = LaunchConfig(1, 2, 1, monitor_interval=0.01, log_dir=str(tmp_path))
    return GroupWatch(HandlerView(handler), config)  # type: ignore[arg-type]


# --- the restart budget ------------------------------------------------------------


def test_the_budget_spends_until_empty_and_refunds_a_round_that_lost_a_node() -> None:
    budget = RestartBudget(2)
    assert (budget.remaining, budget.spent) == (2, 0)
    assert budget.spend(frozenset({"a", "b"}))
    assert (budget.remaining, budget.spent) == (1, 1)
    # The next round lacks b: the failure was b's loss seen early.
    assert budget.settle(frozenset({"a"})) == frozenset({"b"})
    assert budget.remaining == 2
    # Settled once: a later round refunds nothing more.
    assert budget.settle(frozenset({"c"})) == frozenset()
    assert budget.remaining == 2
    assert budget.spend(frozenset({"a"})) and budget.spend(None)
    assert not budget.spend(frozenset({"a"}))  # none left: the job gives up
    assert budget.remaining == 0
    assert budget.settle(None) == frozenset()  # unknown membership: no refund


def test_the_budget_refunds_nothing_when_the_same_nodes_regroup() -> None:
    budget = RestartBudget(1)
    assert budget.spend(frozenset({"a", "b"}))
    assert budget.settle(frozenset({"a", "b", "c"})) == frozenset()
    assert budget.remaining == 0


# --- the rank agreement ------------------------------------------------------------


def test_ranks_follow_group_rank_and_roles_count_apart() -> None:
    infos = [
        {"role": "a", "nproc": 2, "seen": -1},
        {"role": "b", "nproc": 1, "seen": -1},
        {"role": "a", "nproc": 3, "seen": -1},
    ]
    assigned = assign_ranks(infos, 7, ("10.0.0.1", 1234, False))
    assert [x["base"] for x in assigned] == [0, 2, 3]
    assert [x["role_base"] for x in assigned] == [0, 0, 2]
    assert [x["role_world"] for x in assigned] == [5, 1, 5]
    assert {x["world"] for x in assigned} == {6}
    assert {(x["round"], x["master_addr"], x["master_port"]) for x in assigned} == {
        (7, "10.0.0.1", 1234)
    }


def test_agents_agree_on_ranks_and_on_a_round_past_any_seen() -> None:
    store = HashStore()
    results: dict[int, Assignment] = {}
    masters: list[int] = []

    def master() -> tuple[str, int, bool]:
        masters.append(1)
        return "127.0.0.1", 5555, False

    def agent(rank: int, seen: int) -> None:
        results[rank] = agree_ranks(
            store, rank, 2, role="r", nproc=2, last_round=seen, round_hint=None,
            choose_master=master, dead_peers=frozenset,
        )  # fmt: skip

    threads = [
        threading.Thread(target=agent, args=(1, 4), daemon=True),
        threading.Thread(target=agent, args=(0, 2), daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert len(results) == 2 and masters == [1]
    assert {a.round for a in results.values()} == {5}  # one past the largest seen
    assert (results[0].base_global_rank, results[1].base_global_rank) == (0, 2)
    assert {(a.world_size, a.master_port) for a in results.values()} == {(4, 5555)}


def test_the_agreement_gives_up_when_a_peer_is_dead() -> None:
    with pytest.raises(RoundAbandoned, match="peer\\(s\\) b left the round"):
        agree_ranks(
            HashStore(), 1, 2, role="r", nproc=1, last_round=-1, round_hint=3,
            choose_master=lambda: ("x", 1, False), dead_peers=lambda: frozenset({"b"}),
        )  # fmt: skip


# --- the worker launch specs -------------------------------------------------------


def test_launches_carry_the_round_restarts_and_return_files(tmp_path: Path) -> None:
    config = LaunchConfig(1, 1, 2, max_restarts=3, log_dir=str(tmp_path))
    a = _assignment(round=4, base_global_rank=6, world_size=8)
    attempt_dir = str(tmp_path / "attempt_2")
    launches = worker_launches(
        config, ["train"], a, attempt_dir=attempt_dir, restarts=1, return_values=True
    )
    assert [x.global_rank for x in launches] == [6, 7]
    assert {x.env[ROUND_ENV] for x in launches} == {"4"}
    assert {x.env["TORCHELASTIC_RESTART_COUNT"] for x in launches} == {"1"}
    files = return_files(attempt_dir, a, config.nproc_per_node)
    assert {x.global_rank: x.env["RALLYPOINT_RETURN_FILE"] for x in launches} == files
    assert all(x.log_dir.startswith(attempt_dir) for x in launches)


# --- the round monitor -------------------------------------------------------------


@pytest.fixture
def group() -> Iterator[WorkerGroup]:
    workers = WorkerGroup()
    try:
        yield workers
    finally:
        workers.stop(grace=0.0)


def _start(group: WorkerGroup, tmp_path: Path, *codes: str) -> None:
    group.start(
        [
            WorkerLaunch(
                local_rank=rank,
                global_rank=rank,
                argv=[sys.executable, "-c", code],
                env=dict(os.environ),
                log_dir=str(tmp_path / str(rank)),
                error_file=str(tmp_path / str(rank) / "error.json"),
            )
            for rank, code in enumerate(codes)
        ]
    )


SLEEP = "import time; time.sleep(60)"


@pytest.mark.integration
def test_the_monitor_reports_success_and_failure(group: WorkerGroup, tmp_path: Path) -> None:
    watch = _watch(ScriptedHandler(), tmp_path)
    _start(group, tmp_path, "pass", "pass")
    assert watch.wait_for_outcome(group) == (RoundOutcome.SUCCEEDED, [])
    group.stop(grace=0.0)
    _start(group, tmp_path, "raise SystemExit(3)", SLEEP)
    outcome, failures = watch.wait_for_outcome(group)
    assert outcome is RoundOutcome.FAILED
    assert [(f.local_rank, f.exitcode) for f in failures] == [(0, 3)]


@pytest.mark.integration
@pytest.mark.parametrize("change", ["waiting", "dead", "closed"])
def test_the_monitor_reports_the_group_changing(
    change: str, group: WorkerGroup, tmp_path: Path
) -> None:
    handler = ScriptedHandler()
    watch = _watch(handler, tmp_path)
    _start(group, tmp_path, SLEEP)
    if change == "waiting":
        handler.waiting = 1
    elif change == "dead":
        handler.dead = frozenset({"b"})
    else:
        handler.closed = True
    expected = RoundOutcome.CLOSED if change == "closed" else RoundOutcome.MEMBERSHIP
    assert watch.wait_for_outcome(group) == (expected, [])


# --- the exit barrier --------------------------------------------------------------


def test_the_exit_barrier_waits_for_every_agent_then_closes(tmp_path: Path) -> None:
    store = HashStore()
    handler = ScriptedHandler()
    done: dict[int, bool] = {}

    def agent(rank: int) -> None:
        watch = _watch(handler, tmp_path)
        a = _assignment(round=2, group_rank=rank, group_world_size=2)
        done[rank] = exit_barrier(store, a, watch, timeout=WAIT)

    first = threading.Thread(target=agent, args=(0,), daemon=True)
    first.start()
    time.sleep(0.05)
    assert 0 not in done  # waits for the other agent
    agent(1)
    first.join(WAIT)
    assert done == {0: True, 1: True}
    assert handler.close_calls >= 1


def test_the_exit_barrier_rejoins_when_a_node_waits(tmp_path: Path) -> None:
    handler = ScriptedHandler()
    handler.waiting = 1
    a = _assignment(group_world_size=2)
    assert exit_barrier(HashStore(), a, _watch(handler, tmp_path), timeout=WAIT) is False
    assert handler.close_calls == 0


# --- the lease guard ---------------------------------------------------------------


def test_the_fence_grace_is_a_quarter_keep_alive_at_most() -> None:
    class Settings:
        keep_alive_interval = 2.0
        keep_alive_max_attempt = 3

    class WithSettings(ScriptedHandler):
        settings = Settings()

    assert fence_grace(HandlerView(WithSettings()), 5.0) == 0.5  # type: ignore[arg-type]
    assert fence_grace(HandlerView(WithSettings()), 0.1) == 0.1  # type: ignore[arg-type]
    assert fence_grace(HandlerView(ScriptedHandler()), 5.0) == 1.0  # type: ignore[arg-type]


@pytest.mark.integration
def test_the_lease_guard_stops_the_workers_once_the_lease_ran_out(
    group: WorkerGroup, tmp_path: Path
) -> None:
    handler = ScriptedHandler()
    _start(group, tmp_path, SLEEP)
    guard = LeaseGuard(HandlerView(handler), group, grace=0.0)  # type: ignore[arg-type]
    with guard.running():
        time.sleep(0.1)
        assert not guard.fenced.is_set()
        handler.fence = True
        assert guard.fenced.wait(WAIT)
    deadline = time.monotonic() + WAIT
    while group.poll()[0] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert group.poll()[0] not in (None, 0)  # killed; the agent's loop sees a failure


# --- torch's event states ----------------------------------------------------------


def test_event_states_are_torchs_names() -> None:
    assert [s.value for s in EventStatus] == ["START", "SUCCEEDED", "FAILED", "TERMINATED"]
