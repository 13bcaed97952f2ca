"""Function and ``--run-path`` workers end as the interpreter would (exit status,
error file, atexit handlers, non-daemon threads, flushed output) but without
finalizing it, so a gloo group left undestroyed cannot abort a finished worker.

``bench/worker_exit.py`` counts the aborts over many jobs; here a few jobs check
that such a worker finishes, and the exit path itself is checked directly.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rallypoint.agent import LaunchConfig, elastic_launch
from rallypoint.agent.worker.function import ARGS_ENV, FUNCTION_ENV, RETURN_ENV

# Leaves a mark for each exit step it reaches: atexit handler, non-daemon thread, and
# the finalizer of a module global (which must not run: no interpreter finalization).
SCRIPT = """
import atexit, os, sys, threading, time

OUT = os.environ["MARKS"]


def mark(name):
    with open(os.path.join(OUT, name), "w") as fp:
        fp.write(name)


class Finalized:
    def __del__(self):
        mark("finalized")


KEEP = Finalized()
atexit.register(mark, "atexit")


def late():
    time.sleep(0.2)
    mark("thread")


threading.Thread(target=late).start()
print("printed", end="")  # no newline: only a flush shows it


def run(mode):
    if mode == "exit3":
        sys.exit(3)
    if mode == "message":
        sys.exit("a message")
    if mode == "raise":
        raise ValueError("boom")
    if mode == "interrupt":
        raise KeyboardInterrupt
    return {"mode": mode}


if __name__ == "__main__":
    run(sys.argv[1])
"""

RUN_PATH = (
    "import sys; from rallypoint.agent.worker.function import run_path; "
    "run_path(sys.argv[1], sys.argv[2:])"
)

#: mode -> (exit status as subprocess reports it, whether an error file is written)
ENDS = {
    "ok": (0, False),
    "exit3": (3, True),
    "message": (1, True),
    "raise": (1, True),
    "interrupt": (-signal.SIGINT, True),
}


def _run(tmp_path: Path, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    marks = tmp_path / "marks"
    marks.mkdir()
    full = {**os.environ, **env, "MARKS": str(marks),
            "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}  # fmt: skip
    return subprocess.run(argv, env=full, capture_output=True, text=True, timeout=60)


def _check_end(tmp_path: Path, done: subprocess.CompletedProcess[str], mode: str) -> None:
    status, error_file = ENDS[mode]
    assert done.returncode == status, done.stderr
    assert done.stdout == "printed"
    assert sorted(p.name for p in (tmp_path / "marks").iterdir()) == ["atexit", "thread"]
    assert (tmp_path / "error.json").exists() is error_file
    if mode == "message":
        assert done.stderr.strip() == "a message"
    if mode == "raise":
        assert done.stderr.strip().endswith("ValueError: boom")


@pytest.mark.parametrize("mode", list(ENDS))
def test_a_run_path_worker_ends_like_the_interpreter_but_unfinalized(
    tmp_path: Path, mode: str
) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = _run(tmp_path, [sys.executable, "-c", RUN_PATH, str(script), mode], {})
    _check_end(tmp_path, done, mode)


@pytest.mark.parametrize("mode", ["ok", "exit3", "raise"])
def test_a_function_worker_ends_like_the_interpreter_but_unfinalized(
    tmp_path: Path, mode: str
) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    returned = tmp_path / "return.json"
    env = {
        FUNCTION_ENV: f"{script}:run",
        ARGS_ENV: json.dumps({"args": [mode], "kwargs": {}}),
        RETURN_ENV: str(returned),
    }
    done = _run(tmp_path, [sys.executable, "-m", "rallypoint.agent.worker.function"], env)
    _check_end(tmp_path, done, mode)
    if mode == "ok":
        assert json.loads(returned.read_text()) == {"mode": "ok"}
    else:
        assert not returned.exists()


#: a worker that never destroys its gloo group (its teardown at exit can abort)
GLOO_SUM = Path(__file__).resolve().parents[1] / "helpers" / "gloo_sum.py"
RUNS = 2  # a few jobs; bench/worker_exit.py runs many


@pytest.mark.integration
def test_workers_that_leave_a_gloo_group_undestroyed_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The function workers import the function by its module's name.
    monkeypatch.syspath_prepend(str(GLOO_SUM.parent))
    paths = [str(GLOO_SUM.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")
    sum_ranks = importlib.import_module("gloo_sum").sum_ranks
    for run in range(RUNS):
        logs = tmp_path / f"logs{run}"
        done = subprocess.run(
            [sys.executable, "-m", "rallypoint.run", "--standalone", "--nproc-per-node", "2",
             "--monitor-interval", "0.05", "--log-dir", str(logs), "--run-path",
             str(GLOO_SUM)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert sorted(done.stdout.split()) == ["3", "3", "sum", "sum"], done.stdout
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=2, standalone=True,
            monitor_interval=0.05, log_dir=str(logs),
        )  # fmt: skip
        assert elastic_launch(config, sum_ranks)() == {0: 3, 1: 3}
