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
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
from helpers.cluster import Cluster, free_port, read_jsonl

# (a scenario's bounds add up to more than the suite's 300 s per test on a
# loaded host: see START)
pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.timeout(900)]

SCRIPT = str(Path(__file__).resolve().parents[1] / "helpers" / "live_sharded.py")
WAIT = 120.0
#: the job's first steps: every worker's interpreter, torch import and FSDP set-up,
#: four of them at once on a loaded 2-core host (minutes there); it bounds a hang
START = 300.0
#: (a step of the four ranks costs about 0.075 s of CPU, 0.155 s with the whole
#: state's digest: measured without an agent; 60 steps, not 200: the FSDP faults
#: strike after step 25, and steps before and after them are compared)
STEPS = 60
#: seconds a step takes until the scenario is done (then the job sprints): the
#: runway a fault has before the job would finish (30 s in all; 17.5 s after step
#: 25, where the FSDP scenarios strike: 200 steps of 0.1 s gave 17.5 s). A step
#: that sleeps costs no CPU; one that trains does
STEP_TIME = 0.5
#: a's step time while it trains alone in the joining scenarios: a runway of 100 s
#: (as 200 steps of 0.5 s gave) for b's agent and workers to start and join
#: (seconds each on a loaded host)
ALONE_STEP_TIME = 100 / STEPS
#: seconds between two looks at the records (each look reads them all)
POLL = 0.1
#: a lost node is found within a 5 s liveness window (1 s x 5): with 2 s, an agent
#: whose heartbeat thread four resharding workers starved on a loaded 2-core host
#: fenced itself
FAST = "keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=60,last_call_timeout=0.5"
#: plain FSDP over the whole world, a snapshot every 10 steps; its scenarios strike
#: after step 25 (two snapshots taken), and the steps before it take no STEP_TIME
FSDP = {
    "LIVE_SHARDED_MESH": "fsdp",
    "LIVE_SHARDED_SNAPSHOT_EVERY": "10",
    "LIVE_SHARDED_PACED_FROM": "25",
}
#: every record carries the whole state's digest (comparable across meshes)
WHOLE = {"LIVE_SHARDED_WHOLE": "1"}


@pytest.fixture(scope="module")
def digests(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], str]:
    """(step, shard) -> digest, from the job run once without an agent (HSDP, 2 x 2).
    A world of one replica commits the same bits (its gradients are averages of
    identical batches), so the scenarios that shrink or grow compare with it too."""
    steps = _undisturbed(tmp_path_factory.mktemp("undisturbed"), 4, 2, {})
    return _by_shard(steps, "digest")


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The step records of plain FSDP over 4 ranks run once without an agent, each
    with both digests: gathering the whole state does not change the training (the
    per-shard digests of a run without it are the same bits: checked on this torch,
    200 steps), so one run serves both fixtures below."""
    return _undisturbed(tmp_path_factory.mktemp("undisturbed-fsdp"), 4, 2, FSDP | WHOLE)


@pytest.fixture(scope="module")
def fsdp_digests(fsdp_run: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    """The same as ``digests`` for plain FSDP over 4 ranks (a shard per rank, no
    replica)."""
    return _by_shard(fsdp_run, "digest")


@pytest.fixture(scope="module")
def fsdp_wholes(fsdp_run: list[dict[str, Any]]) -> dict[int, str]:
    """step -> the whole state's digest, from plain FSDP over 4 ranks run once without
    an agent. FSDP over 2 ranks commits the same bits at every step (every rank
    trains on the same batch, and the averages of 2 and of 4 identical gradients
    are the same floats: checked on this torch, 60 steps), so a job whose mesh
    shrinks or grows must match it too."""
    return {step: digest for (step, _), digest in _by_shard(fsdp_run, "whole").items()}


def _by_shard(steps: list[dict[str, Any]], field: str) -> dict[tuple[int, int], str]:
    """(step, shard) -> the records' ``field``; every rank of a shard agrees."""
    found: dict[tuple[int, int], str] = {}
    for r in steps:
        key = (r["step"], 0 if field == "whole" else r["shard"])
        assert found.setdefault(key, r[field]) == r[field], r
    return found


