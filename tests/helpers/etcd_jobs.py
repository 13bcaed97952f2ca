"""Real agents on etcd for the chaos tests of ``test_chaos_etcd.py``.

:class:`Job` starts ``python -m rallypoint.run`` agents (etcd backend, one worker
each) running :data:`TRAIN`, a small training script: the worker of global rank 0
counts steps, checkpointing the count to a file after every step (a restarted
round resumes from it), and the others wait for the count to reach the end. Every
worker start and every step is a JSON line in ``progress.jsonl`` with its wall
time, so the test can tell when a round started and whether training went on
during a fault. Every process of a job carries an environment mark; the job finds
them wherever they were reparented, and :meth:`Job.stop_all` (a finalizer) kills
whatever is left, even after a failed assertion.

:class:`Outcome` is one scenario's row of the closing table: what happened, the
times from the fault to the agents running again, and the processes left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers.cluster import marked_processes, read_jsonl

MARK_ENV = "RALLYPOINT_ETCD_CHAOS_MARK"
#: ``make chaos`` (RALLYPOINT_CHAOS_FULL=1): the long form of every scenario.
FULL = os.environ.get("RALLYPOINT_CHAOS_FULL") == "1"
#: Where to append each scenario's :class:`Outcome` as a JSON line (optional).
REPORT_ENV = "RALLYPOINT_CHAOS_REPORT"

TRAIN = r"""
import json, os, sys, time
ckpt, total, step_time = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rank = int(os.environ["RANK"])
progress = os.path.join(os.path.dirname(ckpt), "progress.jsonl")
# the last step waits while this file is there (see Job.finish); without it, the
# steps run without their step time
hold = os.path.join(os.path.dirname(ckpt), "hold")

def load():
    try:
        with open(ckpt) as fp:
            return int(fp.read() or 0)
    except FileNotFoundError:
        return 0

def log(event, **fields):
    fields.update(event=event, time=time.time(), rank=rank, pid=os.getpid(),
                  round=int(os.environ.get("RALLYPOINT_ROUND", "-1")),
                  world=int(os.environ["WORLD_SIZE"]))
    with open(progress, "a") as fp:
        fp.write(json.dumps(fields) + "\n")

log("start", step=load())
deadline = time.monotonic() + 600
if rank == 0:
    step = load()
    while step < total and time.monotonic() < deadline:
        while step == total - 1 and os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.02)
        # once the scenario has finished the job, the remaining steps run at
        # full speed: its faults are over
        if step_time and not os.path.exists(hold):
            step_time = 0.0
        time.sleep(step_time)
        step += 1
        # Logged before it is checkpointed: a worker stopped between the two
        # makes the step again (logged twice), never checkpoints it unlogged.
        log("step", step=step)
        with open(ckpt + ".tmp", "w") as fp:
            fp.write(str(step))
        os.replace(ckpt + ".tmp", ckpt)
    assert load() == total, f"checkpoint {load()} != {total}"
else:
    while load() < total and time.monotonic() < deadline:
        time.sleep(0.02)
