"""The pre-flight health check (``rallypoint.agent.health``) on its own.

The check's configuration and the failure window are pure and tested directly; the
check itself starts real processes (a torch worker, a user command, two nodes'
checks meeting on 127.0.0.1), so those tests are marked ``integration``. Every
test checks that it left no process behind.
"""

from __future__ import annotations

import math
import signal
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from torch.distributed import TCPStore

from rallypoint.agent.health import (
    FailureWindow,
    HealthCheckConfig,
    HealthCheckConfigError,
    HealthResult,
    run_health_check,
)

#: No subprocess test may take longer than this (it only catches hangs).
HANG_BOUND = 60.0


@pytest.fixture(autouse=True)
def _no_process_left_behind() -> Iterator[None]:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 10
    while True:
        left = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and _alive(p)
        ]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _env(rank: int = 0, world_size: int = 1, port: int = 1) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
    }


def _check(config: HealthCheckConfig, env: Mapping[str, str]) -> HealthResult:
    started = time.monotonic()
    result = run_health_check(config, round_env=env, device="cpu")
    assert time.monotonic() - started < HANG_BOUND
    return result


def _concurrently(*calls: Callable[[], HealthResult]) -> list[HealthResult]:
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result(timeout=HANG_BOUND) for f in futures]


# --- configuration ----------------------------------------------------------------


def test_defaults_are_valid() -> None:
    config = HealthCheckConfig(enabled=True)
    assert config.timeout == 60.0
    assert config.collective is True
    assert config.command is None and config.callable is None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": -5}, "timeout"),
        ({"timeout": math.nan}, "timeout"),
        ({"timeout": math.inf}, "timeout"),
        ({"timeout": 8 * 24 * 3600}, "timeout"),
        ({"timeout": 0.5}, "at least 1"),
        ({"timeout": True}, "timeout"),
        ({"timeout": "60"}, "timeout"),
        ({"import_timeout": 0}, "import_timeout"),
        ({"import_timeout": math.nan}, "import_timeout"),
        ({"import_timeout": 0.5}, "import_timeout must be at least 1"),
        ({"enabled": "yes"}, "enabled"),
        ({"collective": 1}, "collective"),
        ({"command": ""}, "command"),
        ({"command": "   "}, "command"),
        ({"command": "echo \0"}, "NUL"),
        ({"command": 3}, "command"),
        ({"callable": "mymodule"}, "module:function"),
        ({"callable": ":check"}, "module:function"),
        ({"callable": "mymodule:"}, "module:function"),
        ({"callable": "my module:check"}, "module:function"),
        ({"callable": "mymodule:1check"}, "module:function"),
        ({"callable": 5}, "callable"),
    ],
)
def test_bad_config_is_a_typed_error(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(HealthCheckConfigError, match=needle) as info:
        HealthCheckConfig(**{"enabled": True, **kwargs})  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("field", ["command", "callable"])
def test_a_user_check_without_enabled_is_an_error(field: str) -> None:
    with pytest.raises(HealthCheckConfigError, match="enabled"):
        HealthCheckConfig(enabled=False, **{field: "pkg.mod:check"})  # type: ignore[arg-type]


def test_valid_user_checks_are_accepted() -> None:
    HealthCheckConfig(enabled=True, callable="pkg.sub_mod:Checks.run", command="nvidia-smi")
    HealthCheckConfig(enabled=True, callable="/opt/checks/gpu.py:check")


def test_disabled_check_passes_without_running_anything() -> None:
    result = run_health_check(HealthCheckConfig(), round_env={}, device="cpu")
    assert result.ok and result.stage == "" and result.fault == "none"
    assert not result.exclude_self


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
        ({"MASTER_ADDR": "h", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "x", "RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "2", "WORLD_SIZE": "2"}, "RANK"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "a", "WORLD_SIZE": "2"}, "RANK"),
    ],
)
def test_bad_round_env_is_refused_before_anything_runs(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        run_health_check(HealthCheckConfig(enabled=True), round_env=env, device="cpu")


# --- the failure window -------------------------------------------------------------


def test_failure_window_counts_failures_within_the_window() -> None:
    window = FailureWindow(limit=3, window=10.0)
    assert window.record(0.0) is False
    assert window.record(5.0) is False
    assert window.count(5.0) == 2
    # 11 s after the first: it has left the window, so two remain with this one.
    assert window.record(11.0) is False
    assert window.count(11.0) == 2
    assert window.record(12.0) is True


def test_failure_window_edge_is_inclusive_and_resets_after_firing() -> None:
    window = FailureWindow(limit=2, window=10.0)
    assert window.record(0.0) is False
    assert window.record(10.0) is True  # exactly `window` seconds apart still counts
    # Firing empties the window: the next exclusion needs `limit` new failures.
    assert window.count(10.0) == 0
    assert window.record(10.5) is False
    assert window.record(11.0) is True


def test_failure_window_limit_one_fires_at_once_and_reset_forgets() -> None:
    assert FailureWindow(limit=1, window=1.0).record(100.0) is True
    window = FailureWindow(limit=2, window=60.0)
    window.record(1.0)
    window.reset()
    assert window.record(2.0) is False


def test_failure_window_tolerates_a_clock_that_goes_back() -> None:
    window = FailureWindow(limit=2, window=5.0)
    assert window.record(100.0) is False
    assert window.record(99.0) is True


@pytest.mark.parametrize(
    ("limit", "window", "needle"),
    [
        (0, 10.0, "limit"),
        (True, 10.0, "limit"),
        (2.5, 10.0, "limit"),
        (2, 0.0, "window"),
        (2, -1.0, "window"),
        (2, math.nan, "window"),
        (2, math.inf, "window"),
    ],
)
def test_failure_window_refuses_bad_settings(limit: object, window: object, needle: str) -> None:
    with pytest.raises(HealthCheckConfigError, match=needle):
        FailureWindow(limit=limit, window=window)  # type: ignore[arg-type]


# --- the check itself ---------------------------------------------------------------


@pytest.mark.integration
def test_builtin_check_passes_on_a_single_node() -> None:
    result = _check(HealthCheckConfig(enabled=True, timeout=30), _env())
    assert result.ok, result
    assert result.stage == "" and result.fault == "none" and result.peers == ()
    assert "matmul" in result.reason
    assert 0 < result.seconds < HANG_BOUND


@pytest.mark.integration
def test_two_nodes_pass_the_collective(free_port: Callable[[], int]) -> None:
    port = free_port()
    config = HealthCheckConfig(enabled=True, timeout=30)
    results = _concurrently(
        lambda: _check(config, _env(0, 2, port)), lambda: _check(config, _env(1, 2, port))
    )
    for result in results:
        assert result.ok, result
        assert "all-reduce among 2 nodes (gloo)" in result.reason
    # The round's first worker hosts its store on the same port right after.
    store = TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10))
    store.set("after", "ok")
    del store


