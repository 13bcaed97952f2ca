"""Live regroup with real agents on 127.0.0.1 (``rallypoint run --live``).

Each scenario trains ``tests/helpers/live_steps.py``, whose state (one parameter)
holds k(k+1)/2 after k committed steps and is never written to disk. The
training invariant checked after every scenario: every committed step carries the
right value on every rank (no step lost or applied twice, every rank agrees), the
committed steps of each process are consecutive within a round, the job reaches
its last step, and a worker that started into a running job had the state before
its first step (it can only have come from a peer). Surviving workers keep their
processes: the test compares PIDs before and after.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.cluster import Cluster, free_port, read_jsonl

from rallypoint.agent.worker.live_channel import Phase, Status, StatusFile

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

SCRIPT = str(Path(__file__).resolve().parents[1] / "helpers" / "live_steps.py")
WAIT = 90.0
STEPS = 2000
STEP_TIME = 0.02
#: a 2 s liveness window: a SIGKILLed node is declared dead quickly
FAST = "keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60,last_call_timeout=0.5"


def _agent_args(
    endpoint: str, run_id: str, nnodes: str, nproc: int, conf: str = FAST, *extra: str
) -> list[str]:
    return [
        "--nnodes", nnodes, "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--local-addr", "127.0.0.1", "--monitor-interval", "0.05", "--stop-grace", "2",
        "--live", "--live-timeout", "20", "--max-restarts", "3", "--rdzv-conf", conf, *extra,
    ]  # fmt: skip


def _train(cluster: Cluster, *extra: str) -> list[str]:
    return [SCRIPT, str(cluster.dir), str(STEPS), str(STEP_TIME), *extra]


def _records(cluster: Cluster) -> list[dict[str, Any]]:
    return read_jsonl(cluster.dir / "records.jsonl")


def _training_pids(cluster: Cluster, world: int, after_round: int = -1) -> dict[int, int] | None:
    """rank -> pid of the workers that committed a step in the newest round after
    ``after_round``, once that round has ``world`` ranks stepping; else None."""
    by_round: dict[int, dict[int, int]] = defaultdict(dict)
    for r in _records(cluster):
        if r["event"] == "step" and r["round"] > after_round and r["world"] == world:
            by_round[r["round"]][r["rank"]] = r["pid"]
    for round_ in sorted(by_round, reverse=True):
        if len(by_round[round_]) == world:
            return by_round[round_]
    return None


def _newest_round(cluster: Cluster) -> int:
    return max((r["round"] for r in _records(cluster) if r["event"] == "step"), default=-1)


def _sprint(cluster: Cluster) -> None:
    (cluster.dir / "sprint").touch()


def _check_training(cluster: Cluster, since_round: int | None = None) -> list[dict[str, Any]]:
    """The training invariant (module docstring); returns the round records of the
    workers that started into the running job after ``since_round`` (default: the
    first round). A job started as 2:3 may form its first round before the third
    node arrives, so a scenario about a later fault passes the round it began in."""
    records = _records(cluster)
    steps = [r for r in records if r["event"] == "step"]
    assert steps, "no step was committed"
    for r in steps:
        k = r["step"]
        assert r["value"] == k * (k + 1) / 2, f"wrong state at step {k}: {r}"
    assert max(r["step"] for r in steps) == STEPS
    seen = {r["step"] for r in steps}
    assert seen == set(range(1, STEPS + 1)), "a step was never committed"
    by_process: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r in steps:
        by_process[(r["pid"], r["round"])].append(r["step"])
    for (pid, round_), done in by_process.items():
        assert done == list(range(done[0], done[0] + len(done))), (
            f"process {pid} skipped steps in round {round_}"
        )
    first_round = min(r["round"] for r in records if r["event"] == "round")
    newcomers = [r for r in records if r["event"] == "round" and r["round"] > first_round]
    first_round_of: dict[int, int] = {}
    for r in records:
        if r["event"] == "round":
            first_round_of.setdefault(r["pid"], r["round"])
    started_late = {pid for pid, round_ in first_round_of.items() if round_ > first_round}
    joined = [r for r in newcomers if r["pid"] in started_late]
    for r in joined:
        assert r["value"] == r["step"] * (r["step"] + 1) / 2
    done = [r for r in records if r["event"] == "done"]
    assert done and all(r["step"] == STEPS for r in done)
    if since_round is None:
        return joined
    return [r for r in joined if first_round_of[r["pid"]] > since_round]


def _wait_training(
    cluster: Cluster, world: int, after_round: int = -1, allowed_exits: tuple[str, ...] = ()
) -> dict[int, int]:
    return cluster.wait_for(
        lambda: _training_pids(cluster, world, after_round),
        f"a round of {world} ranks training after round {after_round}",
        WAIT,
        allowed_exits=allowed_exits,
    )


def _finish(cluster: Cluster, names: list[str]) -> None:
    _sprint(cluster)
    for name in names:
        assert cluster.wait(name, WAIT) == 0, cluster.logs()
    assert cluster.leftovers() == []


def test_a_killed_worker_alone_is_started_again(cluster: Cluster) -> None:
    """2 agents x 2 workers: SIGKILL one worker. Only it is started again; its
    sibling and the other node's workers keep their processes and the state, and
    the newcomer gets the state from a peer."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = _agent_args(endpoint, "live-crash", "2", 2)
    for name in ("a", "b"):
        events = str(cluster.dir / f"events-{name}.jsonl")
        cluster.start([*args, "--events-file", events, *_train(cluster)], name)
    before = _wait_training(cluster, 4)
    round_ = _newest_round(cluster)
    victim_rank = 3
    victim_node = next(name for name in ("a", "b") if before[victim_rank] in _pids(cluster, name))
    workers = set(before.values())
    cluster.wait_for(lambda: _warm_spare(cluster, victim_node, workers), "a warm spare", WAIT)
    os.kill(before[victim_rank], signal.SIGKILL)
    after = _wait_training(cluster, 4, round_)
    assert after[victim_rank] != before[victim_rank]
    for rank in (0, 1, 2):
        assert after[rank] == before[rank], f"rank {rank}'s worker was restarted"
    _finish(cluster, ["a", "b"])
    joined = _check_training(cluster)
    assert [r["pid"] for r in joined] == [after[victim_rank]]
    assert joined[0]["step"] > 0, "the newcomer did not get the state from a peer"
    # Only the whole job's start restores a checkpoint; the replacement read none.
    restored = {r["pid"] for r in _records(cluster) if r["event"] == "restore"}
    assert restored == set(before.values()), restored
    # The event of the node that lost a worker says the warm spare replaced it.
    regroups = [
        e for e in read_jsonl(cluster.dir / f"events-{victim_node}.jsonl")
        if e["kind"] == "live_regroup" and e["round"] > round_
    ]  # fmt: skip
    assert regroups, "no live_regroup event after the crash"
    assert regroups[0]["started"] == 1 and regroups[0]["warm_started"] == 1, regroups[0]


