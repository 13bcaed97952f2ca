"""The embedded etcd (``etcd-embedded``): its options, and its members' lives.

Unit tests: the member list and ``member`` option, the etcd command line (TLS for
clients and peers), the quorum report. Integration tests (real etcd members on
127.0.0.1 ports, in this process or a child): a 3-member rendezvous whose members
stop and leave no data behind when the handlers close, a stale data directory
removed at start, a SIGKILLed agent's member killed and its data removed by the
watchdog, TLS between members and clients, and torchrun through the
``rallypoint-etcd-embedded`` entry point. The chaos scenarios (node loss,
replacement, majority loss) are in ``test_chaos_embedded.py``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.waiting import join_all
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rallypoint.adapters import ConfigError, RallypointHandler, create_handler
from rallypoint.adapters.config import EmbeddedEtcd, EtcdTLS, parse_params
from rallypoint.adapters.etcd import EtcdBackend, EtcdServerError, find_etcd_binary, free_port
from rallypoint.adapters.etcd.backend import QuorumLostError
from rallypoint.adapters.etcd.embedded import EmbeddedMember, member_name, quorum_report

FAST = {
    "keep_alive_interval": "0.5",
    "keep_alive_max_attempt": "4",
    "last_call_timeout": "0.3",
    "join_timeout": "60",
    "read_timeout": "20",
}


def _ports(count: int) -> list[int]:
    """Client ports whose next port (the peer port) is free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port >= 65535 or {port - 1, port, port + 1} & set(ports):
            continue
        try:
            import socket

            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        ports.append(port)
    return ports


def _params(endpoint: str, run_id: str, n: int, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        "etcd-embedded", endpoint, run_id, n, n, **{"local_addr": "127.0.0.1", **FAST, **conf}
    )


# --- options -------------------------------------------------------------------------


def test_member_is_chosen_by_index_by_address_or_none() -> None:
    endpoint = "127.0.0.1:23790,127.0.0.1:23792,127.0.0.1:23794"
    by_index = parse_params(_params(endpoint, "r", 2, member="2")).embedded
    assert by_index is not None and by_index.own == 2
    assert by_index.members == (("127.0.0.1", 23790), ("127.0.0.1", 23792), ("127.0.0.1", 23794))
    by_address = parse_params(_params(endpoint, "r", 2, member="127.0.0.1:23792")).embedded
    assert by_address is not None and by_address.own == 1
    client_only = parse_params(_params(endpoint, "r", 2, member="none")).embedded
    assert client_only is not None and client_only.own is None


def test_members_on_one_host_need_the_member_option() -> None:
    with pytest.raises(ConfigError, match="member=INDEX"):
        parse_params(_params("127.0.0.1:23790,127.0.0.1:23792", "r", 2))


def test_the_member_on_this_host_is_found_by_its_address() -> None:
    # 192.0.2.1 (TEST-NET) is no address of this host: this node runs member 0.
    config = parse_params(_params("127.0.0.1:23790,192.0.2.1:23790", "r", 2)).embedded
    assert config is not None and config.own == 0
    assert config.data_dir  # a default: the temporary directory


@pytest.mark.parametrize(
    ("endpoint", "member", "expected"),
    [
        ("127.0.0.1:23790,127.0.0.1:23791", "0", "next port is free"),
        ("127.0.0.1:65535", "0", "next port is free"),
        ("127.0.0.1:23790,127.0.0.1:23792", "2", "give the index"),
        ("127.0.0.1:23790,127.0.0.1:23792", "127.0.0.1:1", "give the index"),
    ],
)
def test_bad_member_lists_and_members_are_one_line_errors(
    endpoint: str, member: str, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected) as caught:
        parse_params(_params(endpoint, "r", 2, member=member))
    assert "\n" not in str(caught.value)


def test_the_embedded_etcd_has_no_users() -> None:
    with pytest.raises(ConfigError, match="does not read it, so its connection"):
        parse_params(_params("127.0.0.1:23790", "r", 1, member="0", user="u", password="p"))


def test_member_options_belong_to_the_embedded_backend_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(ConfigError, match="did you mean 'member'"):
        parse_params(_params("127.0.0.1:23790", "r", 1, membr="0"))
    plain = RendezvousParameters("etcd", "127.0.0.1:2379", "r", 1, 1, member="0")
    with caplog.at_level("WARNING", logger="rallypoint.adapters.config"):
        assert parse_params(plain).embedded is None
    assert "member is ignored by the etcd backend" in caplog.text