@pytest.mark.integration
def test_a_node_that_never_shows_up_is_blamed_within_the_timeout(
    free_port: Callable[[], int],
) -> None:
    # Ranks 0 and 1 of three meet, rank 2 never comes; on another port, rank 1
    # of two finds no rank 0.
    config = HealthCheckConfig(enabled=True, timeout=12)
    port = free_port()
    first, second, alone = _concurrently(
        lambda: _check(config, _env(0, 3, port)),
        lambda: _check(config, _env(1, 3, port)),
        lambda: _check(config, _env(1, 2, free_port())),
    )
    # Each returned at its budget: the reasons below name it, and _check bounds the
    # wait far below the store's own timeout (wall time beyond the budget is the
    # start-up of python and torch, seconds on a loaded host).
    for result in (first, second):
        assert not result.ok and result.stage == "rendezvous"
        assert result.fault == "peers" and result.peers == (2,)
        assert "rank 2 did not join the check within 9 s" in result.reason
        assert not result.exclude_self
    assert not alone.ok and alone.stage == "rendezvous"
    assert alone.fault == "peers" and alone.peers == (0,)
    assert "rank 0 did not open the check's store" in alone.reason


@pytest.mark.integration
def test_a_node_failing_locally_tells_its_peers(free_port: Callable[[], int]) -> None:
    port = free_port()
    healthy = HealthCheckConfig(enabled=True, timeout=30)
    sick = HealthCheckConfig(enabled=True, timeout=30, command="echo GPU 3 fell off >&2; exit 3")
    started = time.monotonic()
    good, bad = _concurrently(
        lambda: _check(healthy, _env(0, 2, port)), lambda: _check(sick, _env(1, 2, port))
    )
    # Told, not timed out: well before the rendezvous budget runs out.
    assert time.monotonic() - started < 0.75 * healthy.timeout
    assert not bad.ok and bad.stage == "command" and bad.fault == "self" and bad.exclude_self
    assert "GPU 3 fell off" in bad.reason
    assert not good.ok and good.fault == "peers" and good.peers == (1,)
    assert not good.exclude_self
    assert "rank 1 failed its check" in good.reason and "GPU 3 fell off" in good.reason


@pytest.mark.integration
def test_a_failing_command_reports_its_exit_code_and_stderr() -> None:
    config = HealthCheckConfig(
        enabled=True,
        timeout=30,
        collective=False,
        command="echo to stdout; echo first >&2; echo 'ECC errors: 12' >&2; exit 1",
    )
    result = _check(config, _env())
    assert not result.ok and result.stage == "command" and result.fault == "self"
    assert "exit code 1" in result.reason
    assert "ECC errors: 12" in result.reason


@pytest.mark.integration
def test_the_command_gets_the_round_env(tmp_path: Path) -> None:
    out = tmp_path / "seen"
    config = HealthCheckConfig(
        enabled=True, timeout=30, collective=False, command=f'echo "$RANK/$WORLD_SIZE" > {out}'
    )
    result = _check(config, {**_env(), "WORLD_SIZE": "1"})
    assert result.ok, result
    assert out.read_text().strip() == "0/1"