log("done", step=load())
"""

#: A liveness window (2 s x 7 = 14 s) whose lease (13 s) outlasts one outage of the
#: scenarios together with the lease's age when it begins: nobody can renew a
#: heartbeat while etcd is down, so what counts is up to one keep-alive interval
#: (plus the heartbeat thread's quarter-interval wake) before the outage and the
#: outage itself (5 s plus etcd's restart: agents see 6.3-6.8 s in the full form).
#: With 2 s x 5 (a 9 s lease) that sum reached 9.2 s and fenced a node (docs/design.md,
#: decision 7), a regroup the scenarios do not expect. And read_timeout long enough
#: for every outage.
RDZV_CONF = (
    "keep_alive_interval=2,keep_alive_max_attempt=7,last_call_timeout=0.5,"
    "read_timeout=60,join_timeout=120"
)

_ANSWERS_AGAIN = re.compile(r"etcd answers again after ([0-9.]+) s")
_FAILED = re.compile(r"etcd at \S+ failed .*; retrying for up to")


@dataclass
class Outcome:
    """One scenario's result (a row of the closing table)."""

    scenario: str
    outcome: str = ""
    #: fault -> the agents ran workers of a new round (None: no new round needed)
    fault_to_new_round_s: float | None = None
    #: etcd healthy again (restarted, continued, a new leader) -> that new round
    back_to_new_round_s: float | None = None
    #: the longest outage an agent reported ("etcd answers again after X s")
    agent_outage_s: float | None = None
    #: training steps made while etcd was down (workers never need etcd)
    steps_during_outage: int | None = None
    rounds: int = 0
    final_step: int = 0
    leftovers: list[str] = field(default_factory=list)

    def report(self) -> None:
        path = os.environ.get(REPORT_ENV)
        if path:
            with open(path, "a") as fp:
                fp.write(json.dumps({**asdict(self), "full": FULL}) + "\n")


