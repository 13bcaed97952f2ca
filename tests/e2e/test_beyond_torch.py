"""End to end: what torch elastic users ask for and torch does not do.

Real ``rallypoint run`` agents on 127.0.0.1 with the torch-free worker of
``tests/helpers/peer_worker.py``; every process a test starts carries a mark and is
killed by the fixture, and each test asserts that none is left behind.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.cluster import HERE, Cluster, c10d_agent_args, free_port, read_jsonl

WORKER = str(HERE / "peer_worker.py")
# A dead peer is declared after 0.5 s x 2 without a heartbeat.
CONF = "keep_alive_interval=0.5,keep_alive_max_attempt=2,last_call_timeout=0.3"
WAIT = 90.0


def _rounds(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_round.setdefault(int(r["RALLYPOINT_ROUND"]), []).append(r)
    return by_round


def _full_round(records: list[dict[str, Any]], size: int, after: int = -1) -> list[dict[str, Any]]:
    """The workers of the latest round above ``after`` once all ``size`` have started."""
    for number, recs in sorted(_rounds(records).items(), reverse=True):
        if number > after and len(recs) == size == int(recs[0]["GROUP_WORLD_SIZE"]):
            return recs
    return []


@pytest.mark.integration
def test_a_spare_takes_the_lost_nodes_rank_and_the_survivors_keep_theirs(
    cluster: Cluster,
) -> None:
    """Three active agents (--nnodes 3, stable ranks) and a fourth standing by as a
    spare. The middle-ranked active agent is lost with its worker (SIGKILL, a
    machine loss): the spare joins the next round with that group rank, and both
    survivors keep theirs (torch's rule would re-rank the survivors by node order)."""
    port, records = free_port(), cluster.dir / "records.jsonl"
    events_file = cluster.dir / "events.jsonl"
    args = c10d_agent_args(
        port, "spare", "3", "--max-restarts", "3", "--events-file", str(events_file)
    )
    conf = f"{CONF},stable_ranks=1"

    def start(name: str, host: bool) -> None:
        rdzv = f"{conf},is_host={'true' if host else 'false'}"
        cluster.start([*args, "--rdzv-conf", rdzv, WORKER, str(cluster.dir), "watch"], name)

    for name in "abc":
        start(name, host=name == "a")
    first = cluster.wait_for(lambda: _full_round(read_jsonl(records), 3), "a round of 3", WAIT)
    first_round = int(first[0]["RALLYPOINT_ROUND"])
    rank_of = {int(r["agent_pid"]): int(r["GROUP_RANK"]) for r in first}
    pids = {name: cluster.agents[name].pid for name in "abc"}
    start("spare", host=False)
    time.sleep(3.0)  # a join on loopback takes well under a second: it stands by
    # Lose the active agent whose rank a re-ranking by node order would change.
    survivors_by_rank = sorted("abc", key=lambda n: rank_of[pids[n]])
    victim = survivors_by_rank[1]
    lost_rank = rank_of[pids[victim]]
    cluster.kill(victim, machine=True)

    second = cluster.wait_for(
        lambda: _full_round(read_jsonl(records), 3, after=first_round),
        "the round with the spare",
        WAIT,
    )
    new_rank_of = {int(r["agent_pid"]): int(r["GROUP_RANK"]) for r in second}
    assert new_rank_of[cluster.agents["spare"].pid] == lost_rank, cluster.logs()
    for name in "abc":
        if name != victim:
            assert new_rank_of[pids[name]] == rank_of[pids[name]], cluster.logs()
    events = _events(events_file)
    second_round = int(second[0]["RALLYPOINT_ROUND"])
    (spare_round,) = _of(events, "round", cluster.agents["spare"].pid)
    assert (spare_round["round"], spare_round["group_rank"]) == (second_round, lost_rank)
    for name in "abc":
        if name != victim:  # each survivor's restart over the lost peer is an event
            assert _of(events, "restart", pids[name]), events
    (cluster.dir / "finish").touch()
    for name in ("spare", *(n for n in "abc" if n != victim)):
        assert cluster.wait(name, WAIT) == 0, cluster.logs()
    assert cluster.leftovers() == []


def _events(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path)


def _of(events: list[dict[str, Any]], kind: str, pid: int | None = None) -> list[dict[str, Any]]:
    """The events of ``kind`` (of the agent with ``pid``: node names end in _pid_0)."""
    return [
        e for e in events if e["kind"] == kind and (pid is None or e["node"].endswith(f"_{pid}_0"))
    ]


@pytest.mark.integration
def test_a_job_wide_budget_of_two_spent_by_two_nodes_ends_the_job(cluster: Cluster) -> None:
    """--restart-scope job --max-restarts 2: round 0's failure is on one node, round
    1's on the other, round 2's on the first again. Two restarts were the job's
    whole budget (per agent, torchrun's rule would have allowed four), so the third
    failure ends the job on both agents, and every worker of a round saw the same
    restart count."""
    port, events_file = free_port(), cluster.dir / "events.jsonl"
    args = c10d_agent_args(
        port, "budget", "2", "--max-restarts", "2", "--restart-scope", "job",
        "--events-file", str(events_file),
    )  # fmt: skip
    for name in "ab":
        host = "true" if name == "a" else "false"
        cluster.start(
            [*args, "--rdzv-conf", f"{CONF},is_host={host}", WORKER, str(cluster.dir),
             "fail-by-round"],
            name,
        )  # fmt: skip
    codes = {name: cluster.wait(name, WAIT) for name in "ab"}
    logs = cluster.logs()
    assert codes == {"a": 1, "b": 1}, logs
    assert "job-wide restart budget (2)" in logs
    rounds = _rounds(read_jsonl(cluster.dir / "records.jsonl"))
    assert sorted(rounds) == [0, 1, 2], logs
    for number, recs in rounds.items():
        assert {r["TORCHELASTIC_RESTART_COUNT"] for r in recs} == {str(number)}, recs
        assert {r["TORCHELASTIC_MAX_RESTARTS"] for r in recs} == {"2"}
    events = _events(events_file)
    charged = [e for e in _of(events, "restart") if e["charged"]]
    assert len({e["node"] for e in charged}) == 2, charged  # spent by both nodes
    finished = _of(events, "finished")
    assert sorted(e["state"] for e in finished) == ["failed", "failed"], (finished, logs)
    assert cluster.leftovers() == []


@pytest.mark.integration
def test_a_node_failing_its_health_check_is_excluded_and_a_spare_takes_its_place(
    cluster: Cluster,
) -> None:
    """a and b form a round of two; c then stands by as a spare. b's health check
    fails (its command exits 1): b excludes itself, a learns that b failed and
    rejoins, and the next round runs a and the spare c. b never starts a worker and
    ends quietly, still standing by, when the job finishes."""
    port, events_file = free_port(), cluster.dir / "events.jsonl"
    args = c10d_agent_args(
        port, "health", "2", "--max-restarts", "1", "--health-check-timeout", "60",
        "--health-check-command", 'test -z "$HEALTH_BAD"', "--events-file", str(events_file),
    )  # fmt: skip

    def start(name: str, *, host: bool = False, bad: bool = False) -> None:
        rdzv = f"{CONF},is_host={'true' if host else 'false'}"
        env = {"HEALTH_BAD": "1"} if bad else None
        cluster.start([*args, "--rdzv-conf", rdzv, WORKER, str(cluster.dir), "watch"], name,
                      env=env)  # fmt: skip

    start("a", host=True)
    start("b", bad=True)
    cluster.wait_for(
        lambda: len(_of(_events(events_file), "round")) >= 2, "round 0 of a and b", WAIT
    )
    start("c")
    pids = {name: cluster.agents[name].pid for name in "abc"}
    records = cluster.dir / "records.jsonl"
    running = cluster.wait_for(
        lambda: _full_round(read_jsonl(records), 2), "a round with the spare", WAIT
    )
    assert {int(r["agent_pid"]) for r in running} == {pids["a"], pids["c"]}, cluster.logs()
    assert all(int(r["agent_pid"]) != pids["b"] for r in read_jsonl(records))
    events = _events(events_file)
    (excluded,) = _of(events, "exclusion", pids["b"])
    assert "health check failed" in excluded["reason"] and excluded["until"] == 2
    failed_b = [e for e in _of(events, "health_check", pids["b"]) if not e["ok"]]
    assert failed_b and failed_b[0]["fault"] == "self" and failed_b[0]["stage"] == "command"
    assert [e["fault"] for e in _of(events, "health_check", pids["a"])][:1] == ["peers"]
    assert any(e["ok"] for e in _of(events, "health_check", pids["c"]))
    (cluster.dir / "finish").touch()
    codes = {name: cluster.wait(name, WAIT) for name in "abc"}
    assert codes == {"a": 0, "b": 0, "c": 0}, cluster.logs()
    assert "waited as a spare" in cluster.agents["b"].log()
    assert cluster.leftovers() == []


@pytest.mark.integration
def test_a_preempted_agent_leaves_at_once_while_its_workers_checkpoint(
    cluster: Cluster,
) -> None:
    """Three agents (--nnodes 2:3) with the default 15 s liveness window and a 20 s
    stop grace. c gets SIGTERM (a spot VM's notice): its worker gets SIGTERM and
    checkpoints for a second, while c leaves the rendezvous at once, so a and b
    start a round of two long before the liveness window or c's grace would end."""
    port, events_file = free_port(), cluster.dir / "events.jsonl"
    args = c10d_agent_args(
        port, "preempt", "2:3", "--max-restarts", "1", "--events-file", str(events_file),
    )  # fmt: skip
    args[args.index("--stop-grace") + 1] = "20"
    for name in "abc":
        host = "true" if name == "a" else "false"
        cluster.start(
            [*args, "--rdzv-conf", f"last_call_timeout=0.3,is_host={host}", WORKER,
             str(cluster.dir), "checkpoint"],
            name,
        )  # fmt: skip
    records = cluster.dir / "records.jsonl"
    first = cluster.wait_for(lambda: _full_round(read_jsonl(records), 3), "a round of 3", WAIT)
    first_round = int(first[0]["RALLYPOINT_ROUND"])
    signalled = time.time()
    cluster.stop("c", signal.SIGTERM)
    # c exits once its worker has checkpointed (a second): on a loaded machine that
    # can come before the survivors' new workers have started; its status is
    # checked below.
    second = cluster.wait_for(
        lambda: _full_round(read_jsonl(records), 2, after=first_round),
        "a round of 2",
        WAIT,
        allowed_exits=["c"],
    )
    regrouped_after = max(float(r["time"]) for r in second) - signalled
    assert regrouped_after < 10.0, (regrouped_after, cluster.logs())
    assert cluster.wait("c", WAIT) == 128 + signal.SIGTERM, cluster.logs()
    c_pid = cluster.agents["c"].pid
    (c_worker,) = [r for r in first if int(r["agent_pid"]) == c_pid]
    checkpoint = json.loads((cluster.dir / f"checkpoint.{c_worker['pid']}").read_text())
    assert checkpoint["done"] - checkpoint["signal"] >= 1.0  # it had the time to write it
    (preempted,) = _of(_events(events_file), "preemption", c_pid)
    assert preempted["signal"] == "SIGTERM" and preempted["left_s"] < 1.0, preempted
    (cluster.dir / "finish").touch()
    assert {name: cluster.wait(name, WAIT) for name in "ab"} == {"a": 0, "b": 0}
    assert cluster.leftovers() == []


BAD_RECOVERY_FLAGS = [
    (["--restart-scope", "cluster"], "invalid choice: 'cluster'"),
    (["--exclusion-rounds", "0"], "--exclusion-rounds must be an integer >= 1, got 0"),
    (["--exclude-after", "-1"], "--exclude-after must be an integer >= 0, got -1"),
    (["--exclude-window", "nan"], "--exclude-window"),
    (["--health-check", "--health-check-timeout", "0"], "--health-check: timeout must be"),
    (["--health-check-callable", "no colon"], "--health-check: callable must name a function"),
    (["--rdzv-backend", "torch-c10d", "--restart-scope", "job"], "needs rallypoint's rendezvous"),
    (["--rdzv-backend", "static", "--health-check"], "needs rallypoint's rendezvous"),
    (["--events-file", "/nonexistent/dir/events.jsonl"], "cannot open for appending"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_RECOVERY_FLAGS)
def test_bad_recovery_flags_are_one_line_and_status_2(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rallypoint.agent.launcher import main

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    rdzv = [] if "--rdzv-backend" in flags else ["--rdzv-backend", "c10d"]
    argv = [*rdzv, "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--log-dir",
            str(tmp_path / "logs"), *flags, str(script)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rallypoint run: error:"), err
    assert message in err[0], err
