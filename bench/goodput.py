"""Goodput under a steady rain of faults: rallypoint live, rallypoint restart, torchrun.

4 agents x 1 gloo worker on c10d (2 s liveness window), all on this machine,
training ``bench/resumed.py``'s worker (a step is an all-reduce and a 10 ms sleep;
rank 0 writes a checkpoint every ``--checkpoint-every`` steps, from which a
restarted job resumes: the steps since it are redone; the script declares that the
job may shrink). Every ``--period`` seconds for ``--duration`` seconds one fault,
drawn by ``--seed``: a worker SIGKILLed, an agent and its worker SIGKILLed (a
replacement agent is started at once), or an agent SIGTERMed (likewise replaced).
The store host (agent 0) is never hit: losing it ends a c10d job under every
launcher. Each ``--nnodes`` setting runs every launcher.

goodput = the job's step counter at the end (committed steps kept) / the steps an
undisturbed run does in the same wall time. The undisturbed run (rallypoint,
classic mode, no fault) is measured for ``--baseline`` seconds before and after
every faulted run, interleaved with them, so that each run is divided by the
rate measured around it, under the same load. Both are timed from the job's first
step. ``redone``: steps rank 0 committed again after a restart took the job back
to its checkpoint. A live job that trains on in a smaller world keeps steps that
each do less work: ``work`` counts every kept step by the ranks that took it,
against the undisturbed run's steps x 4. Usage::

    python bench/goodput.py [--duration 180] [--period 15] [--seed 1] [--baseline 30]
                            [--nnodes 3:4,4:4] [--checkpoint-every 50]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil
from resumed import CASES, LIVENESS, WORKER, _free_port, _tree, records, stop_agents

AGENTS = 4
FAULTS = ("worker SIGKILL", "agent+worker SIGKILL", "agent SIGTERM")
#: the undisturbed reference
BASELINE = "rallypoint restart"


@dataclass(frozen=True)
class Outcome:
    """One run: the job's step counter at the end, the steps redone, the work kept
    (each kept step counted by the ranks that took it: a step in a smaller world
    does less), and the seconds from its first step to the end."""

    steps: int
    redone: int
    rank_steps: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.steps / self.seconds


class _Job:
    """The agents of one run, and the faults done to them."""

    def __init__(self, case: str, run_dir: Path, nnodes: str, checkpoint_every: int) -> None:
        self.case = case
        self.dir = run_dir
        self.nnodes = nnodes
        self.port = _free_port()
        self.worker = run_dir / "worker.py"
        self.worker.write_text(WORKER)
        self.env = {**os.environ, "BENCH_CHECKPOINT_EVERY": str(checkpoint_every)}
        self.agents: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[bytes]] = []

    def start(self, host: bool) -> subprocess.Popen[bytes]:
        launcher = "torch.distributed.run" if self.case == "torchrun" else "rallypoint.run"
        conf = f"{LIVENESS},last_call_timeout=1"
        args = [
            *("--nnodes", self.nnodes, "--nproc-per-node", "1"),
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
            start_new_session=True, env=self.env,
        )  # fmt: skip
        self.agents.append(popen)
        return popen

    def outcome(self, started: float) -> Outcome:
        """The steps kept and redone so far, and the seconds since ``started``."""
        kept = redone = 0
        world_of: dict[int, int] = {}  # step -> the world of its last commit
        for record in records(self.dir / "steps"):
            if record.rank != 0:
                continue
            if record.step <= kept:
                redone += 1
            kept = max(kept, record.step)
            world_of[record.step] = record.world
        work = sum(world_of.get(step, 0) for step in range(1, kept + 1))
        return Outcome(kept, redone, work, time.time() - started)

    def first_step(self, timeout: float) -> float:
        """When the job committed its first step."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stepped = records(self.dir / "steps")
            if stepped:
                return min(r.time for r in stepped)
            time.sleep(0.05)
        raise RuntimeError(f"{self.case}: no training within {timeout:g} s; see {self.dir}")

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
            log.close()


def _cmd(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def run(
    case: str,
    workdir: Path,
    duration: float,
    period: float,
    seed: int | None,
    *,
    nnodes: str,
    checkpoint_every: int,
) -> Outcome:
    """``duration`` s of training from the first step, a fault every ``period`` s
    (None seed: none)."""
    run_dir = workdir / f"{case.replace(' ', '-')}-{os.urandom(4).hex()}"
    run_dir.mkdir()
    job = _Job(case, run_dir, nnodes, checkpoint_every)
    try:
        job.start(host=True)
        time.sleep(0.5)
        for _ in range(AGENTS - 1):
            job.start(host=False)
        started = job.first_step(180)
        rng = random.Random(seed)
        next_fault = started + period
        while (now := time.time()) < started + duration:
            if seed is not None and now >= next_fault:
                kind = rng.choice(FAULTS)
                job.fault(kind, rng)
                print(f"  {case} ({nnodes}): t={now - started:.0f}s {kind}", flush=True)
                next_fault += period
            time.sleep(0.05)
        return job.outcome(started)
    finally:
        job.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of training")
    parser.add_argument("--period", type=float, default=15.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=1, help="draws the faults")
    parser.add_argument(
        "--baseline", type=float, default=30.0, help="undisturbed seconds around each run"
    )
    parser.add_argument("--nnodes", default="3:4,4:4", help="comma-separated --nnodes settings")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps per checkpoint")
    args = parser.parse_args(argv)
    settings = [n.strip() for n in args.nnodes.split(",") if n.strip()]
    lines = []
    with tempfile.TemporaryDirectory(prefix="rallypoint-goodput-") as tmp:
        for nnodes in settings:

            def baseline(nnodes: str = nnodes) -> Outcome:
                done = run(
                    BASELINE, Path(tmp), args.baseline, args.period, None,
                    nnodes=nnodes, checkpoint_every=args.checkpoint_every,
                )  # fmt: skip
                print(
                    f"  undisturbed ({nnodes}): {done.steps} steps in {done.seconds:.1f} s "
                    f"({done.rate:.1f} steps/s)",
                    flush=True,
                )
                return done

            before = baseline()
            for case in CASES:
                done = run(
                    case, Path(tmp), args.duration, args.period, args.seed,
                    nnodes=nnodes, checkpoint_every=args.checkpoint_every,
                )  # fmt: skip
                after = baseline()
                rate = statistics.mean([before.rate, after.rate])
                expected = rate * done.seconds
                work = done.rank_steps / (AGENTS * expected)
                lines.append(
                    f"goodput, {AGENTS} agents x 1 worker, --nnodes {nnodes}, a fault every "
                    f"{args.period:g} s for {args.duration:g} s (seed {args.seed}), a checkpoint "
                    f"every {args.checkpoint_every} steps: {case} {done.steps / expected:.0%} "
                    f"(work {work:.0%}; {done.steps} steps kept of {expected:.0f}; "
                    f"{done.redone} redone; "
                    f"undisturbed {before.rate:.1f} and {after.rate:.1f} steps/s around it)"
                )
                print(lines[-1], flush=True)
                before = after
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
