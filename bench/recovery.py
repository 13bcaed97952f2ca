"""Recovery times on loopback: rallypoint vs torchrun, measured in the same run.

Three figures, 4 agents x 1 worker each, c10d rendezvous, ``--max-restarts 1``, the
default monitor interval (0.1 s) for both launchers. Every worker appends its start
time to a shared file; all processes run on this machine, so one clock serves for
every stamp.

* ``crash``: ``--nnodes 4``. Once all four workers of the first round run (plus a
  settling second), the rank-3 worker records ``time.time()`` and calls
  ``os._exit(1)``. Recovery is the time from the crash until the last of the four
  workers of the next round has started.
* ``sigterm``: ``--nnodes 3:4``, ``last_call_timeout=1`` (3 < max 4 nodes, so the
  survivors' round completes after the last call), the liveness window left at its
  default (5 s x 3). Once a round of four runs and has settled, one agent (not the
  one hosting the c10d store) gets SIGTERM. Recovery is the time from the signal
  until each of the 3 survivors has started a worker of a 3-node round.
* ``sigkill``: the same, but the agent and all its descendants get SIGKILL at once
  (a machine loss), with a short liveness window for both launchers:
  ``keep_alive_interval=1,keep_alive_max_attempt=2`` (torch's c10d rendezvous reads
  the same two ``--rdzv-conf`` keys, as whole seconds).

* ``preempt``: the spare figure's setup, but the agent gets SIGTERM (a preemption
  notice) with the default liveness window: it leaves at once, and the round it
  leaves is refilled by the spare at ``--nnodes`` max, so no last call is waited for.
* ``spare``: ``--nnodes 4`` with a fifth agent started once the first round runs: it
  stands by as a spare (rallypoint with ``stable_ranks=1``). One active agent (not
  the store host) and its workers get SIGKILL, with the short liveness window.
  Recovery is the time from the signal until the 3 survivors and the spare have each
  started a worker of a 4-node round.

torchrun's agent restarts only on a local failure or a waiting node, so after a
lost peer its survivors may never regroup (their workers would hang in a
collective until it times out). A run that has not regrouped after ``--give-up``
seconds is stopped and reported as "no regroup within N s" instead of failing.

Usage::

    python bench/recovery.py [--repeats 3] [--figures crash,sigterm,sigkill,spare,preempt]
                             [--give-up 60] [--with-torch-handler]

``--figures live-crash,...`` (failure -> training resumed) and ``admit-crash,
admit-sigkill`` (a newcomer admitted once ready) compare rallypoint live, rallypoint
restart and torchrun (``bench/resumed.py``).

Prints one line per figure and launcher (median over repeats, runs in brackets) and
the ratio torchrun/rallypoint per figure. Launchers run interleaved.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO

from rallypoint.agent.workers import kill_tree

NODES = 4
SETTLE_S = 1.5  # a round must run this long with no new worker before the signal
LAST_CALL_S = 1  # whole seconds: torch's rendezvous reads it as an int
SHORT_LIVENESS = "keep_alive_interval=1,keep_alive_max_attempt=2"

WORKER = r"""
import os, sys, time
stamps, crash, finish = sys.argv[1], sys.argv[2], sys.argv[3]
started = time.time()
with open(stamps, "a") as fp:
    fp.write(f"{os.getpid()} {started!r}\n")
if os.environ["RANK"] == "3" and not os.path.exists(crash):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(stamps) as fp:
            if sum(1 for _ in fp) >= int(os.environ["WORLD_SIZE"]):
                break
        time.sleep(0.01)
    time.sleep(1.0)  # let every agent settle into its monitor loop
    with open(crash + ".tmp", "w") as fp:
        fp.write(repr(time.time()))
    os.replace(crash + ".tmp", crash)
    os._exit(1)
while not os.path.exists(finish):
    time.sleep(0.01)
