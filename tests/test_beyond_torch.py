"""Issue 15, end to end: what torch elastic users ask for and torch does not do.

Real ``rallypoint run`` agents on 127.0.0.1 with the torch-free worker of
``tests/chaos/peer_worker.py``; every process a test starts carries a mark and is
killed by the fixture, and each test asserts that none is left behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaos.cluster import HERE, Cluster, free_port, read_jsonl

WORKER = str(HERE / "peer_worker.py")
# A dead peer is declared after 0.5 s x 2 without a heartbeat.
CONF = "keep_alive_interval=0.5,keep_alive_max_attempt=2,last_call_timeout=0.3"
WAIT = 90.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()


def _args(port: int, run_id: str, nnodes: str, *extra: str) -> list[str]:
    return [
        "--nnodes", nnodes, "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", run_id, "--local-addr", "127.0.0.1",
        "--monitor-interval", "0.05", "--stop-grace", "2", *extra,
    ]  # fmt: skip


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
    args = _args(port, "spare", "3", "--max-restarts", "3")
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
    (cluster.dir / "finish").touch()
    for name in ("spare", *(n for n in "abc" if n != victim)):
        assert cluster.wait(name, WAIT) == 0, cluster.logs()
    assert cluster.leftovers() == []
