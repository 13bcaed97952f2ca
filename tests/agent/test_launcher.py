"""The launcher's flags and validation, the error file and failure report, and the API.

Fast tests: argument parsing runs in-process; a few real (tiny) worker processes
run through :func:`rallypoint.agent.elastic_launch`.
"""

from __future__ import annotations

import json
import operator
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rallypoint.agent import ConfigError, LaunchConfig, elastic_launch, record
from rallypoint.agent.api import WorkerFailedError
from rallypoint.agent.config import Std, parse_rdzv_endpoint, parse_std
from rallypoint.agent.errors import (
    ProcessFailure,
    format_failures,
    read_error_file,
    write_error_file,
)
from rallypoint.agent.launcher import build_parser, config_from_args, main, worker_argv

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--nnodes", "3:1"], "minimum is larger than the maximum"),
        (["--nnodes", "two"], "expected N or MIN:MAX"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
        (["--nproc-per-node", "many"], "expected N, gpu, xpu, cpu, auto"),
        (["--rdzv-backend", "zookeeper", "--rdzv-endpoint", "h:1"], "is unknown; use one of"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "host"], "needs host:port"),
        (["--rdzv-backend", "c10d"], "--rdzv-endpoint is required"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:x"], "is not a number"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "a"], "key=value"),
        (["-r", "7"], "expected 0-3"),
        (["-t", "5:1"], "out of range"),
        (["--local-ranks-filter", "x"], "expected e.g. 0,1"),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["--nnodes", "1:2"], "the static backend needs a fixed --nnodes"),
        (["--bogus-flag"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    args: list[str], expected: str, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*args, script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert err[0].startswith("rallypoint run: error:")


def test_missing_script_and_module(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--standalone", "/no/such/train.py"]) == 2
    assert "training script '/no/such/train.py' not found" in capsys.readouterr().err
    assert main(["--standalone", "-m", "no_such_module_xyz"]) == 2
    assert "module 'no_such_module_xyz' not found" in capsys.readouterr().err
    assert main(["--standalone", "--no-python", "no-such-program-xyz"]) == 2
    assert "program 'no-such-program-xyz' not found" in capsys.readouterr().err


def test_gpu_without_cuda_is_a_usage_error(
    script: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["--standalone", "--nproc-per-node", "gpu", script]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_gpu_binding_gives_each_rank_one_device(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = build_parser().parse_args(
        ["--standalone", "--nproc-per-node", "gpu", "--bind-gpus", script]
    )
    config = config_from_args(args)
    assert config.nproc_per_node == 2
    assert config.visible_devices == ("3", "5")


def test_module_entry_prints_one_line_without_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rallypoint.run", "--nnodes", "3:1", "x.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "rallypoint run: error: --nnodes 3:1: the minimum is larger than the maximum"
    ]


def test_flags_map_to_config(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("PET_MAX_RESTARTS", "4")  # torchrun's environment defaults
    args = build_parser().parse_args(
        [
            "--nnodes=2:4", "--nproc_per_node=3", "--rdzv-backend=etcd",
            "--rdzv-endpoint=etcd.example", "--rdzv-id=job", "--rdzv-conf=join_timeout=9, ttl=5",
            "--role=trainer", "-r", "0:1,2:3", "-t", "2", "--local-ranks-filter=0,2",
            "--monitor-interval=0.5", script, "--lr", "0.1",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 4, 3)
    assert config.max_restarts == 4
    assert config.rdzv_configs == {"join_timeout": "9", "ttl": "5"}
    assert parse_rdzv_endpoint(config.rdzv_endpoint, "etcd") == ("etcd.example", 2379)
    assert config.redirects == {0: Std.OUT, 1: Std.NONE, 2: Std.ALL}
    assert config.tee == {0: Std.ERR, 1: Std.ERR, 2: Std.ERR}
    assert config.local_ranks_filter == frozenset({0, 2})
    assert config.env == {"OMP_NUM_THREADS": "1"}
    assert config.role == "trainer"
    assert worker_argv(args) == [sys.executable, "-u", script, "--lr", "0.1"]


def test_standalone_overrides_rendezvous(script: str) -> None:
    args = build_parser().parse_args(
        ["--standalone", "--rdzv-backend", "etcd", "--rdzv-id", "x", script]
    )
    config = config_from_args(args)
    assert (config.rdzv_backend, config.min_nodes, config.max_nodes) == ("c10d", 1, 1)
    assert config.standalone and config.run_id != "x"


def test_worker_argv_modes(script: str) -> None:
    parse = build_parser().parse_args
    assert worker_argv(parse(["-m", "pkg.mod", "a"])) == [
        sys.executable,
        "-u",
        "-m",
        "pkg.mod",
        "a",
    ]
    assert worker_argv(parse(["--no-python", "echo", "a"])) == ["echo", "a"]
    run_path = worker_argv(parse(["--run-path", script, "a"]))
    assert run_path[-2:] == [os.path.abspath(script), "a"] and "run_path" in run_path[3]
    assert run_path[0] == sys.executable


def test_parse_helpers() -> None:
    assert parse_std("3", 2, "-t") == {0: Std.ALL, 1: Std.ALL}
    assert parse_rdzv_endpoint("[::1]:29400", "c10d") == ("::1", 29400)
    assert parse_rdzv_endpoint("h:0", "c10d") == ("h", 0)
    with pytest.raises(ConfigError, match="out of range"):
        parse_rdzv_endpoint("h:70000", "c10d")
    with pytest.raises(ConfigError, match="minimum is larger"):
        LaunchConfig(min_nodes=2, max_nodes=1, nproc_per_node=1)


# ---------------------------------------------------------------- error files


def test_record_writes_an_error_file_torch_can_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure as TorchFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    @record
    def train() -> None:
        raise KeyError("missing shard")

    with pytest.raises(KeyError):
        train()
    message, stack, when = read_error_file(str(error_file)) or ("", "", 0.0)
    assert message == "KeyError: 'missing shard'"
    assert "Traceback" in stack and "train" in stack and when > 0
    torch_view = TorchFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert torch_view.message["message"] == "KeyError: 'missing shard'"  # type: ignore[index]
    assert torch_view.timestamp == int(when)

    # The first error wins (a child's error file is the root cause); exit(0) is no error.
    write_error_file(str(error_file), ValueError("later"))
    assert json.loads(error_file.read_text())["message"]["message"].startswith("KeyError")

    @record
    def done() -> None:
        sys.exit(0)

    error_file.unlink()
    with pytest.raises(SystemExit):
        done()
    assert not error_file.exists()


def test_failure_table_puts_root_cause_first(tmp_path: Path) -> None:
    error_file = tmp_path / "e.json"
    try:
        raise RuntimeError("out of memory")
    except RuntimeError as exc:
        write_error_file(str(error_file), exc)
    recorded = ProcessFailure.from_exit(
        role="trainer", local_rank=1, global_rank=5, pid=42, exitcode=1,
        exit_time=1e12, error_file=str(error_file),
    )  # fmt: skip
    killed = ProcessFailure.from_exit(
        role="trainer", local_rank=0, global_rank=4, pid=41, exitcode=-signal.SIGKILL,
        exit_time=recorded.time + 5, error_file=str(tmp_path / "none.json"),
    )  # fmt: skip
    assert killed.message == "killed by SIGKILL"
    report = format_failures("train.py", [killed, recorded])
    lines = report.splitlines()
    root = next(i for i, line in enumerate(lines) if "root cause" in line)
    assert "5 (1)" in lines[root] and "RuntimeError: out of memory" in lines[root]
    assert "SIGKILL" in report and "4 (0)" in report
    assert (
        "Root cause (rank 5) traceback:" in report
        and 'raise RuntimeError("out of memory")' in report
    )
    assert str(WorkerFailedError("train.py", [killed, recorded])).startswith(
        "train.py failed: rank 5 (RuntimeError: out of memory)"
    )


# ---------------------------------------------------------------- the API


def _standalone(tmp_path: Path, **kw: object) -> LaunchConfig:
    return LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, standalone=True,
        monitor_interval=0.05, stop_grace=2.0, log_dir=str(tmp_path), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_elastic_launch_runs_a_function_on_every_worker(tmp_path: Path) -> None:
    results = elastic_launch(_standalone(tmp_path), operator.add)(2, 3)
    assert results == {0: 5, 1: 5}


def test_elastic_launch_raises_with_the_failures(tmp_path: Path) -> None:
    with pytest.raises(WorkerFailedError) as info:
        elastic_launch(_standalone(tmp_path, max_restarts=1), operator.truediv)(1, 0)
    failures = info.value.worker_failures
    assert {f.global_rank for f in failures} <= {0, 1} and failures
    assert failures[0].message == "ZeroDivisionError: division by zero"
    # Both attempts left their logs and error files per rank.
    assert len(list(tmp_path.glob("*/attempt_1/*/error.json"))) >= 1


def test_elastic_launch_rejects_what_cannot_be_imported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level"):
        elastic_launch(_standalone(tmp_path), lambda: 1)()
    with pytest.raises(ConfigError, match="JSON"):
        elastic_launch(_standalone(tmp_path), operator.add)(object(), 1)