def _member(tls: EtcdTLS | None, own: int = 1) -> EmbeddedMember:
    embedded = EmbeddedEtcd(
        members=(("node-a", 2379), ("node-b", 2379), ("node-c", 2379)), own=own, data_dir="/d"
    )

    def no_connect(index: int) -> Any:
        raise AssertionError("no client in this test")

    return EmbeddedMember(embedded, "job", tls=tls, connect=no_connect, binary="etcd")


def _listens_on_an_address(argv: list[str], flag: str, port: int) -> str:
    """The host of ``flag``'s URL, which must be an IP address (etcd binds no names)."""
    (url,) = [arg.split("=", 1)[1] for arg in argv if arg.startswith(f"{flag}=")]
    scheme, _, rest = url.partition("://")
    host, _, listened = rest.rpartition(":")
    ipaddress.ip_address(host.strip("[]"))  # raises for a name
    assert int(listened) == port
    return scheme


def test_the_member_command_line_bootstraps_from_the_static_list() -> None:
    member = _member(None)
    argv = member._argv("a=http://node-a:2380", "new")
    assert argv[0] == "etcd"
    assert "--name=node-b-2379" in argv
    # Peers and clients are told the name; etcd listens on an address.
    assert "--advertise-client-urls=http://node-b:2379" in argv
    assert "--initial-advertise-peer-urls=http://node-b:2380" in argv
    assert _listens_on_an_address(argv, "--listen-client-urls", 2379) == "http"
    assert _listens_on_an_address(argv, "--listen-peer-urls", 2380) == "http"
    assert "--initial-cluster-state=new" in argv
    assert "--initial-cluster-token=rallypoint-job" in argv
    assert f"--data-dir={Path('/d') / 'rallypoint-etcd-job-node-b-2379'}" in argv
    assert not any("cert" in arg for arg in argv)


def test_a_member_named_by_a_resolvable_name_listens_on_its_address() -> None:
    embedded = EmbeddedEtcd(members=(("localhost", 2379),), own=0, data_dir="/d")
    member = EmbeddedMember(embedded, "job", tls=None, connect=lambda i: None, binary="etcd")
    argv = member._argv("localhost-2379=http://localhost:2380", "new")
    assert "--listen-client-urls=http://127.0.0.1:2379" in argv
    assert "--listen-peer-urls=http://127.0.0.1:2380" in argv
    assert "--advertise-client-urls=http://localhost:2379" in argv


def test_the_member_serves_clients_and_peers_over_tls_with_the_tls_options() -> None:
    member = _member(EtcdTLS(cacert="/ca.pem", cert="/node.pem", key="/node.key"))
    argv = member._argv("x", "existing")
    assert "--advertise-client-urls=https://node-b:2379" in argv
    assert _listens_on_an_address(argv, "--listen-client-urls", 2379) == "https"
    assert _listens_on_an_address(argv, "--listen-peer-urls", 2380) == "https"
    assert "--initial-advertise-peer-urls=https://node-b:2380" in argv
    for flag in ("--cert-file=/node.pem", "--peer-cert-file=/node.pem",
                 "--peer-key-file=/node.key", "--client-cert-auth",
                 "--peer-client-cert-auth", "--peer-trusted-ca-file=/ca.pem"):  # fmt: skip
        assert flag in argv, flag


def test_the_quorum_report_names_the_members_that_do_not_answer() -> None:
    embedded = EmbeddedEtcd(members=(("h", 1), ("h", 3), ("h", 5)), own=None, data_dir="/d")

    class Answers:
        def status(self) -> None:
            return None

        def close(self) -> None:
            return None

    def connect(alive: set[int]) -> Any:
        def make(index: int) -> Answers:
            if index not in alive:
                raise ConnectionError("refused")
            return Answers()

        return make

    assert quorum_report(embedded, connect({0, 2})) is None
    report = quorum_report(embedded, connect({2}))
    assert report is not None
    assert "h-1, h-3 do not answer" in report and "1 of 3 answers, 2 needed" in report


def test_member_names_are_host_and_port() -> None:
    assert member_name("node-a", 2379) == "node-a-2379"
    assert member_name("::1", 2379) == "__1-2379"


