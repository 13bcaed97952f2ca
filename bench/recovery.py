"""Recovery time after a worker crash: rallypoint vs torchrun, measured in the same run.

Topology: 4 agents x 1 worker on loopback, c10d rendezvous, ``--nnodes 4``,
``--max-restarts 1``, the default monitor interval (0.1 s) for both launchers.
Once all four workers of the first round run (plus a settling second), the rank-3
worker records ``time.time()`` and calls ``os._exit(1)``. Every worker appends its
start time to a shared file; recovery is the time from the crash until the last of
the four workers of the next round has started. All processes run on this machine,
so one clock serves for every stamp.

Usage::

    python bench/recovery.py [--repeats 3] [--with-torch-handler]

Prints one line per launcher (median over repeats) and the ratio torchrun/rallypoint.
"""

from __future__ import annotations

import argparse
import contextlib
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

import psutil

NODES = 4

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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill(popen: subprocess.Popen[bytes]) -> None:
    procs: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(popen.pid)
        procs = [root, *root.children(recursive=True)]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    popen.wait()


def measure(launcher: str, backend: str, workdir: Path, timeout: float = 120.0) -> float:
    """One run: start 4 agents, wait for the crash and the next round, return seconds."""
    run_dir = workdir / f"{launcher}-{backend}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir()
    worker = run_dir / "worker.py"
    worker.write_text(WORKER)
    stamps, crash, finish = run_dir / "stamps", run_dir / "crash", run_dir / "finish"
    port = _free_port()
    module = "rallypoint.run" if launcher == "rallypoint" else "torch.distributed.run"
    common = [
        *("--nnodes", str(NODES), "--nproc-per-node", "1", "--max-restarts", "1"),
        *("--monitor-interval", "0.1", "--rdzv-backend", backend),
        *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_dir.name),
    ]
    if launcher == "rallypoint":
        common += ["--local-addr", "127.0.0.1", "--stop-grace", "5"]
    agents = []
    try:
        for index in range(NODES):
            host = "true" if index == 0 else "false"
            args = list(common)
            if launcher == "rallypoint":
                args += ["--rdzv-conf", f"is_host={host}"]
            argv = [sys.executable, "-m", module, *args]
            argv += map(str, (worker, stamps, crash, finish))
            log = open(run_dir / f"agent{index}.log", "wb")  # noqa: SIM115 -- closed below
            popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR"),
            )
            agents.append((popen, log))
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
            for popen, _ in agents:
                if popen.poll() is not None:
                    raise RuntimeError(
                        f"{launcher} agent exited {popen.returncode}; see {run_dir}/agent*.log"
                    )
            time.sleep(0.02)
        raise RuntimeError(f"{launcher}: no recovery within {timeout} s; see {run_dir}")
    finally:
        finish.touch()
        for popen, log in agents:
            try:
                popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _kill(popen)
            _kill(popen)
            log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--with-torch-handler",
        action="store_true",
        help="also time rallypoint's agent on torch's rendezvous (--rdzv-backend torch-c10d)",
    )
    args = parser.parse_args(argv)
    cases = [("rallypoint", "c10d"), ("torchrun", "c10d")]
    if args.with_torch_handler:
        cases.insert(1, ("rallypoint", "torch-c10d"))
    results: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory(prefix="rallypoint-bench-") as tmp:
        for _ in range(args.repeats):
            for case in cases:  # interleaved, so load drifts hit both alike
                results[case].append(measure(*case, Path(tmp)))
    medians = {case: statistics.median(values) for case, values in results.items()}
    title = f"recovery, {NODES} agents x 1 worker, crash -> next round started"
    for (launcher, backend), value in medians.items():
        spread = ", ".join(f"{v:.3f}" for v in results[(launcher, backend)])
        print(f"{title}: {launcher} ({backend}) {value:.3f} s  [runs: {spread}]")
    ratio = medians[("torchrun", "c10d")] / medians[("rallypoint", "c10d")]
    print(f"{title}: torchrun / rallypoint = {ratio:.1f}x (median of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