#: a newcomer held in its start-up (``_newcomer_held``) is waited for up to half
#: the live timeout before its node joins anyway: room for the others' steps on a
#: loaded host
HOLD = ("--live-timeout", "60")


def _newcomer_held(
    cluster: Cluster, others: set[int], world: int, start: Callable[[], object]
) -> list[float]:
    """Call ``start`` (it starts a newcomer), hold the newcomer in its start-up
    (``OUT/slow_start``) until the workers ``others`` have committed 10 steps in a
    round of ``world`` since it started, then let it go. A newcomer that the others
    wait for fails this wait (bounded by that standstill, not by this host's
    speed). Returns when those 10 steps were committed."""
    slow_start = cluster.dir / "slow_start"
    slow_start.write_text(str(WAIT))
    since = time.time()
    start()

    def ten_steps_since_a_start() -> list[float] | None:
        records = _records(cluster)
        starts = [r["time"] for r in records if r["event"] == "start" and r["time"] > since]
        committed: dict[int, float] = {}
        for r in records:
            if (
                starts and r["event"] == "step" and r["pid"] in others
                and r["world"] == world and r["time"] > starts[0]
            ):  # fmt: skip
                committed[r["step"]] = max(r["time"], committed.get(r["step"], 0.0))
        return sorted(committed.values())[:10] if len(committed) >= 10 else None

    steps = cluster.wait_for(
        ten_steps_since_a_start, "the others stepping while a newcomer starts", WAIT
    )
    slow_start.unlink()
    return steps


