"""Real processes: SIGKILL mid-rendezvous over c10d, and torchrun with the plugin.

Every process a test starts is killed in a finalizer, even when the test fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from helpers.waiting import eventually
from torch.distributed import TCPStore

from rallypoint.adapters.c10d import C10dBackend
from rallypoint.core import decode_state

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

NODE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from rallypoint.adapters import create_handler

    endpoint, run_id, min_nodes, max_nodes = sys.argv[1:5]
    params = RendezvousParameters(
        "rallypoint-c10d", endpoint, run_id, int(min_nodes), int(max_nodes),
        local_addr="127.0.0.1", is_host="false", keep_alive_interval="0.2",
        keep_alive_max_attempt="2", last_call_timeout="0.5", join_timeout="60",
        read_timeout="30",
    )
    handler = create_handler(params)
    info = handler.next_rendezvous()
    print(json.dumps({
        "pid": handler.node.pid, "rank": info.rank, "world": info.world_size,
        "round": handler.round,
        "participants": sorted(n.pid for n in handler.sync.state.participants),
    }), flush=True)
    sys.stdin.read()  # keep beating until the test is done with us
    handler.close()
    """
)


class Node:
    """One node process; its result line is collected by a reader thread."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", NODE_SCRIPT, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.result: dict[str, object] | None = None
        self.done = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.result = json.loads(line)
                self.done.set()
        self.done.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def spawn() -> Iterator[Callable[[list[str]], Node]]:
    nodes: list[Node] = []

    def start(args: list[str]) -> Node:
        node = Node(args)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.stop()


def _eventually(condition: Callable[[], bool], timeout: float = 60.0) -> bool:
    return eventually(condition, timeout, pause=0.05)


def test_sigkilled_node_is_dropped_and_the_rest_complete(
    spawn: Callable[[list[str]], Node],
) -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
    endpoint = f"127.0.0.1:{server.port}"
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    observer = C10dBackend(client, "kill", endpoint=endpoint)

    def participants() -> set[int]:
        current = observer.get_state()
        if current is None:
            return set()
        return {n.pid for n in decode_state(current[0]).participants}

    args = [endpoint, "kill", "4", "4"]
    first = [spawn(args) for _ in range(3)]
    pids = {n.proc.pid for n in first}
    assert _eventually(lambda: participants() == pids), participants()

    victim = first[2]
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=30)
    # The survivors declare it dead after the liveness window (0.2 s x 2) and
    # publish its removal; then two fresh nodes fill the round.
    assert _eventually(lambda: participants() == pids - {victim.proc.pid}), participants()
    late = [spawn(args) for _ in range(2)]
    finishers = [*first[:2], *late]
    for node in finishers:
        assert node.done.wait(timeout=90), "a node did not finish the rendezvous"
    results = [node.result for node in finishers]
    assert all(r is not None for r in results)
    expected = sorted(n.proc.pid for n in finishers)
    assert all(r["participants"] == expected for r in results)  # type: ignore[index]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]  # type: ignore[index]
    assert {r["world"] for r in results} == {4}  # type: ignore[index]
    assert len({r["round"] for r in results}) == 1  # type: ignore[index]


WORKER_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    world = dist.get_world_size()
    expected = world * (world + 1) / 2
    assert value.item() == expected, (value.item(), expected)
    print(f"ALLREDUCE rank={dist.get_rank()} world={world} sum={value.item():g}", flush=True)
    dist.destroy_process_group()
    """
)


def test_torchrun_runs_a_gloo_allreduce_with_the_plugin(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(WORKER_SCRIPT)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}

    def torchrun(is_host: bool) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=2",
                "--rdzv-backend=rallypoint-c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=torchrun-test",
                f"--rdzv-conf=is_host={'true' if is_host else 'false'}",
                "--local-addr=127.0.0.1",
                "--max-restarts=0",
                "--monitor-interval=0.1",
                str(script),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )

    procs = [torchrun(True), torchrun(False)]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    # Two workers of one torchrun share its stdout, so one worker's report can land on
    # the same line as another's: match reports, not lines.
    report = re.compile(r"ALLREDUCE rank=(\d+) world=(\d+) sum=([0-9.]+)")
    reports = [m.groups() for out in outputs for m in report.finditer(out)]
    assert len(reports) == 4, outputs
    assert all((world, total) == ("4", "10") for _rank, world, total in reports)
    assert sorted(int(rank) for rank, _world, _total in reports) == [0, 1, 2, 3]
