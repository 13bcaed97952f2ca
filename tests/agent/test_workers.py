"""Worker processes: stopping reaches the whole tree, and output is routed per rank."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rallypoint.agent.config import Std
from rallypoint.agent.events import EventRecorder
from rallypoint.agent.handover import LiveWorkers
from rallypoint.agent.workers import WorkerGroup, WorkerLaunch, kill_tree

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

# A worker that ignores SIGTERM and leaves two descendants behind: one in its process
# group that also ignores SIGTERM, one that escaped into a session of its own.
STUBBORN = r"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
kids = [
    subprocess.Popen([sys.executable, "-c", code]),
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                     start_new_session=True),
]
with open(sys.argv[1] + ".tmp", "w") as fp:
    fp.write(" ".join(str(k.pid) for k in kids))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
print("ready", flush=True)
time.sleep(600)
"""


def _launch(tmp_path: Path, code: str, *args: str, **kw: object) -> WorkerLaunch:
    script = tmp_path / "w.py"
    script.write_text(code)
    return WorkerLaunch(
        local_rank=0,
        global_rank=0,
        argv=[sys.executable, str(script), *args],
        env=dict(os.environ),
        log_dir=str(tmp_path / "logs"),
        error_file=str(tmp_path / "logs" / "error.json"),
        **kw,  # type: ignore[arg-type]
    )