class Job:
    """The agents of one scenario (see the module docstring)."""

    def __init__(self, directory: Path, endpoint: str, steps: int, step_time: float) -> None:
        self.dir = directory
        self.endpoint = endpoint
        self.steps = steps
        self.step_time = step_time
        self.mark = uuid.uuid4().hex
        self.run_id = f"chaos-{self.mark[:12]}"
        self.script = directory / "train.py"
        self.script.write_text(TRAIN)
        self.ckpt = directory / "ckpt"
        self.progress = directory / "progress.jsonl"
        # The job holds before its last step until finish(): it must not end
        # before its scenario is done (a third agent starting late on a loaded
        # host found the job over and the rendezvous closed). Once finish()
        # removes it, the remaining steps run without their step time: the
        # scenario's faults are over, and idle agents and members cost CPU.
        self.hold = directory / "hold"
        self.hold.touch()
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, nnodes: str = "2:3") -> None:
        """Start agent ``name`` (``--nnodes nnodes``, one worker)."""
        self._start(name, nnodes, "etcd", RDZV_CONF, max_restarts=3)

    def _start(
        self, name: str, nnodes: str, backend: str, rdzv_conf: str, max_restarts: int
    ) -> None:
        argv = [
            sys.executable, "-m", "rallypoint.run", "--nnodes", nnodes,
            "--nproc-per-node", "1", "--rdzv-backend", backend,
            "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
            "--local-addr", "127.0.0.1", "--monitor-interval", "0.1",
            "--max-restarts", str(max_restarts), "--rdzv-conf", rdzv_conf,
            str(self.script), str(self.ckpt), str(self.steps), str(self.step_time),
        ]  # fmt: skip
        env = dict(os.environ, **{MARK_ENV: self.mark})
        with open(self.dir / f"{name}.log", "ab") as log:
            self.agents[name] = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.dir,
                start_new_session=True,
            )

    # -- what happened --------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.progress)

    def starts(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if r["event"] == "start"]

    def step(self) -> int:
        steps = [r["step"] for r in self.records() if r["event"] == "step"]
        return max(steps, default=0)

    def rounds(self) -> list[int]:
        return sorted({r["round"] for r in self.starts()})

    def logs(self) -> str:
        parts = []
        for name, popen in self.agents.items():
            text = (self.dir / f"{name}.log").read_text(errors="replace")
            parts.append(f"----- agent {name} (rc={popen.poll()}) -----\n{text[-6000:]}")
        return "\n".join(parts)

    def outages(self, name: str) -> list[float]:
        """The outages agent ``name`` logged ("etcd answers again after X s")."""
        text = (self.dir / f"{name}.log").read_text(errors="replace")
        return [float(m) for m in _ANSWERS_AGAIN.findall(text)]

    def agent_outage(self) -> float | None:
        """The longest outage any agent logged, in seconds."""
        return max((x for name in self.agents for x in self.outages(name)), default=None)

    def back_on_etcd(self) -> bool:
        """Whether every outage an agent logged the start of has ended (an agent
        whose calls did not fail saw no outage)."""
        for name in self.agents:
            text = (self.dir / f"{name}.log").read_text(errors="replace")
            if len(_FAILED.findall(text)) > len(_ANSWERS_AGAIN.findall(text)):
                return False
        return True

    def wait_for(self, predicate: Callable[[], Any], what: str, timeout: float) -> Any:
        """Poll ``predicate`` until it returns something true; fail after
        ``timeout`` s, or at once when an agent exits with an error."""
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            for name, popen in self.agents.items():
                if popen.poll() not in (None, 0):
                    raise AssertionError(
                        f"agent {name} exited {popen.returncode} while waiting for {what}\n"
                        f"{self.logs()}"
                    )
            if time.monotonic() >= deadline:
                raise AssertionError(f"no {what} within {timeout:g} s\n{self.logs()}")
            time.sleep(0.02)

    def round_started(self, after: float, world: int) -> float | None:
        """The wall time by which every worker of a round started after ``after``
        (wall time) with ``world`` workers had started, or None."""
        by_round: dict[int, list[float]] = {}
        for record in self.starts():
            if record["time"] > after and record["world"] == world:
                by_round.setdefault(record["round"], []).append(record["time"])
        done = [max(times) for times in by_round.values() if len(times) >= world]
        return min(done, default=None)

    def finish(self, timeout: float) -> dict[str, int]:
        """Let the job take its last step, then wait for every agent to exit;
        their exit codes."""
        self.hold.unlink(missing_ok=True)
        deadline = time.monotonic() + timeout
        codes = {}
        for name, popen in self.agents.items():
            try:
                codes[name] = popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"agent {name} still running after {timeout:g} s\n{self.logs()}"
                ) from None
        return codes

    def steps_between(self, start: float, end: float) -> int:
        return sum(1 for r in self.records() if r["event"] == "step" and start <= r["time"] <= end)

    # -- what is left -----------------------------------------------------------------

    def marked(self) -> list[psutil.Process]:
        return marked_processes(MARK_ENV, self.mark)

    def leftovers(self, within: float = 10.0) -> list[str]:
        """The job's processes still alive ``within`` s after every agent exited."""
        deadline = time.monotonic() + within
        while True:
            left = self.marked()
            if not left or time.monotonic() >= deadline:
                return [f"{p.pid} {' '.join(_cmdline(p))[:120]}" for p in left]
            time.sleep(0.05)

    def stop_all(self) -> None:
        """Kill every agent's process group and every marked process."""
        for popen in self.agents.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=10)
        for proc in self.marked():
            with contextlib.suppress(psutil.Error):
                proc.kill()


def _cmdline(proc: psutil.Process) -> Sequence[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return ["?"]


def table(outcomes: Sequence[Outcome]) -> str:
    """The closing table: scenario -> outcome -> times -> processes left."""

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        "| scenario | outcome | fault -> new round running (s) | etcd back -> new round (s) "
        "| outage seen by agents (s) | steps during outage | rounds | processes left |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.scenario} | {o.outcome} | {seconds(o.fault_to_new_round_s)} "
            f"| {seconds(o.back_to_new_round_s)} | {seconds(o.agent_outage_s)} | "
            f"{'-' if o.steps_during_outage is None else o.steps_during_outage} "
            f"| {o.rounds} | {len(o.leftovers)} |"
        )
    return "\n".join(lines)


def print_after_tests(request: pytest.FixtureRequest, lines: Sequence[str]) -> None:
    """Write ``lines`` to pytest's terminal, past its output capture (a scenario
    table closing a test module)."""
    plugins = request.config.pluginmanager
    reporter = plugins.get_plugin("terminalreporter")
    capture = plugins.get_plugin("capturemanager")
    if reporter is None:
        return
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line)
