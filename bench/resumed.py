"""Failure -> training resumed on every rank: rallypoint live, rallypoint restart, torchrun.

Used by ``bench/recovery.py`` for its ``live-*`` figures (``--figures live-crash,...``).
3 agents x 1 gloo worker on c10d, all on this machine. The worker
(:data:`WORKER`) trains with :mod:`rallypoint.agent.worker.live` (so the same script runs
under the three launchers: without ``--live`` it runs one round per process) and
appends ``pid round rank world step time`` for every committed step; rank 0 also
writes the step counter to a checkpoint file every ``BENCH_CHECKPOINT_EVERY`` steps
(default 1), from which a restarted job resumes (``live.Job(restore=...)``: the live
mode's newcomers never read it, they get the state from a peer). The script
declares that the job may shrink (``may_shrink=True``). A fault is injected once
the job has trained for ``SETTLE_S``; recovery is the time from the fault until
every rank of the new world has committed a step *in the new round*: a record from
a process that did not train before the fault, or from a surviving process in a
round it was not in.

Faults: ``crash`` SIGKILL of one worker (``--nnodes 3``); ``sigterm`` SIGTERM to one
agent (``--nnodes 2:3``); ``sigkill`` SIGKILL of one agent and its worker, 2 s
liveness window; ``spare`` the same with ``--nnodes 2`` and a third agent standing
by; ``hang`` SIGSTOP of one worker (rallypoint: ``--progress-timeout 1``; every
launcher's workers use a 20 s gloo timeout, so the others fail once it runs out).

:func:`measure_admission` times the admission of a newcomer: 4 agents x 1 worker,
``--nnodes 3:4``, and ``admit-crash`` (a worker SIGKILLed) or ``admit-sigkill`` (an
agent and its worker SIGKILLed, a replacement agent started at once). It reports
the fault -> every rank of the first round after it stepping (live: the survivors,
in a round of 3), the fault -> every rank of a round of 4 stepping (the newcomer
admitted), and the survivors' pause at the admission (their last step in the round
of 3 -> their first in the round of 4; none where no round of 3 trained).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, NamedTuple

import psutil

SETTLE_S = 2.0
LIVENESS = "keep_alive_interval=1,keep_alive_max_attempt=2"
LAST_CALL = "last_call_timeout=1"
CASES = ("rallypoint live", "rallypoint restart", "torchrun")

WORKER = r"""
import os, sys, time
out = sys.argv[1]
every = int(os.environ.get("BENCH_CHECKPOINT_EVERY", "1"))
import torch, torch.distributed as dist
from torch import nn
from rallypoint.agent.worker import live
param = nn.Parameter(torch.zeros(1, dtype=torch.float64))
holder = nn.Module(); holder.register_parameter("value", param)
ckpt = os.path.join(out, "ckpt")
def restore():
    if os.path.exists(ckpt):
        with open(ckpt) as fp:
            return int(fp.read() or 0)
    return 0
job = live.Job(model=holder, backend="gloo", timeout=20, restore=restore, may_shrink=True)
log = open(os.path.join(out, "steps"), "a", buffering=1)
for rnd in job.rounds():
    with rnd:
        for step in rnd.steps(10**9):
            t = torch.ones(1, dtype=torch.float64)
            dist.all_reduce(t)
            time.sleep(0.01)
            gen = os.environ.get("RALLYPOINT_ROUND") or os.environ["TORCHELASTIC_RESTART_COUNT"]
            where = f"{os.getpid()} {gen} {rnd.rank} {rnd.world_size}"
            log.write(f"{where} {step + 1} {time.time()!r}\n")
            if rnd.rank == 0 and (step + 1) % every == 0:
                with open(ckpt + ".tmp", "w") as fp:
                    fp.write(str(step + 1))
                os.replace(ckpt + ".tmp", ckpt)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class StepRecord(NamedTuple):
    """One committed step, as the worker logged it."""

    pid: int
    generation: str
    rank: int
    world: int
    step: int
    time: float