def test_survivors_train_on_while_a_replacement_starts(cluster: Cluster) -> None:
    """3 agents x 1 worker (--nnodes 2:3), a script that may shrink: SIGKILL a
    worker whose replacement is slow to start (``_newcomer_held``). The other two
    keep stepping in a round of 2 meanwhile; the replacement is taken in once
    ready, with the state from a peer, and reads no checkpoint."""
    endpoint = f"127.0.0.1:{free_port()}"
    shrink = {"LIVE_STEPS_MAY_SHRINK": "1"}
    host = _agent_args(endpoint, "live-shrink", "2:3", 1, f"{FAST},is_host=true", *HOLD)
    args = _agent_args(endpoint, "live-shrink", "2:3", 1, f"{FAST},is_host=false", *HOLD)
    events = {name: str(cluster.dir / f"events-{name}.jsonl") for name in ("a", "b", "c")}
    cluster.start([*host, "--events-file", events["a"], *_train(cluster)], "a", env=shrink)
    for name in ("b", "c"):
        cluster.start([*args, "--events-file", events[name], *_train(cluster)], name, env=shrink)
    before = _wait_training(cluster, 3)
    round_ = _newest_round(cluster)
    victim_node = "c"
    (victim,) = _pids(cluster, victim_node) & set(before.values())
    survivors = set(before.values()) - {victim}
    alone = _newcomer_held(cluster, survivors, 2, lambda: os.kill(victim, signal.SIGKILL))
    after = _wait_training(cluster, 3, round_ + 1)
    assert survivors < set(after.values()), "a survivor was restarted"
    _finish(cluster, ["a", "b", "c"])
    joined = _check_training(cluster, since_round=round_)
    records = _records(cluster)
    (newcomer,) = {r["pid"] for r in joined}
    started = next(r["time"] for r in records if r["event"] == "start" and r["pid"] == newcomer)
    ready = next(r["time"] for r in records if r["event"] == "ready" and r["pid"] == newcomer)
    while_starting = {
        r["step"]
        for r in records
        if r["event"] == "step" and r["pid"] in survivors and r["world"] == 2
        and started < r["time"] < ready
    }  # fmt: skip
    assert len(while_starting) >= 10, f"the survivors stood still: {sorted(while_starting)}"
    # Only the whole job's start restores (a 2:3 job's first round may have formed
    # with two: the third then had the state from them); the replacement read none.
    restored = {r["pid"] for r in records if r["event"] == "restore"}
    first_round = min(r["round"] for r in records if r["event"] == "round")
    assert restored == {
        r["pid"] for r in records if r["event"] == "round" and r["round"] == first_round
    }
    assert newcomer not in restored
    regroups = [
        e for e in read_jsonl(cluster.dir / f"events-{victim_node}.jsonl")
        if e["kind"] == "live_regroup" and e["round"] > round_
    ]  # fmt: skip
    assert regroups and regroups[0]["started"] == 1, regroups
    # noticed before the survivors' first step alone, ready after their tenth
    assert regroups[0]["newcomer_ready_s"] >= alone[-1] - alone[0], regroups[0]


