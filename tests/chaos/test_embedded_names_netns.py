"""Embedded etcd members named by host name, each on an address of its own.

Every node is a network namespace (``helpers.netns``) with its own address; the
nodes know each other only by host names (``node0``, ``node1``, ``node2``: a
hosts file the namespaces share, as a headless service's names or a Slurm node
list). Every member listens on the same port of its own host, and each agent
finds its member from ``local_addr`` alone (no ``member`` option), as on real
nodes. Scenario: the three members bootstrap and three nodes rendezvous; then
``node0`` is SIGKILLed and comes back under the same name at a *new* address (a
rescheduled pod): its member rejoins the running cluster by reconfiguration,
and the cluster is whole again, served by the new address.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers.netns import Topology, unavailable

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

PORT = 23790
NAMES = ("node0", "node1", "node2")
ENDPOINT = ",".join(f"{name}:{PORT}" for name in NAMES)
#: Bounds that only detect hangs.
UP_TIMEOUT = 120.0

# One node's agent side: the embedded backend's handler, one rendezvous, then
# wait until told to go (stdin closes) and close. Each step is a JSON line.
_NODE = textwrap.dedent(
    """
    import json, logging, sys
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from rallypoint.adapters import create_handler
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    name, endpoint, data, nodes, rendezvous = sys.argv[1:6]
    handler = create_handler(RendezvousParameters(
        "etcd-embedded", endpoint, "named", int(nodes), int(nodes), local_addr=name,
        data_dir=data, keep_alive_interval="0.5", keep_alive_max_attempt="6",
        last_call_timeout="0.3", join_timeout="90", read_timeout="20"))
    print(json.dumps({"up": name}), flush=True)
    if rendezvous == "1":
        info = handler.next_rendezvous()
        print(json.dumps({"rank": info.rank, "world": info.world_size}), flush=True)
    sys.stdin.read()
    handler.close()
    """
)

# Ask one member (by name) for the member list and every member for its status.
_CHECK = textwrap.dedent(
    """
    import json, sys
    import pyetcd
    endpoint = sys.argv[1]
    out = {}
    for address in endpoint.split(","):
        host, _, port = address.rpartition(":")
        client = pyetcd.client(host, int(port), timeout=3)
        try:
            client.status()
            out["members"] = sorted(
                [m.name, list(m.peer_urls), list(m.client_urls)] for m in client.members)
            client.put("/named-check", host)
            out.setdefault("answer", []).append(host)
        finally:
            client.close()
    print(json.dumps(out))
    """
)


class Nodes:
    """The node processes of the test, each in its namespace; all stopped at the end."""

    def __init__(self, topo: Topology, tmp: Path) -> None:
        self.topo = topo
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(self, node: str, name: str, nodes: int, rendezvous: bool) -> None:
        data = self.tmp / node
        data.mkdir()
        argv = ["ip", "netns", "exec", self.topo.ns[node], sys.executable, "-c", _NODE,
                name, ENDPOINT, str(data), str(nodes), "1" if rendezvous else "0"]  # fmt: skip
        with open(self.tmp / f"{node}.err", "w") as err:
            self.procs[node] = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
            )

    def read(self, node: str) -> dict[str, object]:
        """The next JSON line of ``node`` (fails with its log when it ends first)."""
        proc = self.procs[node]
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            proc.wait(30)
            raise AssertionError(f"{node} exited {proc.returncode}:\n{self.log(node)}")
        return dict(json.loads(line))

    def log(self, node: str) -> str:
        return (self.tmp / f"{node}.err").read_text(errors="replace")[-4000:]

    def kill(self, node: str) -> None:
        proc = self.procs.pop(node)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def check(self, node: str) -> dict[str, object]:
        done = subprocess.run(
            ["ip", "netns", "exec", self.topo.ns[node], sys.executable, "-c", _CHECK, ENDPOINT],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1:]}
        return dict(json.loads(done.stdout))

    def stop_all(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        # Members whose agent was killed die by themselves; make sure of it.
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if any(str(self.tmp) in arg for arg in proc.cmdline()):
                    proc.kill()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    from rallypoint.adapters.etcd import EtcdServerError, find_etcd_binary

    why = unavailable()
    if why:
        pytest.skip(why)
    try:
        find_etcd_binary()
    except EtcdServerError as exc:
        pytest.skip(str(exc))
    # n0b: where node0 comes back, at another address.
    topo = Topology(["n0", "n1", "n2", "n0b"]).create()
    made = Nodes(topo, tmp_path)
    try:
        yield made
    finally:
        made.stop_all()
        failed = topo.remove()
        assert not failed, failed
        assert not topo.leftover_namespaces()
        assert not any(os.path.exists(d) for d in topo.hosts_dirs)


def _eventually_whole(nodes: Nodes, at: str, expect: list[str]) -> dict[str, object]:
    deadline = time.monotonic() + UP_TIMEOUT
    while True:
        seen = nodes.check(at)
        members = seen.get("members")
        named = isinstance(members, list) and sorted(m[0] for m in members) == expect
        if named and seen.get("answer") == list(NAMES):
            return seen
        if time.monotonic() >= deadline:
            raise AssertionError(f"the cluster is not whole: {seen}")
        time.sleep(0.5)


def test_members_named_by_host_name_on_distinct_addresses_and_a_replacement_at_a_new_one(
    nodes: Nodes,
) -> None:
    topo = nodes.topo
    topo.set_hosts({"node0": "n0", "node1": "n1", "node2": "n2"})
    for node, name in zip(("n0", "n1", "n2"), NAMES, strict=True):
        nodes.start(node, name, 3, rendezvous=True)
    for node, name in zip(("n0", "n1", "n2"), NAMES, strict=True):
        assert nodes.read(node) == {"up": name}, nodes.log(node)
    ranks = sorted(int(str(nodes.read(node)["rank"])) for node in ("n0", "n1", "n2"))
    assert ranks == [0, 1, 2]
    expect = sorted(f"{name}-{PORT}" for name in NAMES)
    before = _eventually_whole(nodes, "n1", expect)
    assert [f"http://node0:{PORT}"] in [m[2] for m in before["members"]]  # type: ignore[union-attr]

    # node0 is lost and comes back under its name at another address.
    nodes.kill("n0")
    topo.set_hosts({"node0": "n0b", "node1": "n1", "node2": "n2"})
    nodes.start("n0b", "node0", 3, rendezvous=False)
    assert nodes.read("n0b") == {"up": "node0"}, nodes.log("n0b")
    assert "joined the running cluster" in nodes.log("n0b")
    after = _eventually_whole(nodes, "n2", expect)
    assert after["answer"] == list(NAMES)
    # The old node0's address answers nothing: the name is served from the new one.
    assert topo.addr["n0b"] != topo.addr["n0"]
