"""End-to-end tests of ``rallypoint run`` with real agents and workers on loopback.

Every agent is a real ``python -m rallypoint.run`` process; workers are a tiny
script (no torch import) that appends one JSON record per start to a shared file
and is steered by marker files, so no test depends on timing. Each test's
processes carry a unique environment mark; the ``procs`` fixture kills every
agent's process tree at teardown and then asserts that no marked process is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.cluster import kill_tree, marked_processes

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MARK_ENV = "RALLYPOINT_TEST_MARK"
WAIT = 90.0

# Fast liveness for the tests: a dead peer is noticed after 0.2 s * 3, and a round
# below max_nodes completes 0.3 s after the minimum is reached.
FAST_CONF = "keep_alive_interval=0.2,keep_alive_max_attempt=3,last_call_timeout=0.3"

WORKER = r"""
import json, os, signal, sys, time
out_dir, mode = sys.argv[1], sys.argv[2]
env = {k: os.environ.get(k) for k in (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE", "RALLYPOINT_ROUND",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "MASTER_ADDR",
    "MASTER_PORT", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
env["pid"] = os.getpid()
env["agent_pid"] = os.getppid()
crashed = os.path.join(out_dir, "crashed")
after_crash = os.path.exists(crashed)

def on_term(signum, frame):
    with open(os.path.join(out_dir, "terminated.%d" % os.getpid()), "w"):
        pass
    sys.exit(0)

def wait_for_round():
    # Fail only once every worker of the round is up (its SIGTERM handler set).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(os.path.join(out_dir, "records.jsonl")) as fp:
            mine = [l for l in fp if json.loads(l)["RALLYPOINT_ROUND"] == env["RALLYPOINT_ROUND"]]
        if len(mine) >= int(env["WORLD_SIZE"]):
            return
        time.sleep(0.02)

signal.signal(signal.SIGTERM, on_term)
print("hello from rank", env["RANK"], flush=True)
with open(os.path.join(out_dir, "records.jsonl"), "a") as fp:
    fp.write(json.dumps(env) + "\n")
if mode == "quick":
    sys.exit(0)
if mode == "crash-once" and env["RANK"] == "1" and not after_crash:
    wait_for_round()
    try:
        os.close(os.open(crashed, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        sys.exit(3)
    except FileExistsError:
        pass
if mode == "always-fail" and env["RANK"] == "1":
    from rallypoint.agent import record

    wait_for_round()
    @record
    def main():
        raise ValueError("bad batch in rank 1")

    main()
if mode == "crash-once" and after_crash:
    sys.exit(0)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    if os.path.exists(os.path.join(out_dir, "finish")):
        sys.exit(0)
    time.sleep(0.02)
sys.exit(7)
"""


class Procs:
    """Starts agents for one test and knows how to find and kill all of them."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.mark = uuid.uuid4().hex
        self.agents: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.killed: set[int] = set()
        self.worker = tmp_path / "worker.py"
        self.worker.write_text(WORKER)

    def start(self, *args: str, name: str = "agent", env: dict[str, str] | None = None) -> int:
        log = self.dir / f"{name}.log"
        full_env = dict(os.environ, **(env or {}))
        full_env[MARK_ENV] = self.mark
        with open(log, "wb") as fp:
            popen = subprocess.Popen(
                [sys.executable, "-m", "rallypoint.run", *args],
                stdout=fp,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=self.dir,
                start_new_session=True,
            )
        self.agents.append((popen, log))
        return len(self.agents) - 1

    def popen(self, index: int) -> subprocess.Popen[bytes]:
        return self.agents[index][0]

    def log(self, index: int) -> str:
        return self.agents[index][1].read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(
            f"----- agent {i} (rc={p.poll()}) -----\n{self.log(i)}"
            for i, (p, _) in enumerate(self.agents)
        )

    def wait(self, index: int, timeout: float = WAIT) -> int:
        try:
            return self.popen(index).wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"agent {index} did not exit in {timeout} s\n{self.logs()}")

    def records(self) -> list[dict[str, Any]]:
        path = self.dir / "records.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_records(
        self,
        predicate: Callable[[list[dict[str, Any]]], bool],
        what: str,
        timeout: float = WAIT,
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = self.records()
            if predicate(records):
                return records
            for i, (p, _) in enumerate(self.agents):
                if p.poll() is not None and p.returncode != 0 and i not in self.killed:
                    pytest.fail(
                        f"agent {i} exited {p.returncode} while waiting for {what}\n{self.logs()}"
                    )
            time.sleep(0.05)
        pytest.fail(
            f"timed out after {timeout:g} s waiting for {what}; "
            f"records: {self.records()}\n{self.logs()}"
        )

    def finish(self) -> None:
        (self.dir / "finish").touch()

    def marked(self) -> list[psutil.Process]:
        return marked_processes(MARK_ENV, self.mark)

    def kill_all(self) -> None:
        for popen, _ in self.agents:
            kill_tree(popen)
        for proc in self.marked():
            with contextlib.suppress(psutil.Error):
                proc.kill()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        clean_exit = all(popen.poll() is not None for popen, _ in p.agents)
        p.kill_all()
        # Give the kernel a moment to deliver parent-death signals before checking.
        deadline = time.monotonic() + 10
        left = p.marked()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [proc for proc in left if proc.is_running() and proc.status() != "zombie"]
        assert not left, f"processes survived the test: {left}"
        if clean_exit:
            assert not p.marked()


def _rounds(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_round.setdefault(int(r["RALLYPOINT_ROUND"]), []).append(r)
    return by_round


def _full_round(records: list[dict[str, Any]], nodes: int, per_node: int) -> list[dict[str, Any]]:
    """Records of the latest round with ``nodes`` agents, if all its workers started."""
    for _, recs in sorted(_rounds(records).items(), reverse=True):
        if int(recs[0]["GROUP_WORLD_SIZE"]) == nodes and len(recs) == nodes * per_node:
            return recs
    return []


def _c10d_args(port: int, run_id: str, nnodes: str, nproc: int, *extra: str) -> list[str]:
    return [
        "--nnodes", nnodes,
        "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", run_id,
        "--local-addr", "127.0.0.1",
        "--monitor-interval", "0.05",
        "--stop-grace", "2",
        *extra,
    ]  # fmt: skip


def _check_ranks(recs: list[dict[str, Any]], nodes: int, per_node: int) -> None:
    world = nodes * per_node
    assert sorted(int(r["RANK"]) for r in recs) == list(range(world))
    assert {r["WORLD_SIZE"] for r in recs} == {str(world)}
    assert {r["ROLE_WORLD_SIZE"] for r in recs} == {str(world)}
    assert {r["LOCAL_WORLD_SIZE"] for r in recs} == {str(per_node)}
    assert sorted(int(r["GROUP_RANK"]) for r in recs) == sorted(
        g for g in range(nodes) for _ in range(per_node)
    )
    for r in recs:
        assert int(r["RANK"]) == int(r["GROUP_RANK"]) * per_node + int(r["LOCAL_RANK"])
        assert r["ROLE_RANK"] == r["RANK"]
    # One master per round, agreed by every worker.
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in recs}) == 1


@pytest.mark.parametrize("backend", ["c10d", "torch-c10d"])
def test_two_agents_c10d_worker_crash_is_restarted(
    procs: Procs, free_port: Callable[[], int], backend: str
) -> None:
    """2 agents x 2 workers over c10d; rank 1 crashes once; the job restarts and finishes.

    With torch's handler (``torch-c10d``) the agents agree on the round through the store.
    """
    port = free_port()
    args = _c10d_args(port, "crash", "2", 2, "--max-restarts", "1")
    args[args.index("c10d")] = backend
    conf = FAST_CONF if backend == "c10d" else "join_timeout=60"
    cmd = [str(procs.worker), str(procs.dir), "crash-once"]
    procs.start(*args, "--rdzv-conf", conf + ",is_host=true", *cmd, name="a")
    procs.start(*args, "--rdzv-conf", conf + ",is_host=false", *cmd, name="b")
    assert procs.wait(0) == 0, procs.logs()
    assert procs.wait(1) == 0, procs.logs()
    assert "exit barrier:" not in procs.logs()
    rounds = _rounds(procs.records())
    first, last = min(rounds), max(rounds)
    assert last > first, rounds
    _check_ranks(rounds[first], 2, 2)
    _check_ranks(rounds[last], 2, 2)
    r = rounds[last][0]
    assert r["TORCHELASTIC_RUN_ID"] == "crash"
    assert r["TORCHELASTIC_MAX_RESTARTS"] == "1"
    # rallypoint's rendezvous: a fresh store per round, hosted by rank 0's first
    # worker; torch's: the rank-0 agent's shared store, as under torchrun.
    assert r["TORCHELASTIC_USE_AGENT_STORE"] == str(backend == "torch-c10d")
    assert r["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert r["ROLE_NAME"] == "default"
    assert r["TORCHELASTIC_ERROR_FILE"].endswith("error.json")
    # The agent whose worker crashed spent a restart; the other did not.
    assert sorted(r["TORCHELASTIC_RESTART_COUNT"] for r in rounds[last]) == ["0", "0", "1", "1"]
    assert "restarting, 0 of 1 restarts left" in procs.logs()


def test_scale_up_then_dead_peer_regroups(procs: Procs, free_port: Callable[[], int]) -> None:
    """A late agent joins a running job; a SIGKILLed agent's peers regroup without it;
    a SIGTERMed agent leaves and the last one carries on."""
    port = free_port()
    args = _c10d_args(port, "elastic", "1:3", 1, "--max-restarts", "0")
    cmd = [str(procs.worker), str(procs.dir), "wait"]
    procs.start(*args, "--rdzv-conf", FAST_CONF + ",is_host=true", *cmd, name="a")
    procs.start(*args, "--rdzv-conf", FAST_CONF + ",is_host=false", *cmd, name="b")
    procs.wait_records(lambda rs: bool(_full_round(rs, 2, 1)), "a round of 2 agents")

    procs.start(*args, "--rdzv-conf", FAST_CONF + ",is_host=false", *cmd, name="c")
    three = procs.wait_records(lambda rs: bool(_full_round(rs, 3, 1)), "a round of 3 agents")
    three_round = _full_round(three, 3, 1)
    _check_ranks(three_round, 3, 1)
    round3 = int(three_round[0]["RALLYPOINT_ROUND"])

    b_pid = procs.popen(1).pid
    b_worker = next(int(r["pid"]) for r in three_round if int(r["agent_pid"]) == b_pid)
    procs.killed.add(1)
    os.kill(b_pid, signal.SIGKILL)
    procs.popen(1).wait()

    def regrouped(rs: list[dict[str, Any]]) -> bool:
        recs = _full_round(rs, 2, 1)
        return bool(recs) and int(recs[0]["RALLYPOINT_ROUND"]) > round3

    two = _full_round(procs.wait_records(regrouped, "a round without the killed agent"), 2, 1)
    _check_ranks(two, 2, 1)
    assert b_pid not in {int(r["agent_pid"]) for r in two}
    # The killed agent's worker died with it (parent-death signal), no orphan.
    assert not psutil.pid_exists(b_worker) or psutil.Process(b_worker).status() == "zombie"
    # Membership changes never spend the restart budget (max-restarts is 0).
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in two} == {"0"}
    round2 = int(two[0]["RALLYPOINT_ROUND"])

    # SIGTERM takes a node out without closing the job: the last agent goes on alone.
    procs.killed.add(2)
    procs.popen(2).send_signal(signal.SIGTERM)
    assert procs.wait(2) == 128 + signal.SIGTERM

    def alone(rs: list[dict[str, Any]]) -> bool:
        recs = _full_round(rs, 1, 1)
        return bool(recs) and int(recs[0]["RALLYPOINT_ROUND"]) > round2

    procs.wait_records(alone, "a round of the last agent alone")
    procs.finish()
    assert procs.wait(0) == 0, procs.logs()


# A liveness window (30 s x 3 = 90 s) no test waits out: any regroup seen within
# LEAVE_WAIT comes from the leaving node's own exit from the shared state.
SLOW_LIVENESS_CONF = "keep_alive_interval=30,keep_alive_max_attempt=3,last_call_timeout=0.3"
LEAVE_WAIT = 20.0


def test_sigterm_agent_leaves_and_peers_regroup_at_once(
    procs: Procs, free_port: Callable[[], int]
) -> None:
    """3 agents (--nnodes 2:3) with a 90 s liveness window; SIGTERM one: it exits
    128+15 after leaving the rendezvous, and the two survivors run a new round well
    within the window (heartbeat-based detection cannot fire in LEAVE_WAIT)."""
    port = free_port()
    args = _c10d_args(port, "leave", "2:3", 1, "--max-restarts", "0")
    cmd = [str(procs.worker), str(procs.dir), "wait"]
    for name, host in (("a", "true"), ("b", "false"), ("c", "false")):
        procs.start(*args, "--rdzv-conf", f"{SLOW_LIVENESS_CONF},is_host={host}", *cmd, name=name)
    three = _full_round(
        procs.wait_records(lambda rs: bool(_full_round(rs, 3, 1)), "a round of 3 agents"), 3, 1
    )
    _check_ranks(three, 3, 1)
    round3 = int(three[0]["RALLYPOINT_ROUND"])

    c_pid = procs.popen(2).pid
    c_worker = next(int(r["pid"]) for r in three if int(r["agent_pid"]) == c_pid)
    procs.killed.add(2)
    procs.popen(2).send_signal(signal.SIGTERM)
    assert procs.wait(2, timeout=LEAVE_WAIT) == 128 + signal.SIGTERM, procs.logs()
    # The leaving agent stopped its worker with SIGTERM before it left.
    assert (procs.dir / f"terminated.{c_worker}").exists()

    def regrouped(rs: list[dict[str, Any]]) -> bool:
        recs = _full_round(rs, 2, 1)
        return bool(recs) and int(recs[0]["RALLYPOINT_ROUND"]) > round3

    two = _full_round(
        procs.wait_records(regrouped, "the survivors' new round", timeout=LEAVE_WAIT), 2, 1
    )
    _check_ranks(two, 2, 1)
    assert c_pid not in {int(r["agent_pid"]) for r in two}
    # A peer leaving never spends the restart budget (max-restarts is 0).
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in two} == {"0"}
    # The survivors saw the leaver gone from their round (not a waiting node).
    for survivor in (0, 1):
        assert "left the round or stopped heartbeating" in procs.log(survivor), procs.logs()

    procs.finish()
    assert procs.wait(0) == 0, procs.logs()
    assert procs.wait(1) == 0, procs.logs()


def test_max_restarts_exhausted_prints_failure_table(procs: Procs) -> None:
    """A worker that always fails: non-zero exit after the budget, with the root cause."""
    procs.start(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "--monitor-interval", "0.05", "--stop-grace", "2",
        str(procs.worker), str(procs.dir), "always-fail",
    )  # fmt: skip
    assert procs.wait(0) == 1
    log = procs.log(0)
    assert "FAILED" in log and "root cause" in log
    assert "ValueError: bad batch in rank 1" in log
    assert "Traceback" in log
    assert "max restarts (1) exhausted" in log
    rounds = _rounds(procs.records())
    assert len(rounds) == 2, rounds
    # The surviving rank 0 workers were stopped with SIGTERM at each restart.
    assert len(list(procs.dir.glob("terminated.*"))) == 2


def test_sigterm_stops_workers_and_agent(procs: Procs) -> None:
    """SIGTERM to the agent: workers get SIGTERM, the agent exits 128+15, nothing survives."""
    procs.start(
        "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05",
        "--stop-grace", "5", "-t", "3", "--log-dir", str(procs.dir / "logs"),
        "--local-ranks-filter", "0",
        str(procs.worker), str(procs.dir), "wait",
    )  # fmt: skip
    recs = procs.wait_records(lambda rs: len(rs) == 2, "both workers started")
    procs.popen(0).send_signal(signal.SIGTERM)
    assert procs.wait(0) == 128 + signal.SIGTERM
    terminated = {int(p.name.split(".")[1]) for p in procs.dir.glob("terminated.*")}
    assert terminated == {int(r["pid"]) for r in recs}
    assert procs.marked() == []
    # Tee: prefixed lines on the console for the filtered ranks, files for all.
    log = procs.log(0)
    assert "[default0]:hello from rank 0" in log
    assert "hello from rank 1" not in log
    logs = sorted((procs.dir / "logs").glob("*/attempt_0/*/stdout.log"))
    assert [p.read_text() for p in logs] == ["hello from rank 0\n", "hello from rank 1\n"]
    assert {r["OMP_NUM_THREADS"] for r in recs} == {os.environ.get("OMP_NUM_THREADS", "1")}


def test_two_agents_etcd(procs: Procs, etcd_server: Any) -> None:
    """2 agents x 2 workers over a real etcd."""
    args = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
        "--rdzv-endpoint", etcd_server.endpoint.removeprefix("http://"),
        "--rdzv-id", f"etcd-{procs.mark}", "--local-addr", "127.0.0.1",
        "--monitor-interval", "0.05", "--rdzv-conf", FAST_CONF,
        str(procs.worker), str(procs.dir), "quick",
    ]  # fmt: skip
    procs.start(*args, name="a")
    procs.start(*args, name="b")
    assert procs.wait(0) == 0, procs.logs()
    assert procs.wait(1) == 0, procs.logs()
    assert "exit barrier:" not in procs.logs()
    rounds = _rounds(procs.records())
    assert len(rounds) == 1
    _check_ranks(next(iter(rounds.values())), 2, 2)


def test_demo_training_resumes_from_checkpoint(procs: Procs) -> None:
    """The README's main job, with one injected crash: it restarts, resumes, and prints a loss."""
    ckpt = procs.dir / "ckpt"
    procs.start(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        str(REPO / "examples" / "train.py"), "--steps", "30", "--checkpoint-every", "10",
        "--crash-at-step", "15", "--checkpoint-dir", str(ckpt),
    )  # fmt: skip
    assert procs.wait(0, timeout=240) == 0, procs.logs()
    log = procs.log(0)
    assert "starting at step 0" in log
    assert "starting at step 10" in log
    assert "final loss:" in log
    assert json.loads((ckpt / "checkpoint.json").read_text())["step"] == 30
