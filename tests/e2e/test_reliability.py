"""A lost peer does not spend the survivors' restart
budget, a worker's own children die with a SIGKILLed agent, and a normal finish
logs no failure on the agents that did not host the store.

The pure decision (``rallypoint.agent.charging``) is tested directly; the rest runs
real ``rallypoint run`` agents on 127.0.0.1 with a worker that needs no torch
(``tests/helpers/peer_worker.py``). Every process a test starts carries a mark and is
killed by the fixture, and each test asserts that none is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.cluster import HERE, Cluster, c10d_agent_args, free_port, read_jsonl

from rallypoint.agent import workers
from rallypoint.agent.charging import Charge, FailureCase, evidence_window, judge, refund
from rallypoint.agent.workers import WorkerGroup, WorkerLaunch

WORKER = str(HERE / "peer_worker.py")
# A dead peer is declared after 0.5 s x 2 without a heartbeat; the survivors' workers
# (mode "watch") fail within milliseconds of the kill, well before that.
CONF = "keep_alive_interval=0.5,keep_alive_max_attempt=2,last_call_timeout=0.3"
WAIT = 90.0


# --- the decision, pure ------------------------------------------------------------


def test_evidence_window_covers_the_detection_of_a_death() -> None:
    # Declared at most two liveness windows after the death, plus the agent's cache.
    assert evidence_window(0.5, 2) == 2 * 1.0 + 0.5
    assert evidence_window(5.0, 3) == 35.0
    assert evidence_window(0.0, 3) == 0.0


def test_a_membership_change_makes_any_failure_free() -> None:
    case = FailureCase(failed_at=10.0, peers=2, window=2.5)
    for remaining in (0, 1, 5):
        for now in (10.0, 11.0, 12.5):
            assert judge(case, now=now, membership_changed=True, remaining=remaining) is (
                Charge.FREE
            )


def test_with_restarts_left_a_failure_is_charged_at_once() -> None:
    case = FailureCase(failed_at=10.0, peers=2, window=2.5)
    assert judge(case, now=10.0, membership_changed=False, remaining=1) is Charge.CHARGE


def test_with_no_restart_left_the_agent_waits_for_evidence_until_the_deadline() -> None:
    case = FailureCase(failed_at=10.0, peers=2, window=2.5)
    assert case.deadline == 12.5
    assert judge(case, now=10.0, membership_changed=False, remaining=0) is Charge.WAIT
    assert judge(case, now=12.4, membership_changed=False, remaining=0) is Charge.WAIT
    assert judge(case, now=12.5, membership_changed=False, remaining=0) is Charge.CHARGE


def test_no_wait_without_peers_or_without_dead_peer_detection() -> None:
    alone = FailureCase(failed_at=10.0, peers=0, window=2.5)
    assert judge(alone, now=10.0, membership_changed=False, remaining=0) is Charge.CHARGE
    blind = FailureCase(failed_at=10.0, peers=2, window=0.0)
    assert judge(blind, now=10.0, membership_changed=False, remaining=0) is Charge.CHARGE


def test_a_charge_is_refunded_when_the_next_round_lacks_a_participant() -> None:
    assert refund({"a", "b", "c"}, {"a", "b"})
    assert refund({"a", "b", "c"}, {"a", "b", "d"})  # one left, another came
    assert not refund({"a", "b"}, {"a", "b"})  # the same nodes: a genuine failure
    assert not refund({"a", "b"}, {"a", "b", "c"})  # only a node more
    assert not refund(None, {"a"})
    assert not refund({"a"}, None)


# --- real agents -------------------------------------------------------------------


def _round_of(records: list[dict[str, Any]], nodes: int, after: int = -1) -> list[dict[str, Any]]:
    """The records of the latest round above ``after`` with ``nodes`` agents, once all
    its workers have started."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_round.setdefault(int(r["RALLYPOINT_ROUND"]), []).append(r)
    for number, recs in sorted(by_round.items(), reverse=True):
        if number > after and int(recs[0]["GROUP_WORLD_SIZE"]) == nodes and len(recs) == nodes:
            return recs
    return []


@pytest.mark.integration
@pytest.mark.parametrize("max_restarts", [0, 1])
def test_a_lost_peer_does_not_spend_the_survivors_restart_budget(
    cluster: Cluster, max_restarts: int
) -> None:
    """3 agents (--nnodes 2:3); one is lost with its worker (SIGKILL, a machine loss).
    The survivors' workers fail at once, as on a broken collective, before their
    agents see the peer's heartbeat stop. Neither survivor is charged: with
    --max-restarts 0 they regroup instead of giving up, and with 1 the new round's
    workers see TORCHELASTIC_RESTART_COUNT 0 (the charge was refunded)."""
    port, records = free_port(), cluster.dir / "records.jsonl"
    args = c10d_agent_args(port, "lostpeer", "2:3", "--max-restarts", str(max_restarts))
    for name, host in (("a", "true"), ("b", "false"), ("c", "false")):
        cluster.start(
            [*args, "--rdzv-conf", f"{CONF},is_host={host}", WORKER, str(cluster.dir), "watch"],
            name,
        )
    three = cluster.wait_for(lambda: _round_of(read_jsonl(records), 3), "a round of 3", WAIT)
    first = int(three[0]["RALLYPOINT_ROUND"])
    cluster.kill("c", machine=True)

    two = cluster.wait_for(
        lambda: _round_of(read_jsonl(records), 2, after=first), "the survivors' new round", WAIT
    )
    assert {int(r["agent_pid"]) for r in two} == {cluster.agents[n].pid for n in "ab"}
    # Nobody was charged for the failures the lost peer caused.
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in two} == {"0"}, cluster.logs()
    logs = cluster.agents["a"].log() + cluster.agents["b"].log()
    assert "peer worker(s)" in logs  # the survivors' workers did fail on the lost peer
    (cluster.dir / "finish").touch()
    assert cluster.wait("a", WAIT) == 0, cluster.logs()
    assert cluster.wait("b", WAIT) == 0, cluster.logs()
    assert cluster.leftovers() == []