def test_stop_kills_the_whole_tree_after_the_grace(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    group = WorkerGroup()
    group.start([_launch(tmp_path, STUBBORN, str(pids_file), redirect=Std.ALL)])
    deadline = time.monotonic() + 60
    while not pids_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    kids = [psutil.Process(int(p)) for p in pids_file.read_text().split()]
    worker = psutil.Process(group.pids[0])
    try:
        assert group.poll() == {0: None}
        group.stop(grace=0.3)
        _, alive = psutil.wait_procs([worker, *kids], timeout=10)
        assert not alive
        assert group.workers == []
        assert (tmp_path / "logs" / "stdout.log").read_text() == "ready\n"
    finally:
        for proc in (worker, *kids):
            if proc.is_running():
                proc.kill()


def test_a_spare_stopped_with_its_group_can_still_be_discarded(tmp_path: Path) -> None:
    """An agent that fences stops its workers and spares at once; the spare the
    next round finds dead is then discarded without an error (it stopped the agent
    with "list.remove(x): x not in list")."""
    group = WorkerGroup()
    spare = group.start_spare(_launch(tmp_path, "import time\ntime.sleep(300)\n"))
    try:
        group.stop(grace=0.0)
        assert spare.poll() is not None and group.spares == []
        group.discard(spare)
        assert group.spares == []
    finally:
        if spare.poll() is None:
            kill_tree(spare.pid)


def test_a_spare_stopped_with_its_group_is_replaced_by_a_new_one(tmp_path: Path) -> None:
    """A group stop (fencing) kills the warm spare with the workers; the next round
    starts a new spare instead of counting the dead one as warm (the next lost worker
    would start cold)."""
    group = WorkerGroup()
    live = LiveWorkers(str(tmp_path / "live"), 10.0, 0.0, EventRecorder(None, "node"))
    plain = _launch(tmp_path, "pass\n")
    template = dataclasses.replace(plain, argv=[sys.executable, "-u", *plain.argv[1:]])
    try:
        live.prepare_spares(group, template)
        (first,) = group.spares
        group.stop(grace=0.0)
        assert first.poll() is not None
        live.prepare_spares(group, template)
        assert len(group.spares) == 1, "no new spare"
        (second,) = group.spares
        assert second.poll() is None and second.pid != first.pid
    finally:
        live.close()
        group.stop(grace=0.0)


# Would clean up on SIGTERM (writes argv[2]), after writing its pid file.
TIDY = r"""
import os, signal, sys, time
def tidy(*_):
    open(sys.argv[2], "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, tidy)
with open(sys.argv[1] + ".tmp", "w") as fp:
    fp.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def _started(tmp_path: Path, code: str, *args: str) -> subprocess.Popen[bytes]:
    script = tmp_path / "tree.py"
    script.write_text(code)
    popen = subprocess.Popen([sys.executable, str(script), *args], start_new_session=True)
    deadline = time.monotonic() + 60
    while not Path(args[0]).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return popen


def test_kill_tree_reaches_escaped_descendants_and_leaves_no_chance_to_clean_up(
    tmp_path: Path,
) -> None:
    popen = _started(tmp_path, STUBBORN, str(tmp_path / "pids"))
    kids = [psutil.Process(int(p)) for p in (tmp_path / "pids").read_text().split()]
    tidy = _started(tmp_path, TIDY, str(tmp_path / "tidy-pid"), str(tmp_path / "tidied"))
    try:
        kill_tree(tidy.pid)
        kill_tree(popen.pid)
        assert popen.wait(timeout=30) == -signal.SIGKILL
        _, alive = psutil.wait_procs(kids, timeout=10)
        assert not alive
        assert tidy.wait(timeout=30) == -signal.SIGKILL
        assert not (tmp_path / "tidied").exists()  # SIGKILL at once: no cleanup ran
    finally:
        for proc in (popen, tidy):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for kid in kids:
            if kid.is_running():
                kid.kill()


def test_exit_codes_and_signals_are_reported(tmp_path: Path) -> None:
    group = WorkerGroup()
    group.start([_launch(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")])
    group.workers[0].popen.wait(timeout=60)
    assert group.poll() == {0: -9}
    assert group.workers[0].exit_time is not None
    group.stop(grace=0.0)


# A stand-in agent: starts one sleeping worker, reports its pid, and dies abruptly.
MINI_AGENT = r"""
import os, sys, time
from rallypoint.agent import workers
if sys.argv[2] == "shim":
    workers._setpriv = lambda: None
launch = workers.WorkerLaunch(
    local_rank=0, global_rank=0, env=dict(os.environ),
    argv=[sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
    log_dir=sys.argv[1], error_file=os.path.join(sys.argv[1], "error.json"),
    redirect=workers.Std.ALL,
)
group = workers.WorkerGroup()
group.start([launch])
out = os.path.join(sys.argv[1], "stdout.log")
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    with open(out) as fp:
        if fp.read() == "up\n":
            break
    time.sleep(0.01)
print(group.pids[0], flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["setpriv", "shim"])
def test_workers_die_with_their_agent(tmp_path: Path, mode: str) -> None:
    if mode == "setpriv" and shutil.which("setpriv") is None:
        pytest.skip("util-linux setpriv is not installed")
    proc = subprocess.run(
        [sys.executable, "-c", MINI_AGENT, str(tmp_path), mode],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    worker = int(proc.stdout.strip())
    try:
        psutil.Process(worker).wait(timeout=10)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        psutil.Process(worker).kill()
        pytest.fail("the worker outlived its agent")


def test_stop_forwards_the_signal_the_agent_received(tmp_path: Path) -> None:
    """As torchrun does: a stop signal the agent handles (e.g. SIGUSR1) reaches the
    workers as itself, not as SIGTERM."""
    got = tmp_path / "got"
    code = (
        "import signal, sys, time\n"
        "def on(signum, frame):\n"
        "    open(sys.argv[1], 'w').write(signal.Signals(signum).name)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGUSR1, on)\n"
        "signal.signal(signal.SIGTERM, on)\n"
        "open(sys.argv[1] + '.up', 'w').close()\n"
        "time.sleep(60)\n"
    )
    group = WorkerGroup()
    group.start([_launch(tmp_path, code, str(got))])
    try:
        deadline = time.monotonic() + 30
        while not Path(str(got) + ".up").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        group.stop(grace=10.0, sig=signal.SIGUSR1)
    assert got.read_text() == "SIGUSR1"
