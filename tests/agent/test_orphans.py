"""Nothing a job started outlives it: a worker's helper in a session of its own and a
double-forked daemon are stopped with the job, whether the agent stops on SIGINT or
SIGTERM (it stops them itself, and collects them as their child subreaper) or is
SIGKILLed (its watchdog stops them).

Real ``rallypoint run`` agents on 127.0.0.1 (the ``cluster`` fixture kills every
process a test started, even after a failed assertion). The helper ignores SIGINT,
SIGTERM and SIGHUP, so only the agent's SIGKILL ends it; the daemon obeys SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.cluster import Cluster

from rallypoint.agent import _reaper

WAIT = 90.0

# argv: PIDFILE [obeys-sigterm]. Ignores the stop signals (but SIGTERM if told),
# records its pid, runs until killed.
HELPER = """
import os, signal, sys, time
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    if not (sig == signal.SIGTERM and sys.argv[2:] == ["obeys-sigterm"]):
        signal.signal(sig, signal.SIG_IGN)
with open(sys.argv[1] + ".tmp", "w") as fp:
    fp.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(0.1)
"""

# argv: OUT [fail-first]. Starts a helper in its own session that ignores the stop
# signals and a double-forked daemon that obeys SIGTERM, writes OUT/started.<restart
# count> with the three pids, then runs until stopped; with fail-first, the first
# attempt's worker then exits 3.
WORKER = """
import json, os, subprocess, sys, time

out = sys.argv[1]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
helper = sys.argv[0].replace("worker.py", "helper.py")


def pidfile(name):
    return os.path.join(out, f"{name}.{attempt}")


subprocess.Popen([sys.executable, helper, pidfile("helper")], start_new_session=True)
child = os.fork()
if child == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, helper, pidfile("daemon"), "obeys-sigterm"])
    os._exit(0)
os.waitpid(child, 0)
deadline = time.monotonic() + 60
while not all(os.path.exists(pidfile(n)) for n in ("helper", "daemon")):
    if time.monotonic() > deadline:
        sys.exit(9)
    time.sleep(0.01)
pids = {n: int(open(pidfile(n)).read()) for n in ("helper", "daemon")}
pids["worker"] = os.getpid()
with open(pidfile("started") + ".tmp", "w") as fp:
    json.dump(pids, fp)
os.replace(pidfile("started") + ".tmp", pidfile("started"))
if sys.argv[2:] == ["fail-first"] and attempt == "0":
    sys.exit(3)
while True:
    time.sleep(0.1)