def records(path: Path) -> list[StepRecord]:
    """Every complete line of the steps file."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 6:
                with contextlib.suppress(ValueError):
                    pid, gen, rank, world, step, when = parts
                    out.append(
                        StepRecord(int(pid), gen, int(rank), int(world), int(step), float(when))
                    )
    return out


def _agent_argv(case: str, fault: str, port: int, run_id: str, host: bool) -> list[str]:
    launcher = "torch.distributed.run" if case == "torchrun" else "rallypoint.run"
    nnodes = {"crash": "3", "hang": "3", "spare": "2"}.get(fault, "2:3")
    if fault.startswith("admit-"):
        nnodes = "3:4"
    conf = f"{LIVENESS},{LAST_CALL}"
    args = [
        *("--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3"),
        *("--monitor-interval", "0.1", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id),
    ]
    if case != "torchrun":
        args += ["--local-addr", "127.0.0.1", "--stop-grace", "2"]
        conf += f",is_host={'true' if host else 'false'}"
        if fault == "spare":
            conf += ",stable_ranks=1"
    if case == "rallypoint live":
        args += ["--live", "--live-timeout", "10"]
        if fault == "hang":
            args += ["--progress-timeout", "1"]
    return [sys.executable, "-m", launcher, *args, "--rdzv-conf", conf]


def measure_resumed(case: str, fault: str, workdir: Path, give_up: float) -> float:
    """Seconds from the fault to every rank of the new world stepping (inf: never
    within ``give_up``)."""
    run = _Run(case, fault, workdir)
    run_dir, steps, agents = run.dir, run.steps, run.agents
    try:
        for index in range(3):
            run.start_agent()
            if index == 0:
                time.sleep(0.5)  # the store host first
        world = 2 if fault == "spare" else 3
        if not _steady(steps, world):
            # torchrun restarts its whole group while a node it cannot admit
            # waits (the spare): no steady training to fault.
            print(f"{case} {fault}: no steady training within 120 s", file=sys.stderr)
            return math.inf
        before = records(steps)
        victim_rank = world - 1
        victim_pid = max((r for r in before if r.rank == victim_rank), key=lambda r: r.time).pid
        generation = {r.pid: r.generation for r in before}
        victim_agent = next(
            (a for a in agents if any(p.pid == victim_pid for p in _tree(a.pid))), None
        )
        if victim_agent is None:
            # The job is restarting by itself (torchrun restarts its whole group while a
            # node it cannot admit waits): there is no steady state to fault.
            print(f"{case} {fault}: no steady training to fault; see {run_dir}", file=sys.stderr)
            return math.inf
        fault_at = time.time()
        if fault == "crash":
            os.kill(victim_pid, signal.SIGKILL)
        elif fault == "hang":
            os.kill(victim_pid, signal.SIGSTOP)
        elif fault == "sigterm":
            os.kill(victim_agent.pid, signal.SIGTERM)
        else:
            for proc in _tree(victim_agent.pid):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        new_world = {"crash": 3, "hang": 3, "spare": 2}.get(fault, 2)
        while time.time() - fault_at < give_up:
            first_steps: dict[int, float] = {}  # rank -> its first step in the new round
            for pid, gen, rank, size, _step, when in records(steps):
                if when > fault_at and size == new_world and generation.get(pid) != gen:
                    first_steps.setdefault(rank, when)
            if len(first_steps) == new_world:
                return max(first_steps.values()) - fault_at
            time.sleep(0.02)
        return math.inf
    finally:
        run.stop()


class _Run:
    """One measured run: its folder (the worker, its steps, the agents' logs) and
    its agents."""

    def __init__(self, case: str, fault: str, workdir: Path) -> None:
        self.case, self.fault = case, fault
        self.dir = workdir / f"{fault}-{case.replace(' ', '-')}-{os.urandom(4).hex()}"
        self.dir.mkdir()
        (self.dir / "worker.py").write_text(WORKER)
        self.steps = self.dir / "steps"
        self.port = _free_port()
        self.agents: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []

    def start_agent(self) -> None:
        """Start one more agent (the first hosts the store)."""
        log = open(self.dir / f"agent{len(self.agents)}.log", "wb")  # noqa: SIM115
        self._logs.append(log)
        argv = _agent_argv(self.case, self.fault, self.port, self.dir.name, not self.agents)
        self.agents.append(
            subprocess.Popen(
                [*argv, str(self.dir / "worker.py"), str(self.dir)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    def stop(self) -> None:
        stop_agents(self.agents)
        for log in self._logs:
            log.close()


def _steady(steps: Path, world: int, timeout: float = 120.0) -> bool:
    """Wait until every rank of a round of ``world`` has stepped and the job has
    trained for ``SETTLE_S``; False if that does not happen within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = records(steps)
        if recs:
            first = min(r.time for r in recs)
            if (
                len({r.rank for r in recs if r.world == world}) == world
                and time.time() - first > SETTLE_S
            ):
                return True
        time.sleep(0.05)
    return False


def measure_admission(
    case: str, fault: str, workdir: Path, give_up: float
) -> tuple[float, float, float]:
    """(fault -> every rank of the next round stepping, fault -> every rank of a
    round of 4 stepping, the survivors' pause at the admission) in seconds; inf
    where it did not happen within ``give_up`` (the pause: no round of 3 trained)."""
    run = _Run(case, fault, workdir)
    run_dir, steps, agents = run.dir, run.steps, run.agents
    never = (math.inf, math.inf, math.inf)
    try:
        for index in range(4):
            run.start_agent()
            if index == 0:
                time.sleep(0.5)  # the store host first
        if not _steady(steps, 4):
            print(f"{case} {fault}: no steady training within 120 s", file=sys.stderr)
            return never
        before = records(steps)
        victim_pid = max((r for r in before if r.rank == 3), key=lambda r: r.time).pid
        victim_agent = next(
            (a for a in agents[1:] if any(p.pid == victim_pid for p in _tree(a.pid))), None
        )
        if victim_agent is None:
            print(f"{case} {fault}: no steady training to fault; see {run_dir}", file=sys.stderr)
            return never
        generation = {r.pid: r.generation for r in before}
        fault_at = time.time()
        if fault == "admit-crash":
            os.kill(victim_pid, signal.SIGKILL)
        else:
            for proc in _tree(victim_agent.pid):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            run.start_agent()
        while time.time() - fault_at < give_up:
            rounds = _new_rounds(records(steps), generation, fault_at)
            admitted = next((r for r in rounds if r.world == 4), None)
            if admitted is not None:
                resumed = rounds[0].stepping_at - fault_at
                smaller = [r for r in rounds if r.world < 4 and r.stepping_at < admitted.started]
                kept = set(smaller[-1].last) & set(admitted.first) if smaller else set()
                pause = max(
                    (admitted.first[pid] - smaller[-1].last[pid] for pid in kept),
                    default=math.inf,
                )
                return resumed, admitted.stepping_at - fault_at, pause
            time.sleep(0.05)
        return never
    finally:
        run.stop()


class _NewRound:
    """The steps of one round after a fault: when each rank first stepped, and each
    process's first and last step."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.ranks: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    @property
    def started(self) -> float:
        return min(self.ranks.values())

    @property
    def stepping_at(self) -> float:
        """When every rank of the round had stepped (inf: not yet)."""
        return max(self.ranks.values()) if len(self.ranks) == self.world else math.inf


def _new_rounds(
    stepped: list[StepRecord], generation: dict[int, str], since: float
) -> list[_NewRound]:
    """The worlds trained after ``since`` whose every rank stepped, by when they did:
    records of processes that did not train before, or of survivors in a round they
    were not in. (By world size, not round: torchrun's generation is each agent's
    restart count, which differs between agents of one round.)"""
    rounds: dict[int, _NewRound] = {}
    for pid, gen, rank, world, _step, when in stepped:
        if when <= since or generation.get(pid) == gen:
            continue
        found = rounds.setdefault(world, _NewRound(world))
        found.ranks.setdefault(rank, when)
        found.first.setdefault(pid, when)
        found.last[pid] = when
    complete = [r for r in rounds.values() if math.isfinite(r.stepping_at)]
    return sorted(complete, key=lambda r: r.stepping_at)


def stop_agents(agents: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every agent with all it started, and collect them."""
    for agent in agents:
        for proc in _tree(agent.pid):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
