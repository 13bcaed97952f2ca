"""Nodes in network namespaces that the test creates, joined by a bridge, so that
one node can be cut off (a network partition) while its processes run on.

Layout, every name unique to the test run (``rp<hex>-...``): a *switch* namespace
holding bridge ``br0``, and one namespace per node holding ``eth0`` with the
node's address in ``10.<a>.<b>.0/24``; a veth pair links each node's ``eth0`` to
port ``p-<node>`` on the bridge. Every address lives inside these namespaces only;
the host's own network is not touched. :meth:`Topology.partition` takes a node's
port off the bridge (packets to and from it are silently dropped, as on a cut
link: no reset, no error), :meth:`Topology.heal` puts it back, and
:meth:`Topology.remove` deletes every namespace (and with them the links).

Names: :meth:`Topology.set_hosts` writes ``/etc/netns/<namespace>/hosts``, which
``ip netns exec`` mounts over ``/etc/hosts`` for the processes it starts, so the
nodes reach each other by host name without the host's own ``/etc/hosts`` being
touched. Rewriting it (in place: the mount holds the file, not its name) moves a
name to another node, as DNS does for a rescheduled pod.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence


def unavailable() -> str:
    """Why namespaces cannot be used here ('' if they can)."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run the chaos suite as root)"
    probe = f"rp{uuid.uuid4().hex[:8]}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"the kernel refused a network namespace: {made.stderr.strip()}"
    try:
        veth = subprocess.run(
            ["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
            capture_output=True,
            text=True,
        )
        if veth.returncode != 0:
            return f"the kernel refused a veth pair: {veth.stderr.strip()}"
        bridge = subprocess.run(
            ["ip", "-n", probe, "link", "add", "b0", "type", "bridge"],
            capture_output=True,
            text=True,
        )
        if bridge.returncode != 0:
            return f"the kernel refused a bridge: {bridge.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Topology:
    """See the module docstring. Create with :meth:`create`; always :meth:`remove`."""

    def __init__(self, nodes: Sequence[str]) -> None:
        tag = uuid.uuid4().hex
        self.prefix = f"rp{tag[:8]}"
        self.switch = f"{self.prefix}-sw"
        self.ns = {node: f"{self.prefix}-{node}" for node in nodes}
        subnet = f"10.{int(tag[8:10], 16) % 200 + 20}.{int(tag[10:12], 16)}"
        self.addr = {node: f"{subnet}.{i + 1}" for i, node in enumerate(nodes)}
        self.created: list[str] = []
        self.hosts_dirs: list[str] = []

    def create(self) -> Topology:
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for node, ns in self.ns.items():
            self._add_ns(ns)
            port = f"p-{node}"
            _ip("link", "add", "eth0", "netns", ns, "type", "veth",
                "peer", "name", port, "netns", self.switch)  # fmt: skip
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[node]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)

    def partition(self, node: str) -> None:
        """Cut ``node`` off: its port leaves the bridge, traffic is dropped silently."""
        _ip("-n", self.switch, "link", "set", f"p-{node}", "nomaster")

    def heal(self, node: str) -> None:
        _ip("-n", self.switch, "link", "set", f"p-{node}", "master", "br0")

    def set_hosts(self, names: dict[str, str]) -> None:
        """Give every node the same ``/etc/hosts``: ``localhost``, and each host
        name of ``names`` at the address of the node it maps to. Processes that
        ``ip netns exec`` starts afterwards see it; rewriting it reaches the ones
        already running too."""
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{self.addr[node]} {name}" for name, node in names.items()]
        text = "\n".join(lines) + "\n"
        for ns in self.ns.values():
            directory = f"/etc/netns/{ns}"
            if directory not in self.hosts_dirs:
                os.makedirs(directory, exist_ok=True)
                self.hosts_dirs.append(directory)
            with open(f"{directory}/hosts", "w") as hosts:  # the same inode
                hosts.write(text)

    def remove(self) -> list[str]:
        """Delete every namespace this topology made (and its hosts file); returns
        those that failed."""
        for directory in self.hosts_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        if self.hosts_dirs:
            with contextlib.suppress(OSError):  # another test's may still be there
                os.rmdir("/etc/netns")
        self.hosts_dirs = []
        failed = []
        for name in reversed(self.created):
            done = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
            if done.returncode != 0:
                failed.append(f"{name}: {done.stderr.strip()}")
        self.created = []
        return failed

    def leftover_namespaces(self) -> list[str]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in listed.splitlines() if line.startswith(self.prefix)]
