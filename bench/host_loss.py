"""The rendezvous host node's loss: survivors training again, or the job lost.

3 agents x 1 worker on loopback, ``--nnodes 2:3``, ``--max-restarts 3``, a short
liveness window for every launcher (``keep_alive_interval=1,
keep_alive_max_attempt=2``; torch's c10d rendezvous reads the same keys) and a
``last_call_timeout`` of 1 s. Once a round of three runs and has settled, agent 0
and its workers get SIGKILL at once (a node loss). Agent 0 is the node every
rendezvous depends on most: with c10d it hosts the store (``is_host``, the
``--rdzv-endpoint`` host); with ``etcd-embedded`` it runs the first etcd member.

The figure: from the SIGKILL until both survivors have started a worker of a round
of two (training again); or, when the survivors exit instead, "job lost" with the
time they took to give up; or "no regroup within N s" (``--give-up``). Setups,
measured interleaved in the same run:

* ``rallypoint etcd-embedded``: ``rallypoint run``, the embedded etcd (members on
  all three agents);
* ``rallypoint c10d``: ``rallypoint run``, c10d, agent 0 hosting the store;
* ``torchrun c10d``: torch's launcher and c10d rendezvous, agent 0 hosting the store
  (torch has the same hole, pytorch#118891);
* ``torchrun rallypoint-etcd-embedded``: torch's launcher on the embedded etcd
  through the entry point (the store survives; torch's agent regroups only on a
  local failure or a waiting node, so its survivors may never regroup).

Usage::

    python bench/host_loss.py [--repeats 3] [--give-up 60] [--setups all|a,b] [--collective]

``--collective``: the workers all-reduce over gloo (their start stamp is written once
the process group is up), so a lost peer fails them as it fails a real job's
collectives, and torch's agent then restarts them (a local failure) into a new
rendezvous: the figure then includes importing torch and initialising gloo.

One line per setup: median over repeats (runs in brackets), and the ratio to the
embedded etcd where the other setup regrouped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rallypoint.agent.workers import kill_tree

NODES = 3
SETTLE_S = 1.5
CONF = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"

WORKER = r"""
import os, sys, time
with open(sys.argv[1], "a") as fp:
    fp.write(f"{os.getppid()} {os.environ['WORLD_SIZE']} {time.time()!r}\n")
while True:
    time.sleep(1)
"""

#: The setup the others are compared with.
BASE = "rallypoint etcd-embedded"
#: With ``--collective``: the workers all-reduce over gloo, so a lost peer fails
#: them (as a real job's collectives would) and torch's agent restarts them.
COLLECTIVE_WORKER = r"""
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=10))
with open(sys.argv[1], "a") as fp:
    fp.write(f"{os.getppid()} {os.environ['WORLD_SIZE']} {time.time()!r}\n")
while True:
    dist.all_reduce(torch.ones(1))
    time.sleep(0.05)
"""

SETUPS = {
    "rallypoint etcd-embedded": ("rallypoint.run", "etcd-embedded"),
    "rallypoint c10d": ("rallypoint.run", "c10d"),
    "torchrun c10d": ("torch.distributed.run", "c10d"),
    "torchrun rallypoint-etcd-embedded": ("torch.distributed.run", "rallypoint-etcd-embedded"),
}


@dataclass
class Result:
    #: kill -> both survivors run a worker of a round of two (None: not reached)
    regrouped_s: float | None = None
    #: kill -> the survivors exited (job lost), with their exit codes
    lost_s: float | None = None
    codes: tuple[int, ...] = ()


def _free_port(pair: bool = False) -> int:
    """A free port (with ``pair``, one whose next port is free too)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not pair:
            return port
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind(("127.0.0.1", port + 1))
            return port


def _kill_tree(popen: subprocess.Popen[bytes]) -> None:
    kill_tree(popen.pid)
    popen.wait()


def _argv(setup: str, index: int, endpoint: str, run_id: str, data: Path) -> list[str]:
    module, backend = SETUPS[setup]
    conf = CONF
    if "embedded" in backend:
        conf += f",member={index},data_dir={data}"
    elif module == "rallypoint.run" or backend == "c10d":
        conf += f",is_host={'true' if index == 0 else 'false'}"
    args = [
        sys.executable, "-m", module, "--nnodes", f"2:{NODES}", "--nproc-per-node", "1",
        "--max-restarts", "3", "--monitor-interval", "0.1", "--rdzv-backend", backend,
        "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--local-addr", "127.0.0.1",
        "--rdzv-conf", conf,
    ]  # fmt: skip
    return args


