"""torchrun parity: ``torchrun ARGS`` and ``rallypoint run ARGS`` behave alike.

Written from torchrun's documented behaviour (torch 2.13's ``torch/distributed/run.py``
and the elastic agent). The integration tests run the installed torch's real
launcher (``python -m torch.distributed.run``) and ``rallypoint run`` on the same
small worker (tests/helpers/torchrun_parity_worker.py) on 127.0.0.1 and compare what the
workers saw: their environment, the console prefixes, the duplicated lines, the
events, the log files, the exit status. Where rallypoint differs on purpose, the
test names the difference, and docs/agent.md ("Differences from torchrun") lists it.

Every launcher runs in a session of its own with a unique environment mark; the
``launchers`` fixture kills each one's process tree at teardown and checks that no
marked process is left.
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from helpers.cluster import kill_tree, marked_processes

from rallypoint.agent import ConfigError, LaunchConfig, elastic_launch
from rallypoint.agent.launcher import build_parser, config_from_args, main

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
WORKER = HELPERS / "torchrun_parity_worker.py"
MARK_ENV = "RALLYPOINT_PARITY_MARK"
WAIT = 120.0

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RALLYPOINT = [sys.executable, "-m", "rallypoint.run"]

#: What rallypoint adds to the worker environment (docs/agent.md, "Worker environment").
ADDITIONS = {"RALLYPOINT_ROUND", "RALLYPOINT_WORKER_TOKEN"}
#: Values that differ between any two runs (ports, ids, paths), compared by shape.
PER_RUN = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


# ------------------------------------------------------------------ running both


@dataclass
class Run:
    """One launcher's run: exit status, output, and what its workers wrote."""

    rc: int
    stdout: str
    stderr: str
    out: Path

    def env(self, rank: int) -> dict[str, str]:
        env: dict[str, str] = json.loads((self.out / f"env.{rank}.json").read_text())
        return env

    def lines(self, stream: str, start: str = "[") -> list[str]:
        text = self.stdout if stream == "stdout" else self.stderr
        return sorted(line for line in text.splitlines() if line.startswith(start))