def _undisturbed(
    out: Path, world: int, local: int, extra_env: dict[str, str]
) -> list[dict[str, Any]]:
    """The step records of the same job run once without an agent."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local),
            LOCAL_WORLD_SIZE=str(local), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra_env,
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
        outputs = [p.communicate(timeout=START)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), outputs
    return [r for r in read_jsonl(out / "records.jsonl") if r["event"] == "step"]


def _agent_args(
    endpoint: str, run_id: str, nnodes: str, nproc: int, host: bool, spare: bool = False
) -> list[str]:
    """An agent's flags; ``host``: it hosts the c10d store (the others may be lost).
    ``spare``: it keeps the warm spare worker (the default) where the scenario
    replaces one of its workers or starts it while the job trains (its first
    workers are then warm spares, the path the product takes); an agent none of
    whose workers is replaced or started late gains nothing from its idle spare (a
    process with torch imported: the worker's imports alone took 3.1 s of CPU on
    this host), and runs with --no-live-spare."""
    conf = f"{FAST},is_host={'true' if host else 'false'}"
    return [*([] if spare else ["--no-live-spare"]),
        "--nnodes", nnodes, "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--local-addr", "127.0.0.1", "--monitor-interval", "0.05", "--stop-grace", "2",
        "--live", "--live-timeout", "30", "--max-restarts", "3", "--rdzv-conf", conf,
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


def _check_training(cluster: Cluster, digests: dict[tuple[int, int], str] | dict[int, str]) -> None:
    """The training invariant (module docstring): with (step, shard) digests, each
    rank's shards; with step digests, the whole state's (a mesh that changed)."""
    records = _records(cluster)
    steps = [r for r in records if r["event"] == "step"]
    assert {r["step"] for r in steps} == set(range(1, STEPS + 1)), "a step was never committed"
    expected = cast(dict[Any, str], digests)
    whole = all(isinstance(key, int) for key in expected)
    wrong = [
        r for r in steps
        if (expected[r["step"]] != r["whole"] if whole
            else expected[(r["step"], r["shard"])] != r["digest"])
    ]  # fmt: skip
    assert not wrong, f"{len(wrong)} steps differ from the undisturbed run, first {wrong[0]}"
    done = [r for r in records if r["event"] == "done"]
    assert done and all(r["step"] == STEPS for r in done)


def _start(
    cluster: Cluster,
    name: str,
    args: list[str],
    env: dict[str, str] | None = None,
    step_time: float = STEP_TIME,
) -> None:
    events = str(cluster.dir / f"events-{name}.jsonl")
    cluster.start(
        [*args, "--events-file", events, SCRIPT, str(cluster.dir), str(STEPS), str(step_time)],
        name,
        env=env,
    )


def _finish(
    cluster: Cluster, names: list[str], digests: dict[tuple[int, int], str] | dict[int, str]
) -> None:
    """Let the job run to its last step at full speed, and check it (module docstring)."""
    (cluster.dir / "sprint").touch()
    for name in names:
        assert cluster.wait(name, WAIT) == 0, cluster.logs()
    assert cluster.leftovers() == []
    _check_training(cluster, digests)


def _wait_for(cluster: Cluster, predicate: Callable[[], Any], what: str, timeout: float) -> Any:
    """``cluster.wait_for``, looking every ``POLL`` s (a look parses every record)."""
    return cluster.wait_for(predicate, what, timeout, poll=POLL)


def _kill_rank_3(
    cluster: Cluster, from_step: int = 0, between_steps: bool = False
) -> tuple[dict[int, int], dict[int, int], int]:
    """Once 4 ranks step (and a step >= ``from_step`` was committed), SIGKILL rank 3's
    worker (``between_steps``: it kills itself after a step's work, before its commit;
    otherwise wherever it is); once 4 ranks step again, check that ranks 0-2 kept their
    processes and rank 3's was replaced. Returns (rank -> pid before, after, the round
    it died in)."""
    before = _wait_for(cluster, lambda: _stepping(cluster, 4), "4 ranks stepping", START)
    _wait_for(
        cluster,
        lambda: any(r["event"] == "step" and r["step"] >= from_step for r in _records(cluster)),
        f"step {from_step}",
        WAIT,
    )
    round_ = max(r["round"] for r in _records(cluster) if r["event"] == "step")
    if between_steps:
        (cluster.dir / "sigkill-rank-3").touch()
    else:
        os.kill(before[3], signal.SIGKILL)
    after = _wait_for(
        cluster, lambda: _stepping(cluster, 4, round_), "4 ranks stepping after the kill", WAIT
    )
    assert after[3] != before[3]
    assert [after[rank] for rank in (0, 1, 2)] == [before[rank] for rank in (0, 1, 2)]
    return before, after, round_


def _kill_node_b_after_two_snapshots(cluster: Cluster) -> tuple[dict[int, int], int, set[int]]:
    """Once 4 ranks step and two snapshots (every 10 steps) were taken, SIGKILL agent
    b and its workers. Returns (rank -> pid before, the round they died in, a's
    workers' pids)."""
    before = _wait_for(cluster, lambda: _stepping(cluster, 4), "4 ranks stepping", START)
    _wait_for(
        cluster,
        lambda: any(r["event"] == "step" and r["step"] >= 25 for r in _records(cluster)),
        "two snapshots taken",
        WAIT,
    )
    round_ = max(r["round"] for r in _records(cluster) if r["event"] == "step")
    survivors = {p.pid for p in cluster.tree("a")} & set(before.values())
    cluster.kill("b", machine=True)
    return before, round_, survivors


def test_a_killed_hsdp_worker_takes_its_shard_from_the_other_replica(
    cluster: Cluster, digests: dict[tuple[int, int], str]
) -> None:
    """HSDP, 2 agents x 2 workers (each node one replica of 2 shards): SIGKILL rank
    3. Its replacement gets shard 1 from rank 1, the other replica, and reads no
    checkpoint; the three survivors keep their processes and rebuild their objects
    from their own shards; every step matches the undisturbed run bit for bit.

    Rank 3 dies between steps: killed inside a step, after its replica's collectives
    and before the cross-replica one, ranks 0 and 2 (shard 0) may commit that step
    while rank 1 (shard 1) cannot, and with the shards' newest copies at different
    steps the job rightly reads its checkpoint (this job keeps no snapshots to roll
    back to): a different path from the one this test is about."""
    endpoint = f"127.0.0.1:{free_port()}"
    for name in ("a", "b"):
        _start(
            cluster, name, _agent_args(endpoint, "sharded-crash", "2", 2, name == "a", name == "b")
        )
    before, after, round_ = _kill_rank_3(cluster, between_steps=True)
    _finish(cluster, ["a", "b"], digests)
    records = _records(cluster)
    restored = {r["pid"] for r in records if r["event"] == "restore"}
    assert restored == set(before.values()), "the replacement read a checkpoint"
    (joined,) = [r for r in records if r["event"] == "round" and r["pid"] == after[3]]
    assert joined["step"] > 0 and joined["shard"] == 1, joined
    node_b = read_jsonl(cluster.dir / "events-b.jsonl")
    regroups = [e for e in node_b if e["kind"] == "live_regroup" and e["round"] > round_]
    assert regroups and regroups[0]["state_from"] == [1], regroups
    assert regroups[0]["state_from_disk"] is False


def test_a_lost_hsdp_replica_shrinks_the_mesh_without_resharding(
    cluster: Cluster, digests: dict[tuple[int, int], str]
) -> None:
    """HSDP, --nnodes 1:2, 2 agents x 2 workers: SIGKILL agent b and its workers (one
    whole replica). a's two workers keep their processes and their shards in a mesh
    of one replica; nothing moves between ranks, and every step matches the
    undisturbed run (whose gradients, averaged over identical batches, are the same
    in a world of 2 and of 4)."""
    endpoint = f"127.0.0.1:{free_port()}"
    _start(cluster, "a", _agent_args(endpoint, "sharded-shrink", "1:2", 2, host=True))
    _start(cluster, "b", _agent_args(endpoint, "sharded-shrink", "1:2", 2, host=False))
    before = _wait_for(cluster, lambda: _stepping(cluster, 4), "4 ranks stepping", START)
    round_ = max(r["round"] for r in _records(cluster) if r["event"] == "step")
    survivors = {p.pid for p in cluster.tree("a")} & set(before.values())
    cluster.kill("b", machine=True)
    after = _wait_for(
        cluster, lambda: _stepping(cluster, 2, round_), "2 ranks stepping after the loss", WAIT
    )
    assert set(after.values()) == survivors, "a survivor was restarted"
    _finish(cluster, ["a"], digests)
    regroups = [
        e for e in read_jsonl(cluster.dir / "events-a.jsonl")
        if e["kind"] == "live_regroup" and e["round"] > round_
    ]  # fmt: skip
    assert regroups and regroups[0]["state_from"] == [] and regroups[0]["state_bytes"] == 0


def test_a_node_joining_an_hsdp_job_gets_its_shards_from_the_running_replica(
    cluster: Cluster, digests: dict[tuple[int, int], str]
) -> None:
    """HSDP, --nnodes 1:2: a trains alone (one replica); b joins. a's workers keep
    their processes; b's get shards 0 and 1 from ranks 0 and 1 and read no
    checkpoint; every step matches the undisturbed run."""
    endpoint = f"127.0.0.1:{free_port()}"
    # a alone must not finish before b's workers have started (seconds each on a
    # loaded host): slow steps until the scenario is done
    join = _agent_args(endpoint, "sharded-join", "1:2", 2, host=True)
    _start(cluster, "a", join, step_time=ALONE_STEP_TIME)
    alone = _wait_for(cluster, lambda: _stepping(cluster, 2), "a alone stepping", START)
    _start(cluster, "b", _agent_args(endpoint, "sharded-join", "1:2", 2, host=False, spare=True))
    after = _wait_for(cluster, lambda: _stepping(cluster, 4), "4 ranks stepping", START)
    assert {after[0], after[1]} == set(alone.values()), "a's workers were restarted"
    _finish(cluster, ["a", "b"], digests)
    records = _records(cluster)
    assert {r["pid"] for r in records if r["event"] == "restore"} == set(alone.values())
    joined = [r for r in records if r["event"] == "round" and r["pid"] in (after[2], after[3])]
    assert sorted((r["rank"], r["shard"]) for r in joined) == [(2, 0), (3, 1)]
    assert all(r["step"] > 0 for r in joined), joined


def test_a_killed_fsdp_worker_rolls_the_job_back_to_its_buddys_snapshot(
    cluster: Cluster, fsdp_digests: dict[tuple[int, int], str]
) -> None:
    """Plain FSDP over 2 agents x 2 workers, a snapshot every 10 steps: SIGKILL rank
    3. No rank holds its shard, but rank 1 (on the other node) keeps its snapshot:
    every rank rolls back to the newest whole snapshot, the replacement gets shard 3
    from rank 1 and reads no checkpoint, the survivors keep their processes, and the
    steps redone carry the same bits as the undisturbed run."""
    endpoint = f"127.0.0.1:{free_port()}"
    for name in ("a", "b"):
        _start(
            cluster,
            name,
            _agent_args(endpoint, "fsdp-crash", "2", 2, name == "a", name == "b"),
            FSDP,
        )
    before, _, round_ = _kill_rank_3(cluster, from_step=25)  # two snapshots taken
    _finish(cluster, ["a", "b"], fsdp_digests)
    records = _records(cluster)
    assert {r["pid"] for r in records if r["event"] == "restore"} == set(before.values())
    next_round = min(r["round"] for r in records if r["event"] == "round" and r["round"] > round_)
    resumed = [r for r in records if r["event"] == "round" and r["round"] == next_round]
    assert len(resumed) == 4 and all(r["step"] % 10 == 0 for r in resumed), resumed
    last_before = max(
        r["step"] for r in records if r["event"] == "step" and r["pid"] == before[0]
        and r["round"] <= round_
    )  # fmt: skip
    assert all(last_before - 20 <= r["step"] <= last_before for r in resumed), resumed
    node_b = read_jsonl(cluster.dir / "events-b.jsonl")
    regroups = [e for e in node_b if e["kind"] == "live_regroup" and e["round"] > round_]
    assert regroups and 1 in regroups[0]["state_from"], regroups
    assert regroups[0]["state_from_disk"] is False


def test_a_lost_fsdp_node_comes_back_from_the_snapshots_its_buddies_keep(
    cluster: Cluster, fsdp_digests: dict[tuple[int, int], str]
) -> None:
    """Plain FSDP over 2 agents x 2 workers, a snapshot every 10 steps: SIGKILL agent
    b and its workers (half the shards) and start a replacement agent at once. The
    lost shards' copies live on a's ranks (their buddies on the other node): every
    rank rolls back to the newest whole snapshot, the replacement's workers get the
    lost shards from a's and read no checkpoint, a's workers keep their processes,
    and the steps redone carry the same bits as the undisturbed run."""
    endpoint = f"127.0.0.1:{free_port()}"
    for name in ("a", "b"):
        _start(cluster, name, _agent_args(endpoint, "fsdp-node", "2", 2, name == "a"), FSDP)
    before, round_, survivors = _kill_node_b_after_two_snapshots(cluster)
    b2 = _agent_args(endpoint, "fsdp-node", "2", 2, host=False, spare=True)
    _start(cluster, "b2", b2, FSDP)
    after = _wait_for(
        cluster, lambda: _stepping(cluster, 4, round_), "4 ranks stepping after the loss", WAIT
    )
    assert survivors < set(after.values()), "a survivor was restarted"
    _finish(cluster, ["a", "b2"], fsdp_digests)
    records = _records(cluster)
    assert {r["pid"] for r in records if r["event"] == "restore"} == set(before.values())
    newcomers = set(after.values()) - survivors
    first_rounds: dict[int, dict[str, Any]] = {}
    for r in records:
        if r["event"] == "round" and r["pid"] in newcomers:
            first_rounds.setdefault(r["pid"], r)
    joined = list(first_rounds.values())
    assert len(joined) == 2 and all(r["step"] > 0 and r["step"] % 10 == 0 for r in joined), joined
    regroups = [
        e for e in read_jsonl(cluster.dir / "events-b2.jsonl") if e["kind"] == "live_regroup"
    ]
    assert all(e["state_from_disk"] is False for e in regroups), regroups


def test_a_lost_fsdp_node_is_resharded_in_memory_onto_the_nodes_left(
    cluster: Cluster, fsdp_wholes: dict[int, str]
) -> None:
    """Plain FSDP, --nnodes 1:2, 2 agents x 2 workers, a snapshot every 10 steps:
    SIGKILL agent b and its workers, for good. a's two workers keep their processes
    and go on in a mesh of 2: the 4 shards of the newest whole snapshot (their own,
    and b's, whose copies they keep) are resharded into 2 in memory, no checkpoint
    is read, the whole state they start from is bit for bit the one of that step,
    and every step (in the old mesh and the new) matches the undisturbed run."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = FSDP | WHOLE
    _start(cluster, "a", _agent_args(endpoint, "fsdp-shrink", "1:2", 2, host=True), env)
    _start(cluster, "b", _agent_args(endpoint, "fsdp-shrink", "1:2", 2, host=False), env)
    before, round_, survivors = _kill_node_b_after_two_snapshots(cluster)
    after = _wait_for(
        cluster, lambda: _stepping(cluster, 2, round_), "2 ranks stepping after the loss", WAIT
    )
    assert set(after.values()) == survivors, "a survivor was restarted"
    _finish(cluster, ["a"], fsdp_wholes)
    records = _records(cluster)
    assert {r["pid"] for r in records if r["event"] == "restore"} == set(before.values())
    resumed = [r for r in records if r["event"] == "round" and r["world"] == 2]
    assert resumed and all(r["step"] > 0 and r["step"] % 10 == 0 for r in resumed), resumed
    assert all(r["whole"] == fsdp_wholes[r["step"]] for r in resumed), resumed
    regroups = [
        e for e in read_jsonl(cluster.dir / "events-a.jsonl")
        if e["kind"] == "live_regroup" and e["round"] > round_
    ]  # fmt: skip
    assert regroups and regroups[0]["state_from_disk"] is False, regroups


def test_a_node_joining_an_fsdp_job_takes_its_shards_resharded_from_the_running_ones(
    cluster: Cluster, fsdp_wholes: dict[int, str]
) -> None:
    """Plain FSDP, --nnodes 1:2: a trains alone (2 shards); b joins. The 2 shards
    are resharded into 4 in memory at the step a's workers are at (nothing rolls
    back): a's workers keep their processes, b's read no checkpoint, and every step
    matches the undisturbed run."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {"LIVE_SHARDED_MESH": "fsdp"} | WHOLE
    join = _agent_args(endpoint, "fsdp-join", "1:2", 2, host=True)
    _start(cluster, "a", join, env, step_time=ALONE_STEP_TIME)
    alone = _wait_for(cluster, lambda: _stepping(cluster, 2), "a alone stepping", START)
    _start(cluster, "b", _agent_args(endpoint, "fsdp-join", "1:2", 2, host=False, spare=True), env)
    after = _wait_for(cluster, lambda: _stepping(cluster, 4), "4 ranks stepping", START)
    assert {after[0], after[1]} == set(alone.values()), "a's workers were restarted"
    _finish(cluster, ["a", "b"], fsdp_wholes)
    records = _records(cluster)
    assert {r["pid"] for r in records if r["event"] == "restore"} == set(alone.values())
    grown = [r for r in records if r["event"] == "round" and r["world"] == 4]
    last_alone = max(r["step"] for r in records if r["event"] == "step" and r["world"] == 2)
    assert grown and all(r["step"] == last_alone for r in grown), (grown, last_alone)
    assert all(r["whole"] == fsdp_wholes[r["step"]] for r in grown), grown
