"""Real ``rallypoint run`` agents for one test, and every process they start.

Each agent is ``python -m rallypoint.run`` (optionally inside a network namespace,
``ip netns exec``), logging to its own file. Every agent carries a unique
environment mark, which its workers and their children inherit, so the test can
find every process the job started, wherever it was reparented, and assert that
none is left. :meth:`Cluster.stop_all` (run by the fixtures' finalizers) kills
whatever is still running, even after a failed assertion.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from rallypoint.agent import workers

MARK_ENV = "RALLYPOINT_CHAOS_MARK"
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def c10d_agent_args(port: int, run_id: str, nnodes: str, *extra: str) -> list[str]:
    """``rallypoint run`` flags for an agent of a c10d job on 127.0.0.1 with one
    worker, a fast monitor and a short stop grace."""
    return [
        "--nnodes", nnodes, "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", run_id, "--local-addr", "127.0.0.1",
        "--monitor-interval", "0.05", "--stop-grace", "2", *extra,
    ]  # fmt: skip


def run_ranks(tmp_path: Path, source: str, count: int, *args: str) -> list[str]:
    """Run the Python ``source`` as ranks 0..count-1 (argv: ``RANK PORT *args``; rank 0
    hosts a store on PORT), each of which must exit 0: their outputs, by rank."""
    script = tmp_path / "ranks.py"
    script.write_text(source)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(count)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), outputs
    return outputs


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (a line being written is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def kill_tree(popen: subprocess.Popen[Any]) -> None:
    """SIGKILL a launched process, its process group and every descendant it has
    now (those that left the group too), then reap it."""
    workers.kill_tree(popen.pid)
    popen.wait()


def marked_processes(variable: str, mark: str) -> list[psutil.Process]:
    """Every live process whose environment has ``variable=mark`` (zombies excluded):
    what a test started, wherever it was reparented."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(variable) == mark:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@dataclass
class Agent:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    netns: str | None = None
    killed_at: float | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Cluster:
    """The agents of one test (see the module docstring)."""

    dir: Path
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)
    agents: dict[str, Agent] = field(default_factory=dict)

    def start(
        self,
        args: Sequence[str],
        name: str,
        *,
        env: dict[str, str] | None = None,
        netns: str | None = None,
    ) -> Agent:
        log_path = self.dir / f"{name}.log"
        full_env = dict(os.environ, **(env or {}))
        full_env[MARK_ENV] = self.mark
        prefix = ["ip", "netns", "exec", netns] if netns else []
        launcher = [sys.executable, "-m", "rallypoint.run", "--log-dir", str(self.dir / "logs")]
        with open(log_path, "ab") as fp:
            popen = subprocess.Popen(
                [*prefix, *launcher, *args],
                stdout=fp,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=self.dir,
                start_new_session=True,
            )
        agent = Agent(name, popen, log_path, netns)
        self.agents[name] = agent
        return agent

    def logs(self) -> str:
        return "\n".join(
            f"----- {a.name} (rc={a.popen.poll()}) -----\n{a.log()}" for a in self.agents.values()
        )

    def wait(self, name: str, timeout: float) -> int:
        """The exit status of agent ``name``; fails the test after ``timeout`` s."""
        try:
            return self.agents[name].popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {name} still running {timeout:g} s later\n{self.logs()}"
            ) from None

    def wait_for(
        self,
        predicate: Callable[[], Any],
        what: str,
        timeout: float,
        *,
        allowed_exits: Sequence[str] = (),
        poll: float = 0.02,
    ) -> Any:
        """Poll ``predicate`` until it returns something true; fail after ``timeout``
        s, or at once when an agent not in ``allowed_exits`` (or killed) exits."""
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            for agent in self.agents.values():
                code = agent.popen.poll()
                if code is not None and agent.killed_at is None and agent.name not in allowed_exits:
                    raise AssertionError(
                        f"agent {agent.name} exited {code} while waiting for {what}\n{self.logs()}"
                    )
            if time.monotonic() >= deadline:
                raise AssertionError(f"no {what} within {timeout:g} s\n{self.logs()}")
            time.sleep(poll)

    def tree(self, name: str) -> list[psutil.Process]:
        """Agent ``name`` and its descendants now."""
        try:
            root = psutil.Process(self.agents[name].pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def kill(self, name: str, *, machine: bool) -> float:
        """SIGKILL agent ``name`` (``machine``: with every descendant at once, as a
        lost machine); returns the monotonic time of the kill."""
        agent = self.agents[name]
        victims = self.tree(name) if machine else []
        agent.killed_at = time.monotonic()
        os.kill(agent.pid, signal.SIGKILL)
        for proc in victims[1:]:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        agent.popen.wait()
        return agent.killed_at

    def stop(self, name: str, sig: signal.Signals) -> None:
        os.kill(self.agents[name].pid, sig)

    def marked(self) -> list[psutil.Process]:
        """Every live process carrying this test's mark (zombies excluded)."""
        return marked_processes(MARK_ENV, self.mark)

    def leftovers(self, within: float = 10.0) -> list[str]:
        """Processes of this test still alive once every agent has exited and
        ``within`` s have passed (for parent-death signals and watchdogs); empty
        when none is left."""
        deadline = time.monotonic() + within
        while True:
            left = [p for p in self.marked() if p.pid not in self._running_agents()]
            if not left or time.monotonic() >= deadline:
                return [_describe(p) for p in left]
            time.sleep(0.05)

    def _running_agents(self) -> set[int]:
        return {a.pid for a in self.agents.values() if a.popen.poll() is None}

    def stop_all(self) -> None:
        """Kill every agent's tree and every marked process (finalizers)."""
        for name, agent in self.agents.items():
            procs = self.tree(name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(agent.pid, signal.SIGKILL)
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            agent.popen.wait()
        for _ in range(3):
            left = self.marked()
            if not left:
                break
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(left, timeout=5)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:120]}"
    except psutil.Error:
        return str(proc.pid)
