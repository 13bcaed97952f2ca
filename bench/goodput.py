"""Goodput under a steady rain of faults: rallypoint live, rallypoint restart, torchrun.

4 agents x 1 gloo worker on c10d (``--nnodes 3:4``, 2 s liveness window), all on
this machine, training ``bench/resumed.py``'s worker (a step is an all-reduce and a
10 ms sleep; the restart modes resume from a checkpoint written after every step,
which flatters them: a real job loses the steps since its last checkpoint). Every
``--period`` seconds for ``--duration`` seconds one fault, drawn by ``--seed``: a
worker SIGKILLed, an agent and its worker SIGKILLed (a replacement agent is started
at once), or an agent SIGTERMed (likewise replaced). The store host (agent 0) is
never hit: losing it ends a c10d job under every launcher.

goodput = committed training steps at the end / the steps an undisturbed run of the
same job does in the same wall time (measured first, rallypoint restart mode, for
``--baseline`` seconds). Usage::

    python bench/goodput.py [--duration 180] [--period 15] [--seed 1] [--baseline 30]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from resumed import CASES, LIVENESS, WORKER, _free_port, _tree, steps_done, stop_agents

AGENTS = 4
FAULTS = ("worker SIGKILL", "agent+worker SIGKILL", "agent SIGTERM")


class _Job:
    """The agents of one run, and the faults done to them."""

    def __init__(self, case: str, run_dir: Path) -> None:
        self.case = case
        self.dir = run_dir
        self.port = _free_port()
        self.worker = run_dir / "worker.py"
        self.worker.write_text(WORKER)
        self.agents: list[subprocess.Popen[bytes]] = []
        self.logs: list[object] = []

    def start(self, host: bool) -> subprocess.Popen[bytes]:
        launcher = "torch.distributed.run" if self.case == "torchrun" else "rallypoint.run"
        conf = f"{LIVENESS},last_call_timeout=1"
        args = [
            *("--nnodes", f"{AGENTS - 1}:{AGENTS}", "--nproc-per-node", "1"),
            *("--max-restarts", "1000", "--monitor-interval", "0.1", "--rdzv-backend", "c10d"),
            *("--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.dir.name),
        ]
        if self.case != "torchrun":
            args += ["--local-addr", "127.0.0.1", "--stop-grace", "2"]
            conf += f",is_host={'true' if host else 'false'}"
        if self.case == "rallypoint live":
            args += ["--live", "--live-timeout", "10"]
        log = open(self.dir / f"agent{len(self.agents)}.log", "wb")  # noqa: SIM115
        self.logs.append(log)
        popen = subprocess.Popen(
            [sys.executable, "-m", launcher, *args, "--rdzv-conf", conf, str(self.worker),
             str(self.dir)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        self.agents.append(popen)
        return popen

    def progress(self) -> int:
        return steps_done(self.dir / "steps")

    def fault(self, kind: str, rng: random.Random) -> None:
        alive = [a for a in self.agents[1:] if a.poll() is None]
        if not alive:
            return
        victim = rng.choice(alive)
        if kind == "worker SIGKILL":
            workers = [p for p in _tree(victim.pid)[1:] if "worker.py" in " ".join(_cmd(p))]
            for proc in workers[-1:]:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            return
        if kind == "agent SIGTERM":
            victim.send_signal(signal.SIGTERM)
        else:
            for proc in _tree(victim.pid):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        self.start(host=False)

    def stop(self) -> None:
        stop_agents(self.agents)
        for log in self.logs:
            log.close()  # type: ignore[attr-defined]


def _cmd(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def run(case: str, workdir: Path, duration: float, period: float, seed: int | None) -> int:
    """Committed steps after ``duration`` s of training with faults (None seed: none)."""
    run_dir = workdir / f"{case.replace(' ', '-')}-{os.urandom(4).hex()}"
    run_dir.mkdir()
    job = _Job(case, run_dir)
    try:
        job.start(host=True)
        time.sleep(0.5)
        for _ in range(AGENTS - 1):
            job.start(host=False)
        deadline = time.monotonic() + 180
        while job.progress() == 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{case}: no training within 180 s; see {run_dir}")
            time.sleep(0.05)
        rng = random.Random(seed)
        start = time.monotonic()
        next_fault = start + period
        while (now := time.monotonic()) < start + duration:
            if seed is not None and now >= next_fault:
                kind = rng.choice(FAULTS)
                job.fault(kind, rng)
                print(f"  {case}: t={now - start:.0f}s {kind}", flush=True)
                next_fault += period
            time.sleep(0.05)
        return job.progress()
    finally:
        job.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of training")
    parser.add_argument("--period", type=float, default=15.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=1, help="draws the faults")
    parser.add_argument("--baseline", type=float, default=30.0, help="undisturbed seconds")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rallypoint-goodput-") as tmp:
        base = run("rallypoint restart", Path(tmp), args.baseline, args.period, None)
        rate = base / args.baseline
        print(f"undisturbed: {base} steps in {args.baseline:g} s ({rate:.1f} steps/s)")
        expected = rate * args.duration
        for case in CASES:
            done = run(case, Path(tmp), args.duration, args.period, args.seed)
            print(
                f"goodput, {AGENTS} agents x 1 worker, a fault every {args.period:g} s for "
                f"{args.duration:g} s (seed {args.seed}): {case} {done / expected:.0%} "
                f"({done} of {expected:.0f} steps)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