def _status_of(pid: int) -> Status | None:
    """The live status of worker ``pid``, which started as a warm spare (the spare's
    command line names its status file)."""
    try:
        path = psutil.Process(pid).cmdline()[-1]
    except (psutil.Error, IndexError):
        return None
    if not os.path.isfile(path):
        return None
    status = StatusFile(path)
    try:
        return status.read()
    finally:
        status.close()


def test_a_newcomer_whose_first_round_is_superseded_takes_the_next_at_once(
    cluster: Cluster,
) -> None:
    """2 agents x 1 worker, --live-timeout 60: freeze a's worker, kill b's. b's
    replacement forms the next round's group and waits for a's frozen worker; then
    a's worker is killed too, so that round never forms. The replacement holds no
    state: it leaves the forming for the round after it, or is started again into
    it, within seconds, not --live-timeout."""
    endpoint = f"127.0.0.1:{free_port()}"
    slow = ("--live-timeout", "60")
    host = _agent_args(endpoint, "live-superseded", "2", 1, f"{FAST},is_host=true", *slow)
    args = _agent_args(endpoint, "live-superseded", "2", 1, f"{FAST},is_host=false", *slow)
    cluster.start([*host, *_train(cluster)], "a")
    cluster.start([*args, *_train(cluster)], "b")
    before = _wait_training(cluster, 2)
    round_ = _newest_round(cluster)
    (frozen,) = _pids(cluster, "a") & set(before.values())
    (victim,) = _pids(cluster, "b") & set(before.values())
    workers = set(before.values())
    cluster.wait_for(lambda: _warm_spare(cluster, "b", workers), "a warm spare", WAIT)
    os.kill(frozen, signal.SIGSTOP)
    os.kill(victim, signal.SIGKILL)

    def forming() -> int | None:
        for r in _records(cluster):
            if r["event"] == "start" and r["pid"] not in workers:
                status = _status_of(r["pid"])
                if status and status.round > round_ and status.phase is Phase.JOINING:
                    return int(r["pid"])
        return None

    cluster.wait_for(forming, "the replacement forming its group", WAIT)
    time.sleep(0.5)  # into init_process_group, waiting for the frozen peer
    killed_at = time.monotonic()
    os.kill(frozen, signal.SIGKILL)
    _wait_training(cluster, 2, round_)
    took_s = time.monotonic() - killed_at
    assert took_s < 30, f"the next round trained {took_s:.1f} s after the kill"
    _finish(cluster, ["a", "b"])
    _check_training(cluster)
    assert "within 60 s; starting it again" not in cluster.logs()


def _pids(cluster: Cluster, name: str) -> set[int]:
    return {p.pid for p in cluster.tree(name)}


def _warm_spare(cluster: Cluster, name: str, workers: Collection[int] = ()) -> bool:
    """Whether agent ``name`` keeps a warm spare worker ready (a process that
    started as one and is not among ``workers``: spares become workers)."""
    for process in cluster.tree(name):
        try:
            if process.pid not in workers and "rallypoint.agent.worker.warm" in process.cmdline():
                return True
        except psutil.Error:
            continue
    return False


def test_a_leaving_node_costs_no_restart(cluster: Cluster) -> None:
    """3 agents x 1 worker (--nnodes 2:3): SIGTERM one agent. It leaves; the two
    survivors go on in a round of 2 with the same processes."""
    endpoint = f"127.0.0.1:{free_port()}"
    host = _agent_args(endpoint, "live-leave", "2:3", 1, f"{FAST},is_host=true")
    args = _agent_args(endpoint, "live-leave", "2:3", 1, f"{FAST},is_host=false")
    cluster.start([*host, *_train(cluster)], "a")
    for name in ("b", "c"):
        cluster.start([*args, *_train(cluster)], name)
    before = _wait_training(cluster, 3)
    round_ = _newest_round(cluster)
    leaver = "c"
    (leaver_pid,) = _pids(cluster, leaver) & set(before.values())
    cluster.stop(leaver, signal.SIGTERM)
    # The leaver may be gone before the survivors' round is training.
    after = _wait_training(cluster, 2, round_, allowed_exits=(leaver,))
    assert set(after.values()) == set(before.values()) - {leaver_pid}
    assert cluster.wait(leaver, WAIT) == 128 + signal.SIGTERM
    _finish(cluster, [n for n in ("a", "b", "c") if n != leaver])
    assert _check_training(cluster, since_round=round_) == []