@pytest.mark.integration
def test_a_hanging_command_is_killed_with_its_children(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    command = (
        f"sleep 300 & echo $! > {pids}.tmp; "
        f"setsid sleep 300 & echo $! >> {pids}.tmp; "
        f"echo $$ >> {pids}.tmp; mv {pids}.tmp {pids}; wait"
    )
    config = HealthCheckConfig(enabled=True, timeout=2, collective=False, command=command)
    result = _check(config, _env())  # bounded far below the command's 300 s
    assert not result.ok and result.stage == "command" and result.fault == "self"
    assert "timed out after 1 s" in result.reason
    left = [int(p) for p in pids.read_text().split()]
    assert len(left) == 3
    for pid in left:
        deadline = time.monotonic() + 5
        while psutil.pid_exists(pid) and time.monotonic() < deadline:
            if _alive(psutil.Process(pid)):
                time.sleep(0.05)
            else:
                break
        assert not psutil.pid_exists(pid) or not _alive(psutil.Process(pid)), pid


@pytest.mark.integration
def test_a_raising_callable_fails_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "site_checks"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "disks.py").write_text(
        textwrap.dedent(
            """
            def check():
                raise RuntimeError("disk /scratch is full")

            def says_no():
                return False
            """
        )
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    raised, refused = _concurrently(
        lambda: _check(
            HealthCheckConfig(enabled=True, timeout=30, callable="site_checks.disks:check"),
            _env(),
        ),
        lambda: _check(
            HealthCheckConfig(enabled=True, timeout=30, callable=f"{package}/disks.py:says_no"),
            _env(),
        ),
    )
    assert not raised.ok and raised.stage == "callable" and raised.fault == "self"
    assert "RuntimeError: disk /scratch is full" in raised.reason
    assert not refused.ok and refused.stage == "callable"
    assert "returned False" in refused.reason


@pytest.mark.integration
def test_a_crash_in_the_check_does_not_take_the_caller_down(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text("import os, signal\ndef check():\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    config = HealthCheckConfig(enabled=True, timeout=30, callable=f"{script}:check")
    result = _check(config, _env())
    assert not result.ok and result.stage == "callable" and result.fault == "self"
    assert signal.Signals.SIGSEGV.name in result.reason


@pytest.mark.integration
def test_a_hanging_callable_is_killed_at_the_local_budget(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text("import time\ndef check():\n    time.sleep(300)\n")
    config = HealthCheckConfig(enabled=True, timeout=10, callable=f"{script}:check")
    result = _check(config, _env())  # bounded far below the callable's 300 s
    assert not result.ok and result.stage == "callable" and result.fault == "self"
    assert "timed out after 5 s" in result.reason


@pytest.mark.integration
def test_an_accelerator_that_is_missing_fails_the_check() -> None:
    if _cuda_available():
        pytest.skip("this machine has a CUDA device")
    result = run_health_check(
        HealthCheckConfig(enabled=True, timeout=30), round_env=_env(), device="cuda"
    )
    assert not result.ok and result.stage == "matmul" and result.fault == "self"
    assert "torch.cuda.is_available() is False" in result.reason


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.integration
@pytest.mark.skipif(sys.platform != "linux", reason="process groups as on Linux")
def test_an_interrupted_check_leaves_no_process(tmp_path: Path) -> None:
    # The caller is interrupted (a signal to the agent) while the command runs.
    marker = tmp_path / "started"
    config = HealthCheckConfig(
        enabled=True, timeout=60, collective=False, command=f"touch {marker}; sleep 300"
    )

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(KeyboardInterrupt):
            run_health_check(config, round_env=_env(), device="cpu")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert marker.exists()


def _slow_start(tmp_path: Path, seconds: float) -> dict[str, str]:
    """Round variables that make every Python the check starts take ``seconds`` longer
    to start (a sitecustomize that sleeps), as Python on a slow shared filesystem does."""
    site = tmp_path / "slow_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import time\ntime.sleep({seconds})\n")
    return {"PYTHONPATH": str(site)}


@pytest.mark.integration
def test_a_slow_start_of_python_and_torch_does_not_fail_the_check(tmp_path: Path) -> None:
    # The delay alone is longer than the whole timeout: on a budget that counted it
    # the node would blame itself in stage torch.
    config = HealthCheckConfig(enabled=True, timeout=4, collective=False)
    result = _check(config, {**_env(), **_slow_start(tmp_path, 6)})
    assert result.ok, result
    assert result.fault == "none" and not result.exclude_self
    assert result.import_seconds is not None and result.import_seconds >= 6
    assert result.seconds >= result.import_seconds
    assert "importing torch took" in result.reason and "not counted" in result.reason


@pytest.mark.integration
def test_a_start_that_never_ends_fails_in_stage_torch_after_its_allowance(
    tmp_path: Path,
) -> None:
    config = HealthCheckConfig(enabled=True, timeout=3, import_timeout=3, collective=False)
    started = time.monotonic()
    result = _check(config, {**_env(), **_slow_start(tmp_path, 300)})
    # The import's allowance cuts the 300 s hang off.
    assert time.monotonic() - started < 120
    assert not result.ok and result.stage == "torch" and result.fault == "self"
    assert result.import_seconds is None
    assert "importing torch took more than 3 s" in result.reason
