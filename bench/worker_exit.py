"""How often a finished worker that left its gloo process group undestroyed still
fails: rallypoint vs torchrun, measured in the same run.

Every worker joins a gloo group, all-reduces its rank + 1 and returns (or prints)
the sum, without ``destroy_process_group``. gloo's teardown can then abort the
interpreter at exit ("terminate called without an active exception", SIGABRT),
which turns a finished job into a failed one. One standalone node, 2 workers, per
figure and launcher ``--runs`` jobs:

* ``function``: ``elastic_launch`` of the function (rallypoint's and torch's API);
* ``run-path``: ``rallypoint run --run-path`` / ``torchrun --run-path`` of the script;
* ``script``: the plain script (each launcher leaves its interpreter alone).

Each line: the figure, then per launcher the jobs that ended with exit 0 out of
``--runs``, and how the others ended.

Usage: python bench/worker_exit.py [--runs 20] [--figures function,run-path,script]
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

#: the worker: a gloo group joined, all-reduced and never destroyed
WORKER = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "gloo_sum.py"

FIGURES = ("function", "run-path", "script")


def _function(launcher: str, workdir: Path, run: int) -> str:
    from gloo_sum import sum_ranks  # type: ignore[import-not-found]

    logs = str(workdir / f"{launcher}-logs-{run}")
    if launcher == "rallypoint":
        from rallypoint.agent.api import WorkerFailedError, elastic_launch
        from rallypoint.agent.config import LaunchConfig

        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=2, standalone=True,
            monitor_interval=0.05, log_dir=logs,
        )  # fmt: skip
        try:
            results = elastic_launch(config, sum_ranks)()
        except WorkerFailedError as exc:
            return exc.worker_failures[0].message
    else:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig as TorchConfig
        from torch.distributed.launcher.api import elastic_launch as torch_launch

        config = TorchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0", run_id=f"exit{run}", monitor_interval=0.05,
        )  # fmt: skip
        try:
            results = torch_launch(config, sum_ranks)()
        except ChildFailedError as exc:
            return f"exit code {exc.get_first_failure()[1].exitcode}"
    return "ok" if results == {0: 3, 1: 3} else f"wrong results {results}"


def _command(launcher: str, figure: str, workdir: Path, run: int) -> str:
    script = str(WORKER)
    flags = ["--run-path"] if figure == "run-path" else []
    if launcher == "rallypoint":
        argv = [sys.executable, "-m", "rallypoint.run", "--log-dir",
                str(workdir / f"logs-{run}")]  # fmt: skip
    else:
        argv = [sys.executable, "-m", "torch.distributed.run"]
    argv += ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05", *flags, script]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return "ok"
    found = re.findall(r"killed by SIG\w+|Signal \d+ \(SIG\w+\)|exitcode\s*:\s*-?\d+", done.stderr)
    return f"status {done.returncode} ({found[0] if found else 'see stderr'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--figures", default=",".join(FIGURES))
    opts = parser.parse_args()
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="rallypoint-bench-exit-") as tmp:
        workdir = Path(tmp)
        # The function workers import the function by name; the scripts need no path.
        sys.path.insert(0, str(WORKER.parent))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(WORKER.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        for figure in opts.figures.split(","):
            parts = []
            for launcher in ("rallypoint", "torch"):
                ends: collections.Counter[str] = collections.Counter()
                for run in range(opts.runs):
                    if figure == "function":
                        ends[_function(launcher, workdir, run)] += 1
                    else:
                        ends[_command(launcher, figure, workdir, run)] += 1
                ok = ends.pop("ok", 0)
                others = ", ".join(f"{n} x {why}" for why, n in ends.most_common())
                part = f"{launcher} {ok}/{opts.runs} exit 0"
                parts.append(f"{part} ({others})" if others else part)
            print(f"{figure}: " + "; ".join(parts), flush=True)


if __name__ == "__main__":
    main()