"""


def _scripts(out: Path) -> str:
    (out / "helper.py").write_text(HELPER)
    (out / "worker.py").write_text(WORKER)
    return str(out / "worker.py")


def _started(out: Path, attempt: int) -> dict[str, psutil.Process | None]:
    """The attempt's worker, helper and daemon, once the worker has reported them
    (None: gone and reaped before it was looked up, as a worker that fails at once)."""
    path = out / f"started.{attempt}"
    if not path.exists():
        return {}
    procs: dict[str, psutil.Process | None] = {}
    for name, pid in json.loads(path.read_text()).items():
        try:
            procs[name] = psutil.Process(pid)
        except psutil.NoSuchProcess:
            procs[name] = None
    return procs


def _running(procs: dict[str, psutil.Process | None]) -> list[str]:
    """Those of ``procs`` still running (a zombie is dead; a recycled pid is not it)."""
    alive = []
    for name, proc in procs.items():
        if proc is None:
            continue
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(name)
        except psutil.Error:
            continue
    return alive


def _agent_args(worker: str, out: Path, *extra: str) -> list[str]:
    return [
        "--standalone", "--nproc-per-node", "1", "--monitor-interval", "0.05",
        "--stop-grace", "1", *extra, worker, str(out),
    ]  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize(
    "stop", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda sig: sig.name
)
def test_a_workers_helper_and_daemon_do_not_outlive_the_agent(
    cluster: Cluster, stop: signal.Signals
) -> None:
    worker = _scripts(cluster.dir)
    agent = cluster.start(_agent_args(worker, cluster.dir), "a")
    procs = cluster.wait_for(lambda: _started(cluster.dir, 0), "the helper and daemon", WAIT)
    daemon, helper, worker_proc = procs["daemon"], procs["helper"], procs["worker"]
    assert daemon is not None and helper is not None and worker_proc is not None
    # The daemon's parent exited at once: it came back to the agent, not to init.
    assert daemon.ppid() == agent.pid
    assert helper.ppid() == worker_proc.pid
    if stop == signal.SIGKILL:
        cluster.kill("a", machine=False)  # the agent alone: its watchdog's job
        deadline = time.monotonic() + 10
        while _running(procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _running(procs) == [], cluster.logs()
    else:
        cluster.stop("a", stop)
        assert cluster.wait("a", WAIT) == 128 + stop, cluster.logs()
        # The agent stopped them before it exited.
        assert _running(procs) == [], cluster.logs()
    assert cluster.leftovers() == []


@pytest.mark.integration
def test_the_agent_stops_and_collects_a_failed_workers_helpers_before_restarting(
    cluster: Cluster,
) -> None:
    """The first attempt's worker exits 3, leaving its helper and daemon behind as
    the agent's children: they are stopped (the daemon by SIGTERM, the helper by
    SIGKILL) and reaped before the second attempt starts, so the agent holds no
    zombie while the job runs on."""
    worker = _scripts(cluster.dir)
    agent = cluster.start(
        [*_agent_args(worker, cluster.dir, "--max-restarts", "1"), "fail-first"], "a"
    )
    first = cluster.wait_for(lambda: _started(cluster.dir, 0), "the first attempt", WAIT)
    second = cluster.wait_for(lambda: _started(cluster.dir, 1), "the second attempt", WAIT)
    assert _running(first) == []
    assert _running(second) == ["helper", "daemon", "worker"]
    children = psutil.Process(agent.pid).children()
    zombies = [c.pid for c in children if c.status() == psutil.STATUS_ZOMBIE]
    assert zombies == [], cluster.logs()
    cluster.stop("a", signal.SIGTERM)
    assert cluster.wait("a", WAIT) == 128 + signal.SIGTERM, cluster.logs()
    assert _running(second) == []
    assert cluster.leftovers() == []


@pytest.mark.integration
@pytest.mark.skipif(sys.platform != "linux", reason="tokens are read from /proc")
def test_a_sweep_signals_token_carriers_only(tmp_path: Path) -> None:
    token = _reaper.new_token()
    loop = "import time\nwhile True: time.sleep(0.1)\n"
    marked = subprocess.Popen(
        [sys.executable, "-c", loop], env={**os.environ, _reaper.TOKEN_ENV: token}
    )
    other = subprocess.Popen(
        [sys.executable, "-c", loop], env={**os.environ, _reaper.TOKEN_ENV: _reaper.new_token()}
    )
    try:
        deadline = time.monotonic() + 30
        while _reaper.token_of(marked.pid) != token and time.monotonic() < deadline:
            time.sleep(0.01)  # until it has exec'd
        assert not _reaper.signal_carrier(other.pid, {token}, signal.SIGKILL)
        assert _reaper.signal_carrier(marked.pid, {token}, 0)  # 0: only checks
        # The same checks without a pidfd (kernels before 5.3), by start time.
        assert not _reaper._signal_carrier_by_start(other.pid, {token}, signal.SIGKILL)
        assert _reaper._signal_carrier_by_start(marked.pid, {token}, 0)
        killed = _reaper.sweep({token})
        assert [pid for pid, _ in killed] == [marked.pid]
        # Dead, not yet reaped: a zombie carries no token and is not signalled again.
        deadline = time.monotonic() + 30
        while not _is_zombie(marked.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _reaper.sweep({token}) == set()
        assert marked.wait(timeout=30) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for proc in (marked, other):
            proc.kill()
            proc.wait()


def _is_zombie(pid: int) -> bool:
    stat = _reaper.proc_stat(pid)
    return stat is not None and stat.zombie