class Launchers:
    """Starts launchers for one test; kills all of them (and their workers) at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.mark = uuid.uuid4().hex
        self.popens: list[subprocess.Popen[bytes]] = []

    def start(
        self, launcher: list[str], args: list[str], name: str, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], Path]:
        out = self.dir / name
        out.mkdir()
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
        full_env.pop("OMP_NUM_THREADS", None)
        full_env.update(env or {})
        full_env.update({MARK_ENV: self.mark, "PARITY_OUT": str(out)})
        full_env["PYTHONPATH"] = os.pathsep.join(
            filter(
                None,
                [full_env.get("PYTHONPATH_FIRST", ""), os.environ.get("PYTHONPATH"), str(HELPERS)],
            )
        )
        stdout = open(out / "launcher.stdout", "wb")  # noqa: SIM115
        stderr = open(out / "launcher.stderr", "wb")  # noqa: SIM115
        with stdout, stderr:
            popen = subprocess.Popen(
                [*launcher, *args],
                stdout=stdout,
                stderr=stderr,
                env=full_env,
                cwd=out,
                start_new_session=True,
            )
        self.popens.append(popen)
        return popen, out

    def run(
        self, launcher: list[str], args: list[str], name: str, env: dict[str, str] | None = None
    ) -> Run:
        popen, out = self.start(launcher, args, name, env)
        try:
            rc = popen.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.kill(popen)
            pytest.fail(f"{name}: {launcher[-1]} did not exit in {WAIT} s")
        return self.result(rc, out)

    @staticmethod
    def result(rc: int, out: Path) -> Run:
        return Run(
            rc,
            (out / "launcher.stdout").read_text(errors="replace"),
            (out / "launcher.stderr").read_text(errors="replace"),
            out,
        )

    def both(
        self,
        args: list[str],
        name: str,
        env: dict[str, str] | None = None,
        *,
        rallypoint_args: list[str] | None = None,
        rallypoint_env: dict[str, str] | None = None,
    ) -> tuple[Run, Run]:
        """The same command line under torchrun and under rallypoint run."""
        torch_run = self.run(TORCHRUN, [*args, str(WORKER)], f"{name}-torchrun", env)
        ours = [*(rallypoint_args if rallypoint_args is not None else args), str(WORKER)]
        ours_env = {**(env or {}), **(rallypoint_env or {})}
        return torch_run, self.run(RALLYPOINT, ours, f"{name}-rallypoint", ours_env)

    def kill(self, popen: subprocess.Popen[bytes]) -> None:
        kill_tree(popen)

    def marked(self) -> list[psutil.Process]:
        return marked_processes(MARK_ENV, self.mark)

    def kill_all(self) -> None:
        for popen in self.popens:
            self.kill(popen)
        for proc in self.marked():
            with contextlib.suppress(psutil.Error):
                proc.kill()


@pytest.fixture
def launchers(tmp_path: Path) -> Iterator[Launchers]:
    procs = Launchers(tmp_path)
    try:
        yield procs
    finally:
        procs.kill_all()
    deadline = time.monotonic() + 10
    while procs.marked() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert procs.marked() == [], "a launcher left processes behind"


def _wait_for(path_glob: tuple[Path, str], count: int, popen: subprocess.Popen[bytes]) -> None:
    folder, pattern = path_glob
    deadline = time.monotonic() + WAIT
    while len(list(folder.glob(pattern))) < count:
        if popen.poll() is not None:
            pytest.fail(f"the launcher exited {popen.returncode} before {pattern} appeared")
        if time.monotonic() > deadline:
            pytest.fail(f"no {count} x {pattern} in {folder} after {WAIT} s")
        time.sleep(0.05)


def _compare_env(
    torch_run: Run, ours: Run, ranks: int, differ: frozenset[str] = frozenset()
) -> None:
    """The same variables (but rallypoint's documented additions), the same values
    (but per-run ones, compared by shape, and ``differ``)."""
    for rank in range(ranks):
        # PARITY_MODE (what the worker does) is the test's, not the launcher's.
        theirs, mine = torch_run.env(rank), ours.env(rank)
        theirs.pop("PARITY_MODE", None)
        mine.pop("PARITY_MODE", None)
        assert set(mine) - set(theirs) == ADDITIONS, sorted(set(mine) ^ set(theirs))
        assert set(theirs) - set(mine) == set()
        for key in sorted(set(theirs) - PER_RUN - differ - {"PARITY_OUT"}):
            assert mine[key] == theirs[key], (key, theirs[key], mine[key])
        for env in (theirs, mine):
            assert env["TORCHELASTIC_RUN_ID"] not in ("", "none")
            assert 0 < int(env["MASTER_PORT"]) < 65536
            assert re.search(r"/attempt_0/[0-9]+/error\.json$", env["TORCHELASTIC_ERROR_FILE"])


# ------------------------------------------------------------------ the flags


def test_help_lists_every_torchrun_flag() -> None:
    """Every option of the installed torchrun is an option of rallypoint run, under the
    same name, with the same destination (so ``PET_<DEST>`` means the same), the same
    environment default rule, default value and choices; and ``--help`` shows it."""
    from torch.distributed.run import get_args_parser

    theirs = {s: a for a in get_args_parser()._actions for s in a.option_strings}
    ours = {s: a for a in build_parser()._actions for s in a.option_strings}
    missing = sorted(set(theirs) - set(ours))
    assert missing == [], f"torchrun flags rallypoint run lacks: {missing}"
    shown = build_parser().format_help()
    for option, action in theirs.items():
        mine = ours[option]
        assert option in shown, option
        assert mine.dest == action.dest, option
        assert (mine.default, mine.choices) == (action.default, action.choices), option
        # torchrun's env/check_env actions read PET_<DEST>; rallypoint's do the same.
        reads_env = type(action).__name__ in ("env", "check_env")
        assert (type(mine).__name__ in ("_EnvDefault", "_EnvFlag")) == reads_env, option


def test_fixed_choices_are_the_installed_torchs() -> None:
    from torch.numa.binding import AffinityMode

    from rallypoint.agent.config import NUMA_BINDING_MODES, START_METHODS

    assert tuple(mode.value for mode in AffinityMode) == NUMA_BINDING_MODES
    assert START_METHODS == ("spawn", "fork", "forkserver")


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def _config(*argv: str) -> LaunchConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_new_flags_reach_the_config(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    config = _config(
        "--standalone", "--signals-to-handle", "SIGUSR1, SIGTERM", "--shutdown-timeout", "7",
        "--virtual-local-rank", "--duplicate-stdout-filters", "a,,b,c",
        "--duplicate-stderr-filters", "err", "--event-log-handler", "console",
        "--start-method", "fork", script,
    )  # fmt: skip
    assert config.stop_signals == (signal.SIGUSR1, signal.SIGTERM)
    assert config.signals_to_handle == "SIGUSR1, SIGTERM"  # exported as given, as torch does
    assert config.stop_grace == 7.0
    assert config.virtual_local_rank
    assert config.duplicate_stdout_filters == ["a,b", "c"]  # ",," is a literal comma
    assert config.duplicate_stderr_filters == ["err"]
    assert (config.event_log_handler, config.start_method) == ("console", "fork")


def test_shutdown_timeout_follows_torch(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "9")
    assert _config(script).stop_grace == 9.0  # torch's variable, when no flag is given
    assert _config("--shutdown-timeout", "2", script).stop_grace == 2.0
    assert _config("--stop-grace", "0.5", script).stop_grace == 0.5  # rallypoint's spelling
    assert LaunchConfig(1, 1, 1).stop_grace == 9.0  # the API reads it too, as torch's
    assert LaunchConfig(1, 1, 1, shutdown_timeout=3).stop_grace == 3.0
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "4")
    assert _config(script).stop_grace == 4.0
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT")
    with pytest.raises(ConfigError, match="disagree"):
        _config("--shutdown-timeout", "2", "--stop-grace", "3", script)
    with pytest.raises(ConfigError, match="--shutdown-timeout must be between 0"):
        _config("--shutdown-timeout", "-1", script)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon'"):
        _config(script)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--signals-to-handle", "SIGTERM,SIGBOGUS"], "'SIGBOGUS' is not a signal name"),
        (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot be caught"),
        (["--numa-binding", "nearby"], "invalid choice: 'nearby'"),
        (["--event-log-handler", "nowhere"], "--event-log-handler 'nowhere': unknown"),
        (["--logs-specs", "no-such-specs"], "no such torchrun.logs_specs entry point"),
        (["--shutdown-timeout", "1.5"], "invalid int value"),
        (["--start-method", "thread"], "invalid choice: 'thread'"),
        (["--nproc-per-node", "many"], "expected N, gpu, xpu, cpu, auto"),
    ],
)
def test_bad_values_of_torchrun_flags_exit_2(
    argv: list[str], expected: str, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--standalone", *argv, script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


# ------------------------------------------------------------------ devices


class _Devices:
    """A fake torch device inventory, patched into torch for one test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cuda: int, xpu: int) -> None:
        import torch

        kind = "cuda" if cuda else "xpu" if xpu else None
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
        monkeypatch.setattr(torch.xpu, "is_available", lambda: xpu > 0)
        monkeypatch.setattr(torch.xpu, "device_count", lambda: xpu)
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: kind is not None)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: cuda or xpu)
        monkeypatch.setattr(
            torch.accelerator,
            "current_accelerator",
            lambda *a, **k: torch.device(kind) if kind else None,
        )
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize(("cuda", "xpu"), [(0, 0), (2, 0), (0, 3)])
@pytest.mark.parametrize("value", ["auto", "gpu", "xpu", "cpu", "5"])
def test_nproc_per_node_counts_devices_as_torchrun(
    cuda: int, xpu: int, value: str, script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--nproc-per-node`` resolves like torch's ``determine_local_world_size``:
    ``auto`` counts the devices of torch's current accelerator (XPU too)."""
    from torch.distributed.run import determine_local_world_size

    _Devices(monkeypatch, cuda, xpu)
    try:
        expected: int | None = determine_local_world_size(value)
    except ValueError:
        expected = None
    if expected is None:
        with pytest.raises(ConfigError, match=f"--nproc-per-node {value}"):
            _config("--standalone", "--nproc-per-node", value, script)
    else:
        assert _config("--standalone", "--nproc-per-node", value, script).nproc_per_node == (
            expected
        )


# ------------------------------------------------------------------ worker launches


def _launches(config: LaunchConfig, **assignment: Any) -> list[Any]:
    from rallypoint.agent.agent import Assignment, ElasticAgent

    agent = ElasticAgent(config, [sys.executable, "-u", "train.py"], object())  # type: ignore[arg-type]
    fields: dict[str, Any] = {
        "round": 0, "group_rank": 0, "group_world_size": 1, "base_global_rank": 0,
        "world_size": config.nproc_per_node, "base_role_rank": 0,
        "role_world_size": config.nproc_per_node, "master_addr": "127.0.0.1",
        "master_port": 29400, "use_agent_store": False,
    }  # fmt: skip
    fields.update(assignment)
    return agent._launches(Assignment(**fields))


@pytest.mark.parametrize("visible", [None, "4,6,7"])
def test_virtual_local_rank_sets_the_environment_as_torch(
    visible: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = LaunchConfig(1, 1, 3, virtual_local_rank=True, log_dir=str(tmp_path))
    spec = SimpleNamespace(virtual_local_rank=True)
    for launch in _launches(config):
        theirs: dict[str, str | None] = {}
        LocalElasticAgent._set_local_rank_env(None, theirs, launch.local_rank, spec)  # type: ignore[arg-type]
        assert {k: launch.env[k] for k in theirs} == theirs


def test_virtual_local_rank_needs_a_device_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError, match="--virtual-local-rank: 3 workers"):
        LaunchConfig(1, 1, 3, virtual_local_rank=True)


def test_numa_binding_without_a_gpu_is_refused_before_anything_starts(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    assert main(["--standalone", "--numa-binding", "node", script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--numa-binding node: cannot bind local rank 0" in err[0], err


def test_numa_binding_wraps_each_worker_as_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker command gets torch's ``numactl --physcpubind=...`` prefix, with the
    CPUs torch's topology code picks for the local rank's device (faked here: no GPU)."""
    from torch.numa import binding

    cpus = {0: {0, 1, 2, 5}, 1: {8, 9, 10, 11}}
    monkeypatch.setattr(
        binding,
        "_get_validated_logical_cpus_to_bind_to",
        lambda *, gpu_index, numa_options: cpus[gpu_index],
    )
    options = binding.NumaOptions(affinity_mode=binding.AffinityMode.NODE)
    config = LaunchConfig(1, 1, 2, numa_options=options, log_dir=str(tmp_path))
    for launch in _launches(config):
        command = (sys.executable, "-u", "train.py")
        expected = binding._maybe_wrap_command_args_with_numa_binding(
            command, gpu_index=launch.local_rank, numa_options=options
        )
        assert tuple(launch.argv) == expected


def test_console_prefix_and_template(tmp_path: Path) -> None:
    config = LaunchConfig(1, 1, 2, role="trainer", log_dir=str(tmp_path))
    prefixes = [launch.prefix for launch in _launches(config, base_global_rank=4)]
    assert prefixes == ["[trainer0]:", "[trainer1]:"]  # torch: role and LOCAL rank
    template = "[${role_name}|${rank}|${local_rank}|${other}] "
    config = LaunchConfig(
        1, 1, 2, role="t", log_line_prefix_template=template, log_dir=str(tmp_path)
    )
    prefixes = [launch.prefix for launch in _launches(config, base_global_rank=4)]
    assert prefixes == ["[t|4|0|${other}] ", "[t|5|1|${other}] "]


# ------------------------------------------------------------------ the Python API


def test_launch_config_takes_torchs_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.launcher.api import LaunchConfig as TorchLaunchConfig

    config = LaunchConfig(1, 1, 1, run_id="", start_method="forkserver")
    assert config.run_id.isdigit() and config.start_method == "forkserver"
    with pytest.raises(ConfigError, match="--start-method 'thread'"):
        LaunchConfig(1, 1, 1, start_method="thread")
    # Every field of torch's LaunchConfig but two exists here (docs/agent.md).
    theirs = set(TorchLaunchConfig.__dataclass_fields__)
    assert theirs - set(LaunchConfig.__dataclass_fields__) == {"rdzv_timeout", "metrics_cfg"}


@pytest.mark.integration
def test_static_api_uses_the_rdzv_endpoint(tmp_path: Path, free_port: Any) -> None:
    """torch's API: with the static backend the store is ``rdzv_endpoint``."""
    port = free_port()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=1, rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}", monitor_interval=0.05, log_dir=str(tmp_path),
    )  # fmt: skip
    assert elastic_launch(config, os.getenv)("MASTER_PORT") == {0: str(port)}


@pytest.mark.integration
def test_elastic_launch_failure_is_torchs_child_failed_error(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from rallypoint.agent.api import WorkerFailedError

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, standalone=True,
        monitor_interval=0.05, log_dir=str(tmp_path),
    )  # fmt: skip
    with pytest.raises(ChildFailedError) as info:
        elastic_launch(config, operator.truediv)(1, 0)
    assert isinstance(info.value, WorkerFailedError)
    rank, failure = info.value.get_first_failure()
    assert rank in (0, 1) and failure.exitcode == 1
    assert failure.message["message"] == "ZeroDivisionError: division by zero"
    assert "ZeroDivisionError" in info.value.format_msg()
    assert info.value.worker_failures[0].message == "ZeroDivisionError: division by zero"


# ------------------------------------------------------------------ both launchers


@pytest.mark.integration
def test_same_environment_prefixes_filters_events_and_exit_code(launchers: Launchers) -> None:
    """One failing run (rank 1 exits 3) with most of torchrun's flags at once."""
    args = [
        "--standalone", "--nproc-per-node", "2", "-t", "3", "--virtual-local-rank",
        "--signals-to-handle", "SIGUSR1,SIGTERM", "--monitor-interval", "0.05",
        "--duplicate-stdout-filters", "hello,,world", "--duplicate-stderr-filters", "oops",
        "--event-log-handler", "console", "--log-dir", "logs",
    ]  # fmt: skip
    env = {"PARITY_MODE": "exit3", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    torch_run, ours = launchers.both(args, "tee", env)
    assert (torch_run.rc, ours.rc) == (1, 1)
    _compare_env(torch_run, ours, 2)
    assert ours.env(1)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGUSR1,SIGTERM"
    assert [ours.env(r)["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["0", "1"]
    # Console prefixes: torch's [<role><local rank>]:, on both streams.
    assert ours.lines("stdout") == torch_run.lines("stdout") == [
        "[default0]:hello only 0", "[default0]:hello,world from 0",
        "[default1]:hello only 1", "[default1]:hello,world from 1",
    ]  # fmt: skip
    assert ours.lines("stderr", "[default") == torch_run.lines("stderr", "[default") == [
        "[default0]:oops on stderr 0", "[default1]:oops on stderr 1",
    ]  # fmt: skip
    # The duplicated lines, in the attempt directory, as torch writes them.
    for stream, expected in (
        ("stdout", ["[default0]:hello,world from 0", "[default1]:hello,world from 1"]),
        ("stderr", ["[default0]:oops on stderr 0", "[default1]:oops on stderr 1"]),
    ):
        for run in (torch_run, ours):
            (found,) = (run.out / "logs").glob(f"*/attempt_0/filtered_{stream}.log")
            assert sorted(found.read_text().splitlines()) == expected
    # torch's events: the same names, sources, ranks, states and exit codes.
    assert _events(ours) == _events(torch_run) - _DURATION_EVENTS


_DURATION_EVENTS = {
    ("RENDEZVOUS", "AGENT", None, None),
    ("ASSIGN_WORKER_RANKS", "AGENT", None, None),
}


def _events(run: Run) -> set[tuple[str, str, int | None, int | None]]:
    found = set()
    for line in run.stderr.splitlines():
        if line.startswith("{") and "torchelastic.worker.status" in line:
            event = json.loads(line)
            extra = json.loads(event["metadata"]["metadata"])
            exit_code = extra.get("exit_code", [None])[0]
            found.add(
                (event["metadata"]["state"], event["source"], event["metadata"]["global_rank"],
                 exit_code)
            )  # fmt: skip
    return found


@pytest.mark.integration
def test_plain_single_node_command_and_a_killed_worker(launchers: Launchers) -> None:
    """``torchrun --nproc-per-node 2 train.py``: torch 2.13 runs a single node without
    a given port on c10d on a free port (not 29500, not run id "none"); a worker
    killed by a signal fails the job with status 1."""
    torch_run, ours = launchers.both(["--nproc-per-node", "2"], "plain", {"PARITY_MODE": "kill"})
    assert (torch_run.rc, ours.rc) == (1, 1)
    # Documented: rallypoint's rendezvous gives each round a fresh store that rank 0's
    # first worker hosts (what torch does with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
    _compare_env(torch_run, ours, 2, differ=frozenset({"TORCHELASTIC_USE_AGENT_STORE"}))
    assert ours.env(0)["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert torch_run.env(0)["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert ours.env(0)["OMP_NUM_THREADS"] == torch_run.env(0)["OMP_NUM_THREADS"] == "1"
    assert ours.env(0)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


@pytest.mark.integration
@pytest.mark.parametrize("share", [True, False])
def test_torchs_handler_shares_the_agent_store_unless_disabled(
    share: bool, launchers: Launchers, free_port: Any
) -> None:
    """On torch's c10d rendezvous the workers use the rank-0 agent's store
    (TORCHELASTIC_USE_AGENT_STORE=True) unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    as under torchrun; either way rallypoint's workers form a process group through
    it (torch's own are not re-tested). Also: the console prefix template."""
    port = free_port()
    common = [
        "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "parity", "--monitor-interval", "0.05", "-t", "1",
    ]  # fmt: skip
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}|${local_rank}]: "}
    if not share:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    torch_run, ours = launchers.both(
        ["--rdzv-backend", "c10d", *common],
        f"store-{share}",
        env,
        rallypoint_args=["--rdzv-backend", "torch-c10d", *common],
        rallypoint_env={"PARITY_MODE": "pg"},
    )
    assert (torch_run.rc, ours.rc) == (0, 0), ours.stderr[-3000:]
    _compare_env(torch_run, ours, 2)
    assert ours.env(1)["TORCHELASTIC_USE_AGENT_STORE"] == str(share)
    assert [(ours.out / f"sum.{r}").read_text() for r in (0, 1)] == ["2", "2"]
    assert ours.lines("stdout") == torch_run.lines("stdout")
    assert "[rank1|1]: hello only 1" in ours.lines("stdout")


@pytest.mark.integration
def test_logs_specs_plugin_decides_where_output_goes(launchers: Launchers) -> None:
    """``--logs-specs NAME`` loads the ``torchrun.logs_specs`` entry point NAME, as
    torchrun does; both launchers write the same files through it."""
    site = launchers.dir / "site"
    info = site / "parity_logs_specs-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: parity-logs-specs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[torchrun.logs_specs]\nfixed = torchrun_parity_logs_specs:FixedLogsSpecs\n"
    )
    args = ["--standalone", "--nproc-per-node", "2", "--logs-specs", "fixed", "-r", "3",
            "--log-dir", "logs"]  # fmt: skip
    torch_run, ours = launchers.both(args, "specs", {"PYTHONPATH_FIRST": str(site)})
    assert (torch_run.rc, ours.rc) == (0, 0), ours.stderr[-3000:]
    for run in (torch_run, ours):
        fixed = run.out / "logs" / "fixed" / "attempt_0"
        assert (fixed / "1" / "stdout.log").read_text() == ("hello,world from 1\nhello only 1\n")
        assert (fixed / "0" / "stderr.log").read_text() == "oops on stderr 0\n"
        error_file = Path(run.out, run.env(1)["TORCHELASTIC_ERROR_FILE"])
        assert error_file.resolve() == (fixed / "1" / "error.json").resolve()
        assert "hello only" not in run.stdout  # redirected, not shown


def _stop_with(launchers: Launchers, name: str, sig: signal.Signals, *args: str, **env: str) -> Run:
    popen, out = launchers.start(
        RALLYPOINT,
        ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05", *args,
         str(WORKER)],
        name,
        {"PARITY_MODE": "sleep", **env},
    )  # fmt: skip
    _wait_for((out, "ready.*"), 2, popen)
    popen.send_signal(sig)
    try:
        rc = popen.wait(timeout=WAIT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the agent did not stop on {sig.name}")
    return Launchers.result(rc, out)


@pytest.mark.integration
def test_signals_to_handle_and_shutdown_timeout(launchers: Launchers) -> None:
    """A signal named by ``--signals-to-handle`` stops the workers gracefully (the
    signal itself, forwarded, then the shutdown timeout, here
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, for the worker's 2 s of cleanup) and the agent
    exits 128 + the signal; ``--shutdown-timeout 0`` SIGKILLs such a worker at once."""
    run = _stop_with(
        launchers, "graceful", signal.SIGUSR1, "--signals-to-handle", "SIGUSR1,SIGTERM",
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT="60",
    )  # fmt: skip
    assert run.rc == 128 + signal.SIGUSR1, run.stderr[-3000:]
    assert sorted(p.name for p in run.out.glob("survived.*")) == ["survived.0", "survived.1"]
    # forwarded as itself, as torchrun does
    assert sorted(p.name for p in run.out.glob("signal.*")) == [
        "signal.0.SIGUSR1",
        "signal.1.SIGUSR1",
    ]
    assert run.env(0)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGUSR1,SIGTERM"
    run = _stop_with(
        launchers, "at-once", signal.SIGUSR1, "--signals-to-handle", "SIGUSR1",
        "--shutdown-timeout", "0",
    )  # fmt: skip
    assert run.rc == 128 + signal.SIGUSR1, run.stderr[-3000:]
    assert list(run.out.glob("survived.*")) == []