@pytest.mark.integration
def test_a_failure_that_repeats_still_ends_the_job(cluster: Cluster) -> None:
    """The charging rule must not free a genuine failure: rank 1 fails on every
    attempt, nobody is lost, and with --max-restarts 0 the job ends with rank 1's
    failure (after waiting, bounded, for a peer's loss that could explain it)."""
    port = free_port()
    args = c10d_agent_args(port, "genuine", "2", "--max-restarts", "0")
    for name, host in (("a", "true"), ("b", "false")):
        cluster.start(
            [*args, "--rdzv-conf", f"{CONF},is_host={host}", WORKER, str(cluster.dir),
             "fail-rank1"],
            name,
        )  # fmt: skip
    started = time.monotonic()
    codes = {name: cluster.wait(name, WAIT) for name in "ab"}
    assert codes == {"a": 1, "b": 1}, cluster.logs()
    assert time.monotonic() - started < WAIT
    logs = cluster.logs()
    assert "max restarts (0) exhausted" in logs
    assert "rank 1: a bug that fails every attempt" in logs
    assert len({r["RALLYPOINT_ROUND"] for r in read_jsonl(cluster.dir / "records.jsonl")}) == 1
    assert cluster.leftovers() == []


@pytest.mark.integration
def test_a_workers_children_die_with_a_sigkilled_agent(cluster: Cluster) -> None:
    """Each worker starts a child, which starts a grandchild; the agent alone is
    SIGKILLed. The worker dies of its parent-death signal, and its descendants must
    follow within a bounded time instead of running on."""
    agent = cluster.start(
        ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05",
         WORKER, str(cluster.dir), "spawn"],
        "a",
    )  # fmt: skip
    spawned = cluster.wait_for(
        lambda: [
            json.loads(p.read_text()) for p in sorted(cluster.dir.glob("spawned.?"))
        ] if len(list(cluster.dir.glob("spawned.?"))) == 2 else [],
        "both workers' children",
        WAIT,
    )  # fmt: skip
    pids = [pid for s in spawned for pid in (s["worker"], s["child"], s["grandchild"])]
    procs = [psutil.Process(pid) for pid in pids]
    os.kill(agent.pid, signal.SIGKILL)
    agent.popen.wait()
    agent.killed_at = time.monotonic()
    _, alive = psutil.wait_procs(procs, timeout=10)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"outlived the SIGKILLed agent: {alive}"
    assert cluster.leftovers() == []


def _python_worker(tmp_path: Path, code: str) -> WorkerLaunch:
    """Local rank 0 running ``python -c code``, its logs under ``tmp_path``."""
    return WorkerLaunch(
        local_rank=0,
        global_rank=0,
        argv=[sys.executable, "-c", code],
        env=dict(os.environ),
        log_dir=str(tmp_path / "logs"),
        error_file=str(tmp_path / "logs" / "error.json"),
    )


@pytest.mark.integration
def test_the_watchdog_lives_as_long_as_the_workers(tmp_path: Path) -> None:
    """A group's watchdog starts with its workers and is gone once they are
    stopped (it kills nothing then: the stop forgot every group first)."""
    launch = _python_worker(tmp_path, "import time; time.sleep(600)")
    group = WorkerGroup()
    group.start([launch])
    try:
        me = psutil.Process()
        watchdogs = [p for p in me.children() if workers._WATCHDOG in p.cmdline()]
        assert len(watchdogs) == 1, me.children()
        worker = psutil.Process(group.pids[0])
        assert group.poll() == {0: None}
    finally:
        group.stop(grace=1.0)
    _, alive = psutil.wait_procs([*watchdogs, worker], timeout=10)
    assert not alive


@pytest.mark.integration
def test_an_exited_worker_keeps_its_pid_until_stopped(tmp_path: Path) -> None:
    """poll() reports the exit without reaping: the pid (the process group the
    watchdog would kill) cannot go to an unrelated process before stop()."""
    launch = _python_worker(tmp_path, "import sys; sys.exit(3)")
    group = WorkerGroup()
    group.start([launch])
    try:
        deadline = time.monotonic() + 60
        while group.poll() == {0: None} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert group.poll() == {0: 3}
        assert group.workers[0].exit_time is not None
        assert psutil.Process(group.pids[0]).status() == psutil.STATUS_ZOMBIE
        pid = group.pids[0]
    finally:
        group.stop(grace=0.0)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


@pytest.mark.integration
def test_a_normal_finish_logs_no_failure_on_any_agent(cluster: Cluster) -> None:
    """3 agents with the default keep-alive finish together, twice: the agents that do
    not host the store must not log a failed close (the host has already exited)."""
    for job in range(2):
        port = free_port()
        args = c10d_agent_args(port, f"clean{job}", "3")
        names = [f"{n}{job}" for n in "abc"]
        for name, host in zip(names, ("true", "false", "false"), strict=True):
            cluster.start(
                [*args, "--rdzv-conf", f"is_host={host}", WORKER, str(cluster.dir), "quick"],
                name,
            )
        for name in names:
            assert cluster.wait(name, WAIT) == 0, cluster.logs()
        for name in names:
            log = cluster.agents[name].log()
            assert "WARNING" not in log and "ERROR" not in log, cluster.logs()
            assert "Broken pipe" not in log and "failed" not in log, cluster.logs()
    assert cluster.leftovers() == []