def test_a_lost_quorum_is_one_line_that_says_restart_the_job_and_nothing_else() -> None:
    embedded = EmbeddedEtcd(members=(("h", 1), ("h", 3), ("h", 5)), own=None, data_dir="/d")

    class Unreachable:
        def get(self, key: str) -> None:
            raise ConnectionError("refused")

        def status(self) -> None:
            raise ConnectionError("refused")

        def close(self) -> None:
            return None

    def connect(index: int) -> Any:
        if index == 2:
            return _AnswersStatus()
        raise ConnectionError("refused")

    backend = EtcdBackend(
        Unreachable(),
        "job",
        endpoint="h:1,h:3,h:5",
        retry_window=0.2,
        diagnose=lambda: quorum_report(embedded, connect),
    )
    with pytest.raises(QuorumLostError) as caught:  # a RendezvousConnectionError
        backend.get_state()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("the embedded etcd lost its quorum: members h-1, h-3 do not answer")
    assert "restart the job" in message and "run id 'job'" in message
    # No advice that contradicts it (the server is not to be fixed, its node is gone).
    assert "Check:" not in message and "is running" not in message


class _AnswersStatus:
    def status(self) -> None:
        return None

    def close(self) -> None:
        return None


# --- real members ----------------------------------------------------------------


@pytest.fixture
def etcd_binary() -> str:
    try:
        return find_etcd_binary()
    except EtcdServerError as exc:
        pytest.skip(str(exc))


def _etcd_processes(data_dir: Path) -> list[psutil.Process]:
    """The members (and their watchdogs) keeping data under ``data_dir``."""
    found = []
    for proc in psutil.process_iter():
        try:
            mine = any(str(data_dir) in arg for arg in proc.cmdline())
            if mine and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _eventually(predicate: Any, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def _make_all(params: list[RendezvousParameters]) -> list[RallypointHandler]:
    """Create the handlers at once (each member waits for a quorum)."""
    made: dict[int, RallypointHandler] = {}
    errors: list[BaseException] = []

    def make(index: int) -> None:
        try:
            made[index] = create_handler(params[index])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(i,)) for i in range(len(params))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        for handler in made.values():
            handler.close()
        raise errors[0]
    return [made[i] for i in range(len(params))]


