"""One home per configuration concept, shared by the launcher and the handler.

* one error type for a bad configuration value, whoever checks it;
* one table of rallypoint's backend names (the launcher's extra names derive from it);
* one endpoint parser: the launcher (``--rdzv-endpoint``) and the handler (torch's
  parameters) refuse the same input with the same message, but for the option's name;
* one scheme split (``https://host:port``) for both;
* the settings' defaults are the core's ``Settings`` defaults, not copies;
* configuration parsing does not import torch;
* ``LaunchConfig`` checks the rendezvous options itself, so the Python API refuses
  what the launcher refuses;
* the three backends keep their name, endpoint, keys and counters the same way;
* one rule for the rendezvous options of every backend, torch's included: the keys
  torch's handlers read (checked against torch's source) are accepted everywhere,
  with a warning where ignored; misspellings are refused; docs/agent.md's table is
  what the launcher does.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rallypoint.adapters import MemoryBackend
from rallypoint.adapters import config as adapters_config
from rallypoint.adapters.c10d import C10dBackend
from rallypoint.adapters.config import parse_params
from rallypoint.adapters.etcd import EtcdBackend
from rallypoint.agent import config as agent_config
from rallypoint.agent.config import ConfigError, LaunchConfig
from rallypoint.agent.launcher import _split_etcd_scheme, main
from rallypoint.core import Settings

BAD_SINGLE_ENDPOINTS = [
    "127.0.0.1:+80",
    "127.0.0.1: 80",
    "127.0.0.1:29400:1",
    "::1:29400",
    "a b:29400",
    "[a b]:29400",
    "[::1]x:29400",
    "[not-v6:1]:29400",
    "[::1:29400",
    ":29400",
    "h:70000",
    "h:1,h:2",
]


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_one_error_type_for_a_bad_configuration_value() -> None:
    assert adapters_config.RendezvousConfigError is ConfigError
    assert adapters_config.ConfigError is ConfigError


@pytest.mark.parametrize("endpoint", BAD_SINGLE_ENDPOINTS)
def test_the_launcher_and_the_handler_refuse_an_endpoint_alike(endpoint: str) -> None:
    with pytest.raises(ConfigError) as by_launcher:
        agent_config.parse_rdzv_endpoint(endpoint, "rallypoint-c10d")
    with pytest.raises(ConfigError) as by_handler:
        adapters_config.parse_endpoint(endpoint, 29400)
    assert type(by_launcher.value) is type(by_handler.value)
    launcher_text = str(by_launcher.value).replace("the rallypoint-c10d backend", "this backend")
    handler_text = str(by_handler.value)
    assert launcher_text.startswith(f"--rdzv-endpoint {endpoint!r}"), launcher_text
    assert handler_text.startswith(f"rendezvous endpoint {endpoint!r}"), handler_text
    assert launcher_text.removeprefix("--rdzv-endpoint") == handler_text.removeprefix(
        "rendezvous endpoint"
    )


@pytest.mark.parametrize(
    ("endpoints", "expected"),
    [("h:1,,h:2", "empty entry"), ("h:1,h:1", "named twice"), ("h:1,h:x", "not a number")],
)
def test_an_etcd_member_list_is_refused_alike(endpoints: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as by_launcher:
        agent_config.parse_rdzv_endpoint(endpoints, "etcd")
    with pytest.raises(ConfigError, match=expected) as by_handler:
        adapters_config.parse_endpoints(endpoints, 2379)
    assert str(by_launcher.value).removeprefix("--rdzv-endpoint") == str(
        by_handler.value
    ).removeprefix("rendezvous endpoint")


def test_the_launchers_backend_names_derive_from_the_adapters_table() -> None:
    kinds = set(adapters_config.BACKEND_KINDS.values())
    rallypoint = {
        n for n, impl in agent_config.BACKEND_IMPLEMENTATIONS.items() if impl == "rallypoint"
    }
    torch_names = {n for n, impl in agent_config.BACKEND_IMPLEMENTATIONS.items() if impl == "torch"}
    assert rallypoint == set(adapters_config.BACKEND_KINDS)
    assert torch_names == {f"torch-{kind}" for kind in kinds} | {"static"}
    # Ports: etcd's is filled in (the adapters' default); every other needs one.
    for name, port in agent_config.DEFAULT_PORT_BY_BACKEND.items():
        etcd = name in adapters_config.ETCD_BACKENDS | {"torch-etcd"}
        assert port == (adapters_config.DEFAULT_PORT_BY_KIND["etcd"] if etcd else None), name


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [("gopher://h:1", "scheme must be"), ("https://h:1,http://h:2", "mixes")],
)
def test_a_bad_scheme_is_refused_alike(endpoint: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as by_launcher:
        _split_etcd_scheme("etcd", endpoint, {})
    params = RendezvousParameters("etcd", endpoint, "x", 1, 1, local_addr="127.0.0.1")
    with pytest.raises(ConfigError, match=expected) as by_handler:
        parse_params(params)
    assert str(by_launcher.value).removeprefix("--rdzv-endpoint") == str(
        by_handler.value
    ).removeprefix("rendezvous endpoint")


def test_a_contradicting_protocol_is_refused_by_both() -> None:
    with pytest.raises(ConfigError, match="contradicts"):
        _split_etcd_scheme("etcd", "https://h:1", {"protocol": "http"})
    params = RendezvousParameters(
        "etcd", "https://h:1", "x", 1, 1, local_addr="127.0.0.1", protocol="http"
    )
    with pytest.raises(ConfigError, match="contradicts"):
        parse_params(params)


def test_unset_options_take_the_core_settings_defaults() -> None:
    params = RendezvousParameters("c10d", "127.0.0.1:0", "x", 1, 2, local_addr="127.0.0.1")
    assert parse_params(params).settings == Settings("x", 1, 2)
    # Every settings option the handler reads is a field of the core's Settings.
    fields = {f.name for f in dataclasses.fields(Settings)}
    settings_options = adapters_config.OPTIONS["c10d"] - {
        "local_addr",
        "read_timeout",
        "is_host",
        "store_type",
    }
    assert settings_options <= fields


def test_run_ids_are_checked_alike() -> None:
    for run_id, expected in [("a/b", "must not contain '/'"), ("x" * 256, "at most 255")]:
        with pytest.raises(ConfigError, match=expected):
            agent_config.check_rdzv_id(run_id)
        params = RendezvousParameters("c10d", "127.0.0.1:0", run_id, 1, 1)
        with pytest.raises(ConfigError, match=expected):
            parse_params(params)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"rdzv_backend": "zookeeper"}, "--rdzv-backend 'zookeeper' is unknown; use one of"),
        ({"rdzv_endpoint": "h:x"}, "is not a number"),
        ({"rdzv_backend": "etcd", "rdzv_endpoint": "h1,h1"}, "named twice"),
        ({"rdzv_backend": "torch-etcd", "rdzv_endpoint": "h1,h2"}, "takes one HOST:PORT"),
        (
            {"rdzv_backend": "etcd", "rdzv_endpoint": "h", "rdzv_configs": {"join_timout": "5"}},
            "did you mean 'join_timeout'",
        ),
        ({"rdzv_configs": {"local_addr": "h"}}, "give it as --local-addr"),
        ({"min_nodes": 10**11, "max_nodes": 10**11}, "world size would exceed 2147483647"),
    ],
)
def test_the_api_refuses_what_the_launcher_refuses(
    options: dict[str, object], expected: str
) -> None:
    options = {"min_nodes": 1, "max_nodes": 1, **options}
    with pytest.raises(ConfigError, match=expected):
        LaunchConfig(nproc_per_node=1, **options)  # type: ignore[arg-type]


def test_the_endpoint_a_handler_gets() -> None:
    def endpoint(**options: object) -> str:
        return LaunchConfig(1, 1, 1, **options).rendezvous_endpoint()  # type: ignore[arg-type]

    assert endpoint(rdzv_backend="etcd", rdzv_endpoint="h") == "h:2379"
    assert endpoint(rdzv_backend="etcd", rdzv_endpoint="h1, h2:3") == "h1, h2:3"
    assert endpoint(rdzv_backend="c10d", rdzv_endpoint="[::1]:5") == "[::1]:5"
    assert endpoint(rdzv_backend="c10d", standalone=True) == "127.0.0.1:0"
    assert endpoint(rdzv_backend="static") == "127.0.0.1:29500"
    assert endpoint(rdzv_backend="static", master_addr="::1", master_port=7) == "[::1]:7"
    assert endpoint(rdzv_backend="static", rdzv_endpoint="h:8") == "h:8"
    with pytest.raises(ConfigError, match="--rdzv-endpoint is required for the c10d backend"):
        endpoint(rdzv_backend="c10d", rdzv_endpoint=" ")


@pytest.mark.integration
def test_a_blank_endpoint_is_a_missing_one(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rdzv-backend", "etcd", "--rdzv-endpoint", " ", script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rdzv-endpoint is required for the etcd backend" in err[0], err


@pytest.mark.integration
def test_configuration_parsing_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from rallypoint.adapters.config import check_run_id, parse_endpoints\n"
        "from rallypoint.agent.config import LaunchConfig\n"
        "parse_endpoints('h1:1,h2', 2379)\n"
        "check_run_id('job')\n"
        "LaunchConfig(1, 2, 1, rdzv_backend='etcd', rdzv_endpoint='h1,h2')\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr


def test_every_backend_needs_a_run_id_and_names_its_keys_alike() -> None:
    for make in (
        lambda run_id: MemoryBackend(run_id),
        lambda run_id: C10dBackend(HashStore(), run_id, endpoint="hash"),
        lambda run_id: EtcdBackend(object(), run_id, endpoint="h:1"),
    ):
        with pytest.raises(ValueError, match="run_id must be a non-empty string"):
            make("")
        backend = make("job")
        assert backend.key("hb/n").endswith("job/hb/n")
        assert backend.stats.ops >= 0 and backend.name and backend.endpoint
        with pytest.raises(ValueError, match="phase must be a non-negative integer"):
            backend.set_state(b"x", None, phase=-1)


# ------------------------------------------------ rendezvous options: torchrun's keys

TORCH_RDZV = Path(__import__("torch").__file__).parent / "distributed/elastic/rendezvous"

#: torch's backend -> the files of its handler (the dynamic rendezvous reads the
#: timeouts and keep-alive options for the c10d and etcd-v2 stores).
TORCH_HANDLER_FILES = {
    "c10d": ("dynamic_rendezvous.py", "c10d_rendezvous_backend.py"),
    "etcd-v2": ("dynamic_rendezvous.py", "etcd_rendezvous_backend.py"),
    "etcd": ("etcd_rendezvous.py",),
    "static": ("static_tcp_rendezvous.py",),
}

_READS = [
    r'params\.(?:get|get_as_int|get_as_bool)\(\s*"(\w+)"',
    r'params\.config\.get\(\s*"(\w+)"',
    r'params\.config\[\s*"(\w+)"\s*\]',
    r'"(\w+)"\s+in\s+params\.config',
]


def _keys_read_by_torch(backend: str) -> set[str]:
    keys: set[str] = set()
    for name in TORCH_HANDLER_FILES[backend]:
        text = (TORCH_RDZV / name).read_text()
        for pattern in _READS:
            keys.update(re.findall(pattern, text))
        keys.update(f"{k}_timeout" for k in re.findall(r'_get_timeout\(params, "(\w+)"\)', text))
    return keys


@pytest.mark.parametrize("backend", sorted(TORCH_HANDLER_FILES))
def test_the_table_of_torchs_keys_is_what_torchs_handlers_read(backend: str) -> None:
    assert _keys_read_by_torch(backend) == set(adapters_config.torch_options(backend))


def _launch_config(backend: str, key: str, value: str = "1") -> LaunchConfig:
    return LaunchConfig(
        1, 1, 1, rdzv_backend=backend, rdzv_endpoint="127.0.0.1:29400", rdzv_configs={key: value}
    )


def _outcome(backend: str, key: str, value: str, caplog: pytest.LogCaptureFixture) -> str:
    """What ``rallypoint run`` does with ``--rdzv-conf key=value``: read, warning, refused."""
    caplog.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="rallypoint"):
            _launch_config(backend, key, value)
    except ConfigError as exc:
        assert str(exc).startswith(f"--rdzv-conf {key}") or f"'{key}'" in str(exc), exc
        return "refused"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if not warnings:
        return "read"
    (warning,) = warnings
    assert warning.startswith(f"--rdzv-conf {key} is ignored by the {backend} backend (")
    return "warning"


ALL_KEYS = sorted(set(adapters_config.TORCH_OPTIONS).union(*adapters_config.OPTIONS.values()))
DOCS = Path(__file__).resolve().parents[2] / "docs" / "agent.md"


def _docs_table() -> dict[str, dict[str, str]]:
    """docs/agent.md's table of rendezvous options: key -> {backend: cell}."""
    lines = DOCS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| key | `c10d` |"))
    backends = [c.strip().strip("`") for c in lines[start].strip("|").split("|")][1:-1]
    table: dict[str, dict[str, str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for key in re.findall(r"`(\w+)`", cells[0]) or ["join_timout"]:
            table[key] = dict(zip(backends, cells[1:-1], strict=True))
    return table


def test_the_docs_table_of_rendezvous_options_is_what_the_launcher_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = _docs_table()
    # Every key some backend reads (torch 2.13's and rallypoint's), and a misspelt one.
    assert set(table) == {*ALL_KEYS, "join_timout"}
    assert set(table["join_timeout"]) == set(agent_config.BACKEND_IMPLEMENTATIONS) - {
        "rallypoint-c10d",
        "rallypoint-etcd",
        "rallypoint-etcd-embedded",
    }
    for key, cells in table.items():
        for backend, cell in cells.items():
            values = ["http", "https"] if key == "protocol" else ["5"]
            for value in values:
                expected = "refused" if f"refused for `{value}`" in cell else cell.split(",")[0]
                assert _outcome(backend, key, value, caplog) == expected, (key, value, backend)


@pytest.mark.parametrize("backend", sorted(agent_config.BACKEND_IMPLEMENTATIONS))
@pytest.mark.parametrize(
    ("key", "close"),
    [("join_timout", "join_timeout"), ("timout", "timeout"), ("is_hots", "is_host")],
)
def test_a_misspelt_key_is_refused_naming_the_close_match(
    backend: str, key: str, close: str
) -> None:
    with pytest.raises(
        ConfigError, match=f"'{key}' is unknown to the {backend} backend; did you mean '{close}'"
    ):
        _launch_config(backend, key)


def test_torchs_timeout_key_with_c10d_names_what_it_does_and_what_to_use(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="rallypoint"):
        config = _launch_config("c10d", "timeout", "5")
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "timeout is ignored by the c10d backend" in warning
    assert "the join timeout is join_timeout" in warning
    assert config.rdzv_configs == {"timeout": "5"}  # kept as given; the handler never gets it


def test_the_handler_path_accepts_torchruns_keys_and_warns_about_the_unread_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def parse(backend: str, **conf: str) -> None:
        parse_params(
            RendezvousParameters(backend, "127.0.0.1:0", "x", 1, 1, local_addr="127.0.0.1", **conf)
        )

    with caplog.at_level(logging.WARNING, logger="rallypoint"):
        # torch's launcher adds timeout to every backend's options: no warning for it.
        parse("rallypoint-c10d", timeout="900")
        assert caplog.records == []
        parse("rallypoint-c10d", etcd_prefix="/x", rank="0")
        parse("rallypoint-etcd", is_host="true")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages
    assert all(m.startswith("rendezvous option ") for m in messages)
    assert "is_host is ignored by the rallypoint-etcd backend" in messages[2]
    with pytest.raises(ConfigError, match="did you mean 'join_timeout'"):
        parse("rallypoint-c10d", join_timout="5")