def test_a_lost_machine_is_regrouped_around_live(cluster: Cluster) -> None:
    """3 agents x 1 worker (--nnodes 2:3, 2 s liveness window): SIGKILL an agent and
    its worker. The survivors go on in a round of 2 with the same processes."""
    endpoint = f"127.0.0.1:{free_port()}"
    host = _agent_args(endpoint, "live-sigkill", "2:3", 1, f"{FAST},is_host=true")
    args = _agent_args(endpoint, "live-sigkill", "2:3", 1, f"{FAST},is_host=false")
    cluster.start([*host, *_train(cluster)], "a")
    for name in ("b", "c"):
        cluster.start([*args, *_train(cluster)], name)
    before = _wait_training(cluster, 3)
    round_ = _newest_round(cluster)
    victim_pids = _pids(cluster, "c")
    cluster.kill("c", machine=True)
    after = _wait_training(cluster, 2, round_)
    assert set(after.values()) == set(before.values()) - victim_pids
    _finish(cluster, ["a", "b"])
    assert _check_training(cluster, since_round=round_) == []


def test_a_spare_takes_a_lost_nodes_place_with_the_state_of_a_peer(cluster: Cluster) -> None:
    """2 active agents and a spare (--nnodes 2:2): SIGKILL an active machine. The
    spare's worker joins the running job and gets the state from the survivor."""
    endpoint = f"127.0.0.1:{free_port()}"
    host = _agent_args(endpoint, "live-spare", "2:2", 1, f"{FAST},stable_ranks=1,is_host=true")
    args = _agent_args(endpoint, "live-spare", "2:2", 1, f"{FAST},stable_ranks=1,is_host=false")
    cluster.start([*host, *_train(cluster)], "a")
    cluster.start([*args, *_train(cluster)], "b")
    before = _wait_training(cluster, 2)
    cluster.start([*args, *_train(cluster)], "spare")
    time.sleep(1.0)  # the spare announces itself
    round_ = _newest_round(cluster)
    cluster.kill("b", machine=True)
    after = _wait_training(cluster, 2, round_)
    assert after[0] == before[0]
    assert after[1] != before[1]
    _finish(cluster, ["a", "spare"])
    joined = _check_training(cluster)
    assert [r["pid"] for r in joined] == [after[1]]
    assert joined[0]["step"] > 0


def test_a_node_joins_a_running_job_without_a_restart(cluster: Cluster) -> None:
    """2 agents training (--nnodes 2:3); a third joins, its worker slow to start
    (``_newcomer_held``). The two keep their processes and keep stepping while it
    starts, every rank switches at the same step, and the newcomer gets the
    state."""
    endpoint = f"127.0.0.1:{free_port()}"
    host = _agent_args(endpoint, "live-join", "2:3", 1, f"{FAST},is_host=true", *HOLD)
    args = _agent_args(endpoint, "live-join", "2:3", 1, f"{FAST},is_host=false", *HOLD)
    events = str(cluster.dir / "events-c.jsonl")
    cluster.start([*host, *_train(cluster)], "a")
    cluster.start([*args, *_train(cluster)], "b")
    before = _wait_training(cluster, 2)
    round_ = _newest_round(cluster)
    _newcomer_held(
        cluster,
        set(before.values()),
        2,
        lambda: cluster.start([*args, "--events-file", events, *_train(cluster)], "c"),
    )
    after = _wait_training(cluster, 3, round_)
    assert set(before.values()) <= set(after.values())
    _finish(cluster, ["a", "b", "c"])
    joined = _check_training(cluster)
    assert len(joined) == 1 and joined[0]["step"] > 0
    records = _records(cluster)
    newcomer = joined[0]["pid"]
    started = next(r["time"] for r in records if r["event"] == "start" and r["pid"] == newcomer)
    ready = next(r["time"] for r in records if r["event"] == "ready" and r["pid"] == newcomer)
    while_starting = {
        r["step"] for r in records
        if r["event"] == "step" and r["pid"] in before.values() and started < r["time"] < ready
    }  # fmt: skip
    assert len(while_starting) >= 10, f"the others stood still: {sorted(while_starting)}"
    (regroup,) = [e for e in read_jsonl(Path(events)) if e["kind"] == "live_regroup"]
    assert regroup["started"] == 1 and regroup["warm_started"] == 1, regroup
    last_old = max(
        r["step"] for r in _records(cluster) if r["event"] == "step" and r["round"] == round_
    )
    first_new = {
        r["pid"]: r["step"]
        for r in reversed(_records(cluster))
        if r["event"] == "round" and r["round"] > round_
    }
    assert set(first_new.values()) == {last_old}, "ranks left the old round at different steps"