def _close_all(handlers: list[RallypointHandler]) -> None:
    threads = [threading.Thread(target=h.close) for h in handlers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


@pytest.fixture
def embedded_handlers() -> Iterator[list[RallypointHandler]]:
    made: list[RallypointHandler] = []
    yield made
    _close_all(made)


@pytest.mark.integration
def test_three_members_rendezvous_then_stop_and_leave_nothing(
    etcd_binary: str, tmp_path: Path, embedded_handlers: list[RallypointHandler]
) -> None:
    endpoint = ",".join(f"127.0.0.1:{p}" for p in _ports(3))
    made = _make_all(
        [_params(endpoint, "three", 3, member=str(i), data_dir=str(tmp_path)) for i in range(3)]
    )
    embedded_handlers.extend(made)
    assert [p.name() for p in _etcd_processes(tmp_path)].count("etcd") == 3
    # Each agent talks to its own member first (no network hop while it is up).
    members = endpoint.split(",")
    in_use = [h._backend.connection.endpoint_in_use for h in made]  # type: ignore[attr-defined]
    assert in_use == members
    infos = join_all(made, 120)
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    by_rank = {i.rank: i for i in infos}
    by_rank[0].store.set("k", b"v")
    assert by_rank[2].store.get("k") == b"v"
    started = time.monotonic()
    _close_all(made)
    embedded_handlers.clear()
    # All three finish together: nobody waits out the linger.
    assert time.monotonic() - started < 30
    assert _eventually(lambda: not _etcd_processes(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration
def test_a_member_that_starts_late_joins_the_running_cluster(
    etcd_binary: str, tmp_path: Path, embedded_handlers: list[RallypointHandler]
) -> None:
    endpoint = ",".join(f"127.0.0.1:{p}" for p in _ports(3))
    params = [_params(endpoint, "late", 3, member=str(i), data_dir=str(tmp_path)) for i in range(3)]
    embedded_handlers.extend(_make_all(params[:2]))  # two of three: a quorum
    late = create_handler(params[2])  # removes its never-started entry, adds itself anew
    embedded_handlers.append(late)
    states = sorted(
        arg.split("=", 1)[1]
        for proc in _etcd_processes(tmp_path)
        for arg in proc.cmdline()
        if arg.startswith("--initial-cluster-state=")
    )
    assert states == ["existing", "new", "new"]
    infos = join_all(embedded_handlers, 120)
    assert sorted(i.rank for i in infos) == [0, 1, 2]


def _loopback_host_name() -> str:
    """This host's name, where it resolves to loopback addresses only (tests talk
    to 127.0.0.1 only)."""
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        pytest.skip(f"this host's name {name!r} does not resolve ({exc})")
    addresses = {str(info[4][0]) for info in infos}
    if not all(ipaddress.ip_address(a).is_loopback for a in addresses):
        pytest.skip(f"this host's name {name!r} resolves beyond loopback ({addresses})")
    return name


def _flag(proc: psutil.Process, flag: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in proc.cmdline() if a.startswith(f"{flag}=")]
    return value


@pytest.mark.integration
def test_members_named_by_host_name_bootstrap_and_a_late_one_rejoins_by_name(
    etcd_binary: str, tmp_path: Path, embedded_handlers: list[RallypointHandler]
) -> None:
    host = _loopback_host_name()
    ports = _ports(3)
    endpoint = ",".join(f"{host}:{p}" for p in ports)
    params = [_params(endpoint, "named", 3, member=str(i), data_dir=str(tmp_path))
              for i in range(3)]  # fmt: skip
    embedded_handlers.extend(_make_all(params[:2]))
    late = create_handler(params[2])  # reconfiguration, by the member's name
    embedded_handlers.append(late)
    members = {_flag(p, "--name"): p for p in _etcd_processes(tmp_path) if p.name() == "etcd"}
    assert sorted(members) == sorted(f"{host}-{p}" for p in ports)
    for port in ports:
        proc = members[f"{host}-{port}"]
        # Peers and clients know the member by name; it listens on an address.
        assert _flag(proc, "--advertise-client-urls") == f"http://{host}:{port}"
        assert _flag(proc, "--initial-advertise-peer-urls") == f"http://{host}:{port + 1}"
        _listens_on_an_address(proc.cmdline(), "--listen-client-urls", port)
    assert _flag(members[f"{host}-{ports[2]}"], "--initial-cluster-state") == "existing"
    infos = join_all(embedded_handlers, 120)
    assert sorted(i.rank for i in infos) == [0, 1, 2]


def _member_process(data_dir: Path, name: str) -> psutil.Process | None:
    for proc in _etcd_processes(data_dir):
        with contextlib.suppress(psutil.Error):
            if proc.name() == "etcd" and f"--name={name}" in proc.cmdline():
                return proc
    return None


def _whole(endpoint: str) -> bool:
    """Whether every member of ``endpoint`` answers and the cluster lists exactly
    these members, each started (named)."""
    import pyetcd

    listed = endpoint.split(",")
    names: list[str] = []
    for address in listed:
        host, _, port = address.rpartition(":")
        client = None
        try:
            client = pyetcd.client(host, int(port), timeout=2)
            client.get("/probe")
            names = sorted(m.name for m in client.members)
        except Exception:
            return False
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
    return names == sorted(f"127.0.0.1-{a.rpartition(':')[2]}" for a in listed)


@pytest.mark.integration
@pytest.mark.parametrize("data", ["kept", "lost"])
def test_a_crashed_member_is_restarted_while_its_agent_lives(
    etcd_binary: str, tmp_path: Path, embedded_handlers: list[RallypointHandler], data: str
) -> None:
    """A member's etcd SIGKILLed under its live backend serves again: from its
    data where that is intact, else re-added to the cluster by reconfiguration."""
    ports = _ports(3)
    endpoint = ",".join(f"127.0.0.1:{p}" for p in ports)
    run = f"crash-{data}"
    made = _make_all(
        [_params(endpoint, run, 3, member=str(i), data_dir=str(tmp_path)) for i in range(3)]
    )
    embedded_handlers.extend(made)
    name = f"127.0.0.1-{ports[1]}"
    crashed = _member_process(tmp_path, name)
    assert crashed is not None
    if data == "lost":
        shutil.rmtree(tmp_path / f"rallypoint-etcd-{run}-{name}")
    crashed.send_signal(signal.SIGKILL)
    crashed.wait(30)

    def restarted() -> psutil.Process | None:
        proc = _member_process(tmp_path, name)
        return proc if proc is not None and proc.pid != crashed.pid else None

    assert _eventually(lambda: restarted() is not None, 120), "the member was not restarted"
    again = restarted()
    assert again is not None
    expected = "new" if data == "kept" else "existing"  # the same flags; or a rejoin
    assert _flag(again, "--initial-cluster-state") == expected
    assert _eventually(lambda: _whole(endpoint), 120), "the cluster is not whole again"
    infos = join_all(made, 120)
    assert sorted(i.rank for i in infos) == [0, 1, 2]


@pytest.mark.integration
def test_a_replacement_whose_first_look_misses_the_running_cluster_rejoins_it(
    etcd_binary: str,
    tmp_path: Path,
    embedded_handlers: list[RallypointHandler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a loaded host the replacement's first probe of the other members can
    time out: it then bootstraps, which etcd refuses for a member the running
    cluster has seen started. The replacement rejoins instead of failing."""
    endpoint = ",".join(f"127.0.0.1:{p}" for p in _ports(3))
    params = [
        _params(endpoint, "missed", 3, member=str(i), data_dir=str(tmp_path)) for i in range(3)
    ]
    made = _make_all(params)
    embedded_handlers.extend(made[:2])
    made[2].close()  # its member is gone; the cluster still lists it, started
    looks: list[bool] = []
    real_look = EmbeddedMember._quorum_client

    def first_look_misses(self: EmbeddedMember) -> Any:
        looks.append(True)
        return None if len(looks) == 1 else real_look(self)

    monkeypatch.setattr(EmbeddedMember, "_quorum_client", first_look_misses)
    replacement = create_handler(params[2])
    embedded_handlers.append(replacement)
    member = _member_process(tmp_path, f"127.0.0.1-{endpoint.rpartition(':')[2]}")
    assert member is not None
    assert "--initial-cluster-state=existing" in member.cmdline()
    assert len(looks) >= 2
    assert _eventually(lambda: _whole(endpoint), 60)
    infos = join_all(embedded_handlers, 120)
    assert sorted(i.rank for i in infos) == [0, 1, 2]


@pytest.mark.integration
def test_a_member_removed_from_the_cluster_is_not_put_back(
    etcd_binary: str,
    tmp_path: Path,
    embedded_handlers: list[RallypointHandler],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A member the cluster removed (a replacement took its place) exits; its
    agent does not re-add it, which would remove the replacement in turn."""
    import pyetcd

    ports = _ports(3)
    endpoint = ",".join(f"127.0.0.1:{p}" for p in ports)
    made = _make_all(
        [_params(endpoint, "removed", 3, member=str(i), data_dir=str(tmp_path)) for i in range(3)]
    )
    embedded_handlers.extend(made)
    name = f"127.0.0.1-{ports[2]}"
    with caplog.at_level("WARNING", logger="rallypoint.adapters.etcd.embedded"):

        def remove() -> bool:
            # etcd refuses a reconfiguration until its members have been
            # connected for 5 s ("unhealthy cluster"); pyetcd then bans its
            # endpoint, so each try has a client of its own.
            client = pyetcd.client("127.0.0.1", ports[0], timeout=5)
            try:
                (gone,) = [m for m in client.members if m.name == name]
                client.remove_member(gone.id)
            except pyetcd.exceptions.Etcd3Exception:
                return False
            finally:
                client.close()
            return True

        assert _eventually(remove, 60)
        assert _eventually(lambda: "was removed from the cluster" in caplog.text, 60), caplog.text
    assert _member_process(tmp_path, name) is None
    assert "restarting it" not in caplog.text
    infos = join_all(made, 120)  # the removed member's node goes on as a client
    assert sorted(i.rank for i in infos) == [0, 1, 2]


@pytest.mark.integration
def test_a_stale_data_dir_is_removed_at_start(
    etcd_binary: str, tmp_path: Path, embedded_handlers: list[RallypointHandler]
) -> None:
    (port,) = _ports(1)
    stale = tmp_path / f"rallypoint-etcd-stale-127.0.0.1-{port}"
    (stale / "member").mkdir(parents=True)
    (stale / "member" / "left-by-a-killed-agent").write_text("x")
    handler = create_handler(
        _params(f"127.0.0.1:{port}", "stale", 1, member="0", data_dir=str(tmp_path))
    )
    embedded_handlers.append(handler)
    assert not (stale / "member" / "left-by-a-killed-agent").exists()
    join_all([handler], 60)
    handler.close()
    embedded_handlers.clear()
    assert list(tmp_path.iterdir()) == []


_KILLED_AGENT = textwrap.dedent(
    """
    import os, signal, sys
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from rallypoint.adapters import create_handler
    handler = create_handler(RendezvousParameters(
        "etcd-embedded", sys.argv[1], "killed", 1, 1, local_addr="127.0.0.1",
        member="0", data_dir=sys.argv[2], read_timeout="20"))
    print("ready", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _sigkilled_agent_leaves_nothing(script: str, said: str, tmp_path: Path) -> None:
    """Run the agent ``script`` (its member's data under ``tmp_path``) until it
    SIGKILLs itself, having printed ``said``; then its member must die and its data
    go."""
    (port,) = _ports(1)
    agent = subprocess.run(
        [sys.executable, "-c", script, f"127.0.0.1:{port}", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        assert agent.returncode == -9 and said in agent.stdout.split(), agent.stderr
        assert _eventually(lambda: not _etcd_processes(tmp_path)), _etcd_processes(tmp_path)
        assert _eventually(lambda: not list(tmp_path.iterdir())), list(tmp_path.iterdir())
    finally:
        for proc in _etcd_processes(tmp_path):
            proc.kill()


@pytest.mark.integration
def test_a_sigkilled_agents_member_dies_and_its_data_is_removed(
    etcd_binary: str, tmp_path: Path
) -> None:
    _sigkilled_agent_leaves_nothing(_KILLED_AGENT, "ready", tmp_path)


_KILLED_AFTER_A_RESTART = textwrap.dedent(
    """
    import os, signal, sys, time
    import psutil
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from rallypoint.adapters import create_handler
    handler = create_handler(RendezvousParameters(
        "etcd-embedded", sys.argv[1], "killed", 1, 1, local_addr="127.0.0.1",
        member="0", data_dir=sys.argv[2], read_timeout="20"))
    def member():
        found = [p for p in psutil.Process().children() if p.name() == "etcd"]
        return found[0] if found else None
    first = member()
    first.kill()
    first.wait(30)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        again = member()
        if again is not None and again.pid != first.pid:
            break
        time.sleep(0.05)
    print("restarted" if again is not None else "not restarted", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.integration
def test_a_sigkilled_agents_restarted_member_dies_and_its_data_is_removed(
    etcd_binary: str, tmp_path: Path
) -> None:
    _sigkilled_agent_leaves_nothing(_KILLED_AFTER_A_RESTART, "restarted", tmp_path)


def _tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and one certificate for 127.0.0.1 good for servers and clients (each
    member is both)."""

    def openssl(*args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)

    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
            "-days", "1", "-subj", "/CN=rallypoint-test-ca")  # fmt: skip
    key, csr, cert, ext = (directory / f"node.{s}" for s in ("key", "csr", "crt", "ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
            "-subj", "/CN=node")  # fmt: skip
    openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
            "-out", cert, "-days", "1", "-sha256", "-extfile", ext)  # fmt: skip
    return ca, cert, key


@pytest.mark.integration
def test_members_and_clients_talk_tls(
    etcd_binary: str, tmp_path: Path, embedded_handlers: list[RallypointHandler]
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make test certificates")
    ca, cert, key = _tls_files(tmp_path)
    data = tmp_path / "etcd"
    data.mkdir()
    endpoint = ",".join(f"https://127.0.0.1:{p}" for p in _ports(2))
    tls = {"cacert": str(ca), "cert": str(cert), "key": str(key), "data_dir": str(data)}
    made = _make_all([_params(endpoint, "tls", 2, member=str(i), **tls) for i in range(2)])
    embedded_handlers.extend(made)
    members = [p for p in _etcd_processes(data) if p.name() == "etcd"]
    assert len(members) == 2
    for proc in members:
        assert "--peer-client-cert-auth" in proc.cmdline()
    infos = join_all(made, 120)
    assert sorted(i.rank for i in infos) == [0, 1]
    _close_all(made)
    embedded_handlers.clear()
    assert _eventually(lambda: not _etcd_processes(data))
    assert list(data.iterdir()) == []


_TORCHRUN_SCRIPT = "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n"


@pytest.mark.integration
def test_torchrun_runs_on_the_embedded_etcd(etcd_binary: str, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(_TORCHRUN_SCRIPT)
    data = tmp_path / "etcd"
    data.mkdir()
    endpoint = ",".join(f"127.0.0.1:{p}" for p in _ports(2))
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun is not None

    def argv(member: int) -> list[str]:
        return [
            torchrun, "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "rallypoint-etcd-embedded", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "torchrun-embedded", "--local-addr", "127.0.0.1",
            "--rdzv-conf", f"member={member},data_dir={data},last_call_timeout=0.3",
            str(script),
        ]  # fmt: skip

    nodes = [
        subprocess.Popen(
            argv(i), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=180)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert sorted(
        line for out in outputs for line in out.splitlines() if line.startswith("rank ")
    ) == [
        "rank 0 of 2",
        "rank 1 of 2",
    ]
    assert _eventually(lambda: not _etcd_processes(data))
    assert list(data.iterdir()) == []