"""

# For the node-loss figures: one line per start, "pid agent_pid world_size time";
# written with one O_APPEND write so concurrent workers never interleave.
LOSS_WORKER = r"""
import os, sys, time
stamps, finish = sys.argv[1], sys.argv[2]
line = f"{os.getpid()} {os.getppid()} {os.environ['WORLD_SIZE']} {time.time()!r}\n"
fd = os.open(stamps, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
os.write(fd, line.encode())
os.close(fd)
while not os.path.exists(finish):
    time.sleep(0.01)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill(popen: subprocess.Popen[bytes]) -> None:
    kill_tree(popen.pid)
    popen.wait()


class _Agents:
    """The agents of one run; :meth:`stop` ends every one of them and its workers."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.agents: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []

    def start(self, argv: list[str], index: int) -> subprocess.Popen[bytes]:
        log = open(self.run_dir / f"agent{index}.log", "wb")  # noqa: SIM115 -- closed in stop()
        try:
            popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR"),
            )
        except BaseException:
            log.close()
            raise
        self.agents.append((popen, log))
        return popen

    def tail(self, index: int, lines: int = 30) -> str:
        text = (self.run_dir / f"agent{index}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 15.0) -> None:
        """Give the agents ``grace`` seconds in all to exit, then kill what is left."""
        deadline = time.monotonic() + grace
        for popen, log in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            _kill(popen)  # also any worker that outlived its agent
            log.close()


def _module(launcher: str) -> str:
    return "rallypoint.run" if launcher == "rallypoint" else "torch.distributed.run"


def _common(launcher: str, backend: str, nnodes: str, port: int, run_id: str) -> list[str]:
    args = [
        *("--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "1"),
        *("--monitor-interval", "0.1", "--rdzv-backend", backend),
        *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id),
    ]
    if launcher == "rallypoint":
        args += ["--local-addr", "127.0.0.1", "--stop-grace", "5"]
    return args


def measure(launcher: str, backend: str, workdir: Path, timeout: float = 120.0) -> float:
    """Worker crash: start 4 agents, wait for the crash and the next round, return seconds."""
    run_dir = workdir / f"crash-{launcher}-{backend}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir()
    worker = run_dir / "worker.py"
    worker.write_text(WORKER)
    stamps, crash, finish = run_dir / "stamps", run_dir / "crash", run_dir / "finish"
    common = _common(launcher, backend, str(NODES), _free_port(), run_dir.name)
    agents = _Agents(run_dir)
    try:
        for index in range(NODES):
            host = "true" if index == 0 else "false"
            args = list(common)
            if launcher == "rallypoint":
                args += ["--rdzv-conf", f"is_host={host}"]
            argv = [sys.executable, "-m", _module(launcher), *args]
            argv += map(str, (worker, stamps, crash, finish))
            agents.start(argv, index)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if crash.exists():
                crashed = float(crash.read_text())
                after = sorted(
                    float(line.split()[1])
                    for line in stamps.read_text().splitlines()
                    if float(line.split()[1]) > crashed
                )
                if len(after) >= NODES:
                    return after[NODES - 1] - crashed
            for popen, _ in agents.agents:
                if popen.poll() is not None:
                    raise RuntimeError(
                        f"{launcher} agent exited {popen.returncode}; see {run_dir}/agent*.log"
                    )
            time.sleep(0.02)
        raise RuntimeError(f"{launcher}: no recovery within {timeout} s; see {run_dir}")
    finally:
        finish.touch()
        agents.stop()


def _read_stamps(path: Path) -> list[tuple[int, int, float]]:
    """(agent pid, world size, start time) of every complete line."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            out.append((int(parts[1]), int(parts[2]), float(parts[3])))
    return out


def measure_loss(
    launcher: str,
    backend: str,
    workdir: Path,
    how: str,
    give_up: float,
    timeout: float = 120.0,
) -> float | None:
    """Node loss: 4 agents (``--nnodes 3:4``) run a round; one agent gets SIGTERM
    (``how="sigterm"``) or is SIGKILLed with its workers (``how="sigkill"``). With
    ``how="spare"``, ``--nnodes 4`` and a fifth agent standing by; the SIGKILLed
    agent's place is taken by the spare.

    Returns the seconds from the signal until each survivor (and the spare) has
    started a worker of the next round, or None when that did not happen within
    ``give_up`` s.
    """
    run_dir = workdir / f"{how}-{launcher}-{backend}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir()
    worker = run_dir / "worker.py"
    worker.write_text(LOSS_WORKER)
    stamps, finish = run_dir / "stamps", run_dir / "finish"
    spare = how in ("spare", "preempt")
    nnodes = str(NODES) if spare else f"{NODES - 1}:{NODES}"
    next_world = NODES if spare else NODES - 1
    common = _common(launcher, backend, nnodes, _free_port(), run_dir.name)
    conf = [f"last_call_timeout={LAST_CALL_S}"]
    if how in ("sigkill", "spare"):
        conf.append(SHORT_LIVENESS)
    if spare and launcher == "rallypoint":
        conf.append("stable_ranks=1")
    agents = _Agents(run_dir)

    def start(index: int) -> None:
        # Agent 0 hosts the c10d store, for both launchers (torch's c10d backend
        # reads is_host too; left out, whichever agent binds the port first hosts).
        node_conf = [*conf, f"is_host={'true' if index == 0 else 'false'}"]
        argv = [sys.executable, "-m", _module(launcher), *common]
        argv += ["--rdzv-conf", ",".join(node_conf), str(worker), str(stamps), str(finish)]
        agents.start(argv, index)

    try:
        for index in range(NODES):
            start(index)
        pids = [popen.pid for popen, _ in agents.agents]

        def check_alive(skip: int | None = None) -> None:
            for index, (popen, _) in enumerate(agents.agents):
                if popen.pid != skip and popen.poll() is not None:
                    raise RuntimeError(
                        f"{launcher} agent {index} exited {popen.returncode}:\n"
                        + agents.tail(index)
                    )

        # A round of all four, settled: no worker has started for SETTLE_S.
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{launcher}: no settled round of {NODES}; see {run_dir}")
            check_alive()
            seen = _read_stamps(stamps)
            full = {agent for agent, world, _ in seen if world == NODES}
            if full >= set(pids) and time.time() - max(t for _, _, t in seen) > SETTLE_S:
                break
            time.sleep(0.05)
        if spare:
            start(NODES)  # the round is complete and full: it stands by
            time.sleep(SETTLE_S)
            check_alive()

        # The last active agent, which does not host the c10d store, is the one lost.
        victim = agents.agents[NODES - 1][0]
        survivors = {popen.pid for popen, _ in agents.agents} - {victim.pid}
        signalled = time.time()
        if how in ("sigterm", "preempt"):
            victim.send_signal(signal.SIGTERM)
        else:
            kill_tree(victim.pid)
        deadline = time.monotonic() + give_up
        while time.monotonic() < deadline:
            first: dict[int, float] = {}
            for agent, world, started in _read_stamps(stamps):
                if agent in survivors and world == next_world and started > signalled:
                    first[agent] = min(started, first.get(agent, math.inf))
            if len(first) == len(survivors):
                return max(first.values()) - signalled
            check_alive(skip=victim.pid)
            time.sleep(0.02)
        return None
    finally:
        finish.touch()
        # Survivors that never regrouped wait in torchrun's exit barrier for the lost node.
        agents.stop(grace=5.0)


FIGURES = {
    "crash": f"recovery, {NODES} agents x 1 worker, crash -> next round started",
    "sigterm": (
        f"recovery, {NODES} agents x 1 worker, nnodes {NODES - 1}:{NODES}, "
        f"agent SIGTERM (default liveness window) -> {NODES - 1} survivors in a new round"
    ),
    "sigkill": (
        f"recovery, {NODES} agents x 1 worker, nnodes {NODES - 1}:{NODES}, "
        f"agent+workers SIGKILL ({SHORT_LIVENESS}) -> {NODES - 1} survivors in a new round"
    ),
    "spare": (
        f"recovery, {NODES} agents x 1 worker + 1 spare, nnodes {NODES}, agent+workers "
        f"SIGKILL ({SHORT_LIVENESS}) -> {NODES - 1} survivors and the spare in a new round"
    ),
    "preempt": (
        f"recovery, {NODES} agents x 1 worker + 1 spare, nnodes {NODES}, agent SIGTERM "
        f"(default liveness window) -> {NODES - 1} survivors and the spare in a new round"
    ),
}
#: failure -> training resumed on every rank (bench/resumed.py): live vs restart vs torchrun
RESUMED = {
    "live-crash": ("crash", "3 agents x 1 worker, a worker SIGKILLed"),
    "live-sigterm": ("sigterm", "3 agents x 1 worker, nnodes 2:3, an agent SIGTERMed"),
    "live-sigkill": (
        "sigkill",
        f"3 agents x 1 worker, nnodes 2:3, agent+workers SIGKILL ({SHORT_LIVENESS})",
    ),
    "live-spare": (
        "spare",
        f"2 agents x 1 worker + 1 spare, agent+workers SIGKILL ({SHORT_LIVENESS})",
    ),
    "live-hang": (
        "hang",
        "3 agents x 1 worker, a worker SIGSTOPped (rallypoint: --progress-timeout 1)",
    ),
}
FIGURES.update(
    {name: f"failure -> training resumed, {what}" for name, (_, what) in RESUMED.items()}
)
#: a newcomer admitted once ready (bench/resumed.py's measure_admission)
ADMISSION = {
    "admit-crash": "4 agents x 1 worker, nnodes 3:4, a worker SIGKILLed",
    "admit-sigkill": (
        f"4 agents x 1 worker, nnodes 3:4, agent+workers SIGKILL ({SHORT_LIVENESS}), "
        "a replacement agent started at once"
    ),
}
FIGURES.update({name: f"admission, {what}" for name, what in ADMISSION.items()})
#: what measure_admission returns, in order, and what its infinity means
_ADMISSION_PHASES = (
    ("fault -> every rank of the next round stepping", None),
    ("fault -> the newcomer admitted (a round of 4 stepping)", None),
    ("the survivors' pause at the admission", "none: no smaller round trained"),
)


def _report_admission(figures: list[str], repeats: int, give_up: float) -> None:
    """The ``admit-*`` figures: each case interleaved, medians and runs, ratios."""
    from resumed import CASES, measure_admission

    results = {
        f: {case: [] for case in CASES}  # type: ignore[var-annotated]
        for f in figures
    }
    with tempfile.TemporaryDirectory(prefix="rallypoint-bench-") as tmp:
        for _ in range(repeats):
            for figure in figures:
                for case in CASES:
                    values = measure_admission(case, figure, Path(tmp), give_up)
                    results[figure][case].append(values)
                    shown = ", ".join(
                        _fmt(v, give_up, never)
                        for v, (_, never) in zip(values, _ADMISSION_PHASES, strict=True)
                    )
                    print(f"  {figure} {case}: {shown}", flush=True)
    for figure in figures:
        for index, (phase, never) in enumerate(_ADMISSION_PHASES):
            medians = {}
            for case, runs in results[figure].items():
                values = [run[index] for run in runs]
                medians[case] = statistics.median(values)
                spread = ", ".join(f"{v:.3f}" if math.isfinite(v) else "none" for v in values)
                print(
                    f"{FIGURES[figure]}: {phase}: {case} {_fmt(medians[case], give_up, never)}  "
                    f"[runs: {spread}]"
                )
            live = medians["rallypoint live"]
            for case in CASES[1:]:
                other = medians[case]
                ratio = (
                    f"{other / live:.1f}x"
                    if math.isfinite(other) and math.isfinite(live)
                    else "n/a"
                )
                print(f"{FIGURES[figure]}: {phase}: {case} / rallypoint live = {ratio}")


def _report_resumed(figures: list[str], repeats: int, give_up: float) -> None:
    """The ``live-*`` figures: each case interleaved, medians and runs, ratios."""
    from resumed import CASES, measure_resumed

    results = {f: {case: [] for case in CASES} for f in figures}  # type: ignore[var-annotated]
    with tempfile.TemporaryDirectory(prefix="rallypoint-bench-") as tmp:
        for _ in range(repeats):
            for figure in figures:
                for case in CASES:
                    value = measure_resumed(case, RESUMED[figure][0], Path(tmp), give_up)
                    results[figure][case].append(value)
                    print(f"  {figure} {case}: {_fmt(value, give_up)}", flush=True)
    for figure in figures:
        medians = {case: statistics.median(runs) for case, runs in results[figure].items()}
        for case, runs in results[figure].items():
            spread = ", ".join(f"{v:.3f}" if math.isfinite(v) else "none" for v in runs)
            print(f"{FIGURES[figure]}: {case} {_fmt(medians[case], give_up)}  [runs: {spread}]")
        live = medians["rallypoint live"]
        for case in CASES[1:]:
            other = medians[case]
            ratio = (
                f"{other / live:.1f}x" if math.isfinite(other) and math.isfinite(live) else "n/a"
            )
            print(f"{FIGURES[figure]}: {case} / rallypoint live = {ratio} (median of {repeats})")


def _fmt(value: float, give_up: float, never: str | None = None) -> str:
    if math.isfinite(value):
        return f"{value:.3f} s"
    return never or f"no regroup within {give_up:g} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--figures",
        default="crash,sigterm,sigkill,spare,preempt",
        help="comma-separated subset of: " + ", ".join(FIGURES),
    )
    parser.add_argument(
        "--give-up",
        type=float,
        default=60.0,
        help="seconds to wait for survivors to regroup after a node loss before stopping",
    )
    parser.add_argument(
        "--with-torch-handler",
        action="store_true",
        help="also time rallypoint's agent on torch's rendezvous (--rdzv-backend torch-c10d)",
    )
    args = parser.parse_args(argv)
    figures = [f.strip() for f in args.figures.split(",") if f.strip()]
    unknown = [f for f in figures if f not in FIGURES]
    if unknown:
        parser.error(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
    resumed = [f for f in figures if f in RESUMED]
    admitted = [f for f in figures if f in ADMISSION]
    figures = [f for f in figures if f not in RESUMED and f not in ADMISSION]
    if resumed:
        _report_resumed(resumed, args.repeats, args.give_up)
    if admitted:
        _report_admission(admitted, args.repeats, args.give_up)
    cases = [("rallypoint", "c10d"), ("torchrun", "c10d")]
    if args.with_torch_handler:
        cases.insert(1, ("rallypoint", "torch-c10d"))
    # math.inf: no regroup within --give-up.
    results: dict[str, dict[tuple[str, str], list[float]]] = {
        figure: {case: [] for case in cases} for figure in figures
    }
    with tempfile.TemporaryDirectory(prefix="rallypoint-bench-") as tmp:
        for _ in range(args.repeats):
            for figure in figures:
                for case in cases:  # interleaved, so load drifts hit both alike
                    if figure == "crash":
                        value: float | None = measure(*case, Path(tmp))
                    else:
                        value = measure_loss(*case, Path(tmp), figure, args.give_up)
                    results[figure][case].append(math.inf if value is None else value)
    for figure in figures:
        title = FIGURES[figure]
        medians = {case: statistics.median(values) for case, values in results[figure].items()}
        for (launcher, backend), value in medians.items():
            runs = results[figure][(launcher, backend)]
            spread = ", ".join(f"{v:.3f}" if math.isfinite(v) else "none" for v in runs)
            print(f"{title}: {launcher} ({backend}) {_fmt(value, args.give_up)}  [runs: {spread}]")
        ours, theirs = medians[("rallypoint", "c10d")], medians[("torchrun", "c10d")]
        if math.isfinite(theirs) and math.isfinite(ours):
            ratio = f"{theirs / ours:.1f}x"
        elif math.isfinite(ours):
            ratio = f"> {args.give_up / ours:.1f}x (torchrun: no regroup within {args.give_up:g} s)"
        else:
            ratio = "n/a (rallypoint did not regroup)"
        print(f"{title}: torchrun / rallypoint = {ratio} (median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