def test_a_worker_that_ignores_the_new_round_is_replaced_within_the_bound(
    cluster: Cluster,
) -> None:
    """One agent x 2 workers, --live-timeout 3: local rank 0 stops calling into the
    API at step 20 (a long local section), then local rank 1 is killed. The agent
    hands the new round to rank 0, which does not take it; within the bound it is
    stopped and started again, and the job finishes."""
    args = [
        "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05",
        "--stop-grace", "1", "--live", "--live-timeout", "3", "--max-restarts", "3",
        "--events-file", str(cluster.dir / "events.jsonl"),
    ]  # fmt: skip
    cluster.start([*args, *_train(cluster, "20")], "a")

    def both_at_step_20() -> dict[int, int] | None:
        # rank -> pid once both ranks committed step 20 (rank 1 may be a step behind)
        pids = {
            r["rank"]: r["pid"]
            for r in _records(cluster)
            if r["event"] == "step" and r["step"] >= 20
        }
        return pids if len(pids) == 2 else None

    pids = cluster.wait_for(both_at_step_20, "step 20 on both ranks", WAIT)
    time.sleep(0.5)
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    cluster.wait_for(lambda: not _alive(pids[0]), "the ignoring worker stopped", 3 + 10)
    replaced_s = time.monotonic() - killed_at
    assert replaced_s < 3 + 5, f"replaced after {replaced_s:.1f} s"
    _sprint(cluster)
    assert cluster.wait("a", WAIT) == 0, cluster.logs()
    done = [r for r in _records(cluster) if r["event"] == "done"]
    assert len(done) == 2 and all(r["step"] == STEPS for r in done)
    assert cluster.leftovers() == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return fp.read().split()[2] != "Z"
    except OSError:
        return False


def test_a_stalled_worker_counts_as_failed(cluster: Cluster) -> None:
    """One agent x 2 workers, --progress-timeout 1: SIGSTOP a worker. It is stopped,
    started again, gets the state from its sibling, and training goes on."""
    args = [
        "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05",
        "--stop-grace", "1", "--live", "--progress-timeout", "1", "--max-restarts", "3",
        "--no-live-spare", "--events-file", str(cluster.dir / "events.jsonl"),
    ]  # fmt: skip
    cluster.start([*args, *_train(cluster)], "a")
    before = _wait_training(cluster, 2)
    round_ = _newest_round(cluster)
    os.kill(before[1], signal.SIGSTOP)
    after = _wait_training(cluster, 2, round_)
    assert after[0] == before[0] and after[1] != before[1]
    assert not _warm_spare(cluster, "a"), "--no-live-spare kept a warm spare"
    _finish(cluster, ["a"])
    joined = _check_training(cluster)
    assert [r["pid"] for r in joined] == [after[1]] and joined[0]["step"] > 0
    regroups = [
        e for e in read_jsonl(cluster.dir / "events.jsonl")
        if e["kind"] == "live_regroup" and e["round"] > round_
    ]  # fmt: skip
    assert regroups and regroups[0]["warm_started"] == 0, regroups