def _stamps(path: Path) -> list[tuple[int, int, float]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((int(parts[0]), int(parts[1]), float(parts[2])))
    return out


def measure(
    setup: str,
    workdir: Path,
    give_up: float,
    start_timeout: float = 120.0,
    collective: bool = False,
) -> Result:
    """One run of ``setup``: start, kill agent 0's node, watch the survivors."""
    run_dir = workdir / f"{setup.replace(' ', '-')}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir()
    worker, stamps, data = run_dir / "worker.py", run_dir / "stamps", run_dir / "etcd"
    worker.write_text(COLLECTIVE_WORKER if collective else WORKER)
    data.mkdir()
    if "embedded" in SETUPS[setup][1]:
        ports: list[int] = []
        while len(ports) < NODES:
            port = _free_port(pair=True)
            if not {port - 1, port, port + 1} & set(ports):
                ports.append(port)
        endpoint = ",".join(f"127.0.0.1:{port}" for port in ports)
    else:
        endpoint = f"127.0.0.1:{_free_port()}"
    agents: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = []
    try:
        for index in range(NODES):
            log = open(run_dir / f"agent{index}.log", "wb")  # noqa: SIM115 -- closed below
            argv = [*_argv(setup, index, endpoint, run_dir.name, data), str(worker), str(stamps)]
            popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR"),
            )  # fmt: skip
            agents.append((popen, log))
        deadline = time.monotonic() + start_timeout
        while True:
            full = [s for s in _stamps(stamps) if s[1] == NODES]
            if len(full) >= NODES and time.time() - max(s[2] for s in full) > SETTLE_S:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{setup}: no round of {NODES} within {start_timeout} s")
            for index, (popen, _) in enumerate(agents):
                if popen.poll() is not None:
                    tail = (run_dir / f"agent{index}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{setup}: agent {index} exited {popen.returncode}\n{tail}")
            time.sleep(0.02)
        lost, _ = agents[0]
        killed = time.time()
        _kill_tree(lost)
        survivors = [popen for popen, _ in agents[1:]]
        deadline = time.monotonic() + give_up
        while time.monotonic() < deadline:
            again = {s[0]: s[2] for s in _stamps(stamps) if s[1] == NODES - 1 and s[2] > killed}
            mine = [again[p.pid] for p in survivors if p.pid in again]
            if len(mine) == len(survivors):
                return Result(regrouped_s=max(mine) - killed)
            codes = [p.poll() for p in survivors]
            if all(code is not None for code in codes):
                return Result(lost_s=time.time() - killed, codes=tuple(c or 0 for c in codes))
            time.sleep(0.02)
        return Result()
    finally:
        for popen, output in agents:
            _kill_tree(popen)
            output.close()


def _line(setup: str, results: list[Result], give_up: float, base: float | None) -> str:
    regrouped = [r.regrouped_s for r in results if r.regrouped_s is not None]
    runs = ", ".join(
        f"{r.regrouped_s:.2f}"
        if r.regrouped_s is not None
        else (f"lost after {r.lost_s:.2f}" if r.lost_s is not None else "no regroup")
        for r in results
    )
    if len(regrouped) == len(results):
        median = statistics.median(regrouped)
        ratio = f"  ({median / base:.2f}x the embedded etcd)" if base and setup != BASE else ""
        return f"{setup:36s} survivors training again after {median:.2f} s [{runs}]{ratio}"
    lost = [r for r in results if r.lost_s is not None]
    if lost and len(lost) == len(results):
        median = statistics.median(r.lost_s for r in lost if r.lost_s is not None)
        codes = sorted({c for r in lost for c in r.codes})
        return f"{setup:36s} job lost: survivors exit {codes} after {median:.2f} s [{runs}]"
    return f"{setup:36s} no regroup within {give_up:g} s [{runs}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--give-up", type=float, default=60.0)
    parser.add_argument("--setups", default="all", help="comma-separated, or all")
    parser.add_argument(
        "--collective",
        action="store_true",
        help="workers all-reduce over gloo (a lost peer fails them; stamps after init)",
    )
    args = parser.parse_args(argv)
    setups = list(SETUPS) if args.setups == "all" else args.setups.split(",")
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        parser.error(f"unknown setups {unknown}; known: {', '.join(SETUPS)}")
    results: dict[str, list[Result]] = {s: [] for s in setups}
    with tempfile.TemporaryDirectory(prefix="rallypoint-host-loss-") as tmp:
        for _ in range(args.repeats):
            for setup in setups:  # interleaved: load changes hit every setup alike
                results[setup].append(
                    measure(setup, Path(tmp), args.give_up, collective=args.collective)
                )
    base_runs = [r.regrouped_s for r in results.get(BASE, [])]
    done = [x for x in base_runs if x is not None]
    base = statistics.median(done) if done and len(done) == len(base_runs) else None
    workers = "gloo all-reduce workers" if args.collective else "sleeping workers"
    print(f"host node SIGKILL -> survivors training again ({NODES} nodes, --nnodes 2:{NODES}, "
          f"{workers}, {args.repeats} repeats, loopback)")  # fmt: skip
    for setup in setups:
        print(_line(setup, results[setup], args.give_up, base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
