"""Live regroup of sharded state (FSDP2 on a CPU mesh, gloo) with real agents on 127.0.0.1.

Each scenario trains ``tests/helpers/live_sharded.py``, whose ranks record, at
every committed step, a digest of the whole parameters and of their own optimizer
shard. The same world run undisturbed (plain processes, no agent) gives the digest
every (step, shard) must have: the training invariant checked after every scenario
is that each committed step of each rank carries exactly those bits (the state a
newcomer received, and the shards the survivors moved into their rebuilt objects,
are the ones they held, and training goes on as if nothing happened), that every
step up to the last was committed, and that the job finished there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from helpers.cluster import Cluster, free_port, read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

SCRIPT = str(Path(__file__).resolve().parents[1] / "helpers" / "live_sharded.py")
WAIT = 120.0
STEPS = 400
STEP_TIME = 0.02
FAST = "keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60,last_call_timeout=0.5"


def _undisturbed(tmp_path: Path, world: int, local: int) -> dict[tuple[int, int], str]:
    """(step, shard) -> digest, from the same job run once without an agent."""
    out = tmp_path / "undisturbed"
    out.mkdir()
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local),
            LOCAL_WORLD_SIZE=str(local), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, SCRIPT, str(out), str(STEPS), "0"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=WAIT)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), outputs
    digests = {}
    for r in read_jsonl(out / "records.jsonl"):
        if r["event"] == "step":
            assert digests.setdefault((r["step"], r["shard"]), r["digest"]) == r["digest"]
    return digests


def _agent_args(endpoint: str, run_id: str, nnodes: str, nproc: int) -> list[str]:
    return [
        "--nnodes", nnodes, "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--local-addr", "127.0.0.1", "--monitor-interval", "0.05", "--stop-grace", "2",
        "--live", "--live-timeout", "30", "--max-restarts", "3", "--rdzv-conf", FAST,
    ]  # fmt: skip


def _records(cluster: Cluster) -> list[dict[str, Any]]:
    return read_jsonl(cluster.dir / "records.jsonl")


def _stepping(cluster: Cluster, world: int, after_round: int = -1) -> dict[int, int] | None:
    """rank -> pid in the newest round after ``after_round`` in which ``world``
    ranks committed a step; None before there is one."""
    by_round: dict[int, dict[int, int]] = defaultdict(dict)
    for r in _records(cluster):
        if r["event"] == "step" and r["round"] > after_round and r["world"] == world:
            by_round[r["round"]][r["rank"]] = r["pid"]
    full = [round_ for round_, ranks in by_round.items() if len(ranks) == world]
    return by_round[max(full)] if full else None


def _check_training(cluster: Cluster, digests: dict[tuple[int, int], str]) -> None:
    """The training invariant (module docstring)."""
    records = _records(cluster)
    steps = [r for r in records if r["event"] == "step"]
    assert {r["step"] for r in steps} == set(range(1, STEPS + 1)), "a step was never committed"
    wrong = [r for r in steps if digests[(r["step"], r["shard"])] != r["digest"]]
    assert not wrong, f"{len(wrong)} steps differ from the undisturbed run, first {wrong[0]}"
    done = [r for r in records if r["event"] == "done"]
    assert done and all(r["step"] == STEPS for r in done)


def test_a_killed_hsdp_worker_takes_its_shard_from_the_other_replica(
    cluster: Cluster, tmp_path: Path
) -> None:
    """HSDP, 2 agents x 2 workers (each node one replica of 2 shards): SIGKILL rank
    3. Its replacement gets shard 1 from rank 1, the other replica, and reads no
    checkpoint; the three survivors keep their processes and rebuild their objects
    from their own shards; every step matches the undisturbed run bit for bit."""
    digests = _undisturbed(tmp_path, 4, 2)
    args = _agent_args(f"127.0.0.1:{free_port()}", "sharded-crash", "2", 2)
    for name in ("a", "b"):
        events = str(cluster.dir / f"events-{name}.jsonl")
        cluster.start(
            [*args, "--events-file", events, SCRIPT, str(cluster.dir), str(STEPS), str(STEP_TIME)],
            name,
        )
    before = cluster.wait_for(lambda: _stepping(cluster, 4), "4 ranks stepping", WAIT)
    round_ = max(r["round"] for r in _records(cluster) if r["event"] == "step")
    os.kill(before[3], signal.SIGKILL)
    after = cluster.wait_for(
        lambda: _stepping(cluster, 4, round_), "4 ranks stepping after the kill", WAIT
    )
    assert after[3] != before[3]
    assert [after[rank] for rank in (0, 1, 2)] == [before[rank] for rank in (0, 1, 2)]
    (cluster.dir / "sprint").touch()
    for name in ("a", "b"):
        assert cluster.wait(name, WAIT) == 0, cluster.logs()
    assert cluster.leftovers() == []
    _check_training(cluster, digests)
    records = _records(cluster)
    restored = {r["pid"] for r in records if r["event"] == "restore"}
    assert restored == set(before.values()), "the replacement read a checkpoint"
    (joined,) = [r for r in records if r["event"] == "round" and r["pid"] == after[3]]
    assert joined["step"] > 0 and joined["shard"] == 1, joined
    node_b = read_jsonl(cluster.dir / "events-b.jsonl")
    regroups = [e for e in node_b if e["kind"] == "live_regroup" and e["round"] > round_]
    assert regroups and regroups[0]["state_from"] == [1], regroups
    assert regroups[0]["state_from_disk"] is False