def test_teed_workers_start_warm_and_their_output_is_teed(cluster: Cluster) -> None:
    """One agent x 2 workers, --tee 3: the first workers are the warm spares started
    with the rendezvous, and a killed worker's replacement is a warm spare too; each
    one's output reaches its own log file and, prefixed, the console."""
    logs = cluster.dir / "logs"
    events = cluster.dir / "events.jsonl"
    args = [
        "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05",
        "--stop-grace", "1", "--live", "--max-restarts", "3", "--tee", "3",
        "--log-dir", str(logs), "--events-file", str(events),
    ]  # fmt: skip
    cluster.start([*args, *_train(cluster)], "a")
    before = _wait_training(cluster, 2)
    round_ = _newest_round(cluster)
    workers = set(before.values())
    cluster.wait_for(lambda: _warm_spare(cluster, "a", workers), "a warm spare", WAIT)
    os.kill(before[1], signal.SIGKILL)
    after = _wait_training(cluster, 2, round_)
    assert after[0] == before[0] and after[1] != before[1]
    _finish(cluster, ["a"])
    _check_training(cluster)
    regroups = [e for e in read_jsonl(events) if e["kind"] == "live_regroup"]
    assert regroups[0]["round"] == round_ and regroups[0]["warm_started"] == 2, regroups
    assert regroups[-1]["round"] > round_ and regroups[-1]["warm_started"] == 1, regroups
    console = cluster.agents["a"].log()
    for rank, pid in {**before, 1: after[1]}.items():
        line = next(
            (text for text in console.splitlines() if text.endswith(f"rank {rank} pid {pid}")),
            None,
        )
        assert line is not None and line.startswith("[default"), (rank, pid, console[-2000:])
        teed = [p for p in logs.rglob("stdout.log") if f"pid {pid}\n" in p.read_text()]
        assert len(teed) == 1 and teed[0].parent.name == str(rank), (pid, teed)


def test_the_live_api_without_a_live_agent_runs_one_round(tmp_path: Path) -> None:
    """Under a plain launch the script's rounds() yields once and the job finishes."""
    import subprocess

    out = tmp_path
    proc = subprocess.run(
        [sys.executable, "-m", "rallypoint.run", "--standalone", "--nproc-per-node", "2",
         SCRIPT, str(out), "30", "0"],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["round"] for r in records if r["event"] == "round"} == {0}
    assert sorted(r["step"] for r in records if r["event"] == "done") == [30, 30]
    # A whole-job start: every rank restores its checkpoint itself.
    assert len([r for r in records if r["event"] == "restore"]) == 2


def test_the_gpu_check_runs_in_one_command() -> None:
    """``python tests/helpers/gpu_check.py``: on a machine without CUDA it says it skipped and
    exits 0; on a GPU machine its exit status counts the failed checks."""
    import subprocess

    check = Path(__file__).resolve().parents[1] / "helpers" / "gpu_check.py"
    proc = subprocess.run(
        [sys.executable, str(check)], capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("gpu_check: skipped") or " CUDA device(s): " in first


def test_function_workers_start_warm(tmp_path: Path) -> None:
    """The function API under --live: each worker is one of the warm spares the
    agent started with the rendezvous (its process runs the warm worker)."""
    from rallypoint.agent import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, standalone=True, live=True,
        monitor_interval=0.05, log_dir=str(tmp_path),
    )  # fmt: skip
    # Each worker reports its own command line (the shell's parent is the worker).
    cmdlines = elastic_launch(config, subprocess.getoutput)("tr '\\0' ' ' < /proc/$PPID/cmdline")
    assert sorted(cmdlines) == [0, 1]
    for line in cmdlines.values():
        assert "rallypoint.agent.worker.warm" in line, cmdlines
