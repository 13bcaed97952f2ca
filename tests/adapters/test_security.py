"""Security: etcd over TLS with client certificates and with authentication (real
servers on 127.0.0.1, certificates made with openssl in tmp_path), the TLS and
auth options' validation, and the c10d stores bound to the address given."""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.waiting import join_all
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rallypoint.adapters import RallypointHandler, RendezvousConnectionError, create_handler
from rallypoint.adapters.c10d.store import bind_address
from rallypoint.adapters.config import EtcdAuth, RendezvousConfigError, parse_params
from rallypoint.adapters.etcd import EtcdServer, EtcdServerTLS
from rallypoint.adapters.etcd.server import EtcdServerError, find_etcd_binary

#: real processes, servers or sockets: `make test-fast` leaves these out
pytestmark = pytest.mark.integration

FAST = {
    "keep_alive_interval": "0.2",
    "keep_alive_max_attempt": "2",
    "last_call_timeout": "0.3",
    "join_timeout": "60",
    "local_addr": "127.0.0.1",
    "read_timeout": "10",
}


def _params(endpoint: str, run_id: str, n: int = 1, **conf: str) -> RendezvousParameters:
    return RendezvousParameters("rallypoint-etcd", endpoint, run_id, n, n, **{**FAST, **conf})


# --- certificates ------------------------------------------------------------


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _signed(
    directory: Path, name: str, ca: tuple[Path, Path], extensions: str
) -> tuple[Path, Path]:
    key, csr, cert, ext = (directory / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
    ext.write_text(extensions)
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
             "-subj", f"/CN={name}")  # fmt: skip
    _openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
             "-out", cert, "-days", "1", "-sha256", "-extfile", ext)  # fmt: skip
    return cert, key


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
             "-days", "1", "-subj", f"/CN={name}")  # fmt: skip
    return cert, key


class Certs:
    """A CA, a server certificate for 127.0.0.1, a client certificate, and a client
    certificate from another CA (that the server must refuse)."""

    def __init__(self, directory: Path) -> None:
        self.ca, ca_key = _ca(directory, "ca")
        self.server_cert, self.server_key = _signed(
            directory,
            "server",
            (self.ca, ca_key),
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        )
        self.client_cert, self.client_key = _signed(
            directory, "client", (self.ca, ca_key), "extendedKeyUsage=clientAuth\n"
        )
        rogue_ca = _ca(directory, "rogue-ca")
        self.rogue_ca = rogue_ca[0]
        self.rogue_cert, self.rogue_key = _signed(
            directory, "rogue", rogue_ca, "extendedKeyUsage=clientAuth\n"
        )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make test certificates")
    return Certs(tmp_path_factory.mktemp("certs"))


def _require_etcd() -> None:
    try:
        find_etcd_binary()
    except EtcdServerError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[EtcdServer]:
    _require_etcd()
    tls = EtcdServerTLS(
        cert=str(certs.server_cert),
        key=str(certs.server_key),
        client_ca=str(certs.ca),
        client_cert=str(certs.client_cert),
        client_key=str(certs.client_key),
    )
    server = EtcdServer(tmp_path_factory.mktemp("etcd-tls") / "data", tls=tls)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


ROOT_PASSWORD = "s3cret-root"


def _etcdctl(server: EtcdServer, *args: str) -> str:
    etcdctl = str(Path(find_etcd_binary()).with_name("etcdctl"))
    done = subprocess.run(
        [etcdctl, f"--endpoints={server.endpoint}", "--command-timeout=10s", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    _require_etcd()
    if not Path(find_etcd_binary()).with_name("etcdctl").is_file():
        pytest.skip("no etcdctl next to the etcd binary to enable authentication")
    server = EtcdServer(tmp_path_factory.mktemp("etcd-auth") / "data")
    try:
        server.start()
        _etcdctl(server, "user", "add", f"root:{ROOT_PASSWORD}")
        # A user that may use only rallypoint's keys, as a deployment would set up.
        _etcdctl(server, "user", "add", "trainer:trainer-pw")
        _etcdctl(server, "role", "add", "rallypoint")
        _etcdctl(server, "role", "grant-permission", "rallypoint", "readwrite",
                 "/rallypoint/", "--prefix=true")  # fmt: skip
        _etcdctl(server, "user", "grant-role", "trainer", "rallypoint")
        _etcdctl(server, "user", "add", "outsider:outsider-pw")
        _etcdctl(server, "auth", "enable")
        yield server
    finally:
        server.cleanup()


# --- etcd over TLS -------------------------------------------------------------


def test_etcd_over_tls_with_client_certificates_completes_a_rendezvous(
    tls_etcd: EtcdServer, certs: Certs, handlers: list[RallypointHandler]
) -> None:
    tls = {"cacert": str(certs.ca), "cert": str(certs.client_cert), "key": str(certs.client_key)}
    handlers.append(create_handler(_params(tls_etcd.endpoint, "tls", 2, protocol="https", **tls)))
    # torch's etcd-v2 names and an https:// endpoint reach the same server.
    v2_names = {
        "ca_cert": str(certs.ca),
        "ssl_cert": str(certs.client_cert),
        "ssl_cert_key": str(certs.client_key),
    }
    handlers.append(create_handler(_params(f"https://{tls_etcd.endpoint}", "tls", 2, **v2_names)))
    infos = join_all(handlers, 60)
    assert sorted(info.rank for info in infos) == [0, 1]  # type: ignore[attr-defined]
    assert handlers[0].endpoint.startswith("https://")


def test_etcd_over_tls_refuses_plain_and_foreign_clients(
    tls_etcd: EtcdServer, certs: Certs
) -> None:
    endpoint = tls_etcd.endpoint
    for conf in (
        {},  # plain http to a TLS server
        {"protocol": "https", "cacert": str(certs.ca)},  # no client certificate
        {  # a client certificate from a CA the server does not trust
            "cacert": str(certs.ca),
            "cert": str(certs.rogue_cert),
            "key": str(certs.rogue_key),
        },
    ):
        with pytest.raises(RendezvousConnectionError) as caught:
            create_handler(_params(endpoint, "tls-refused", read_timeout="3", **conf))
        assert "Check:" in str(caught.value), conf


def test_etcd_over_tls_verifies_the_server_certificate(tls_etcd: EtcdServer, certs: Certs) -> None:
    # cacert is not the server certificate's issuer: the server is not trusted.
    conf = {
        "cacert": str(certs.rogue_ca),
        "cert": str(certs.client_cert),
        "key": str(certs.client_key),
        "read_timeout": "3",
    }
    with pytest.raises(RendezvousConnectionError, match="signed by cacert"):
        create_handler(_params(tls_etcd.endpoint, "tls-verify", **conf))


# --- etcd with authentication --------------------------------------------------


def test_etcd_with_auth_completes_a_rendezvous(
    auth_etcd: EtcdServer, handlers: list[RallypointHandler], tmp_path: Path
) -> None:
    password_file = tmp_path / "password"
    password_file.write_text("trainer-pw\n")
    password_file.chmod(0o600)
    handlers.append(
        create_handler(
            _params(auth_etcd.endpoint, "auth", 2, user="trainer", password="trainer-pw")
        )
    )
    handlers.append(
        create_handler(
            _params(auth_etcd.endpoint, "auth", 2, user="trainer", password_file=str(password_file))
        )
    )
    infos = join_all(handlers, 60)
    assert sorted(info.rank for info in infos) == [0, 1]  # type: ignore[attr-defined]
    # The round's store (the agent's) works under the same credentials.
    store = infos[0].store  # type: ignore[attr-defined]
    store.set("k", b"v")
    assert infos[1].store.get("k") == b"v"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ({}, "needs user and password"),
        ({"user": "trainer", "password": "wrong"}, "'trainer' exists with this password"),
        ({"user": "outsider", "password": "outsider-pw"}, "readwrite on the /rallypoint/"),
    ],
)
def test_etcd_with_auth_refuses_missing_wrong_and_unprivileged_users(
    auth_etcd: EtcdServer, conf: dict[str, str], expected: str
) -> None:
    with pytest.raises(RendezvousConnectionError, match=expected) as caught:
        create_handler(_params(auth_etcd.endpoint, "auth-refused", read_timeout="3", **conf))
    assert "wrong" not in str(caught.value) and "outsider-pw" not in str(caught.value)


# --- option validation -----------------------------------------------------------


def _parse(endpoint: str = "127.0.0.1:2379", **conf: str) -> object:
    return parse_params(_params(endpoint, "conf", **conf))


@pytest.mark.parametrize(
    ("endpoint", "conf", "expected"),
    [
        ("127.0.0.1:2379", {"protocol": "ftp"}, "use http or https"),
        ("http://127.0.0.1:2379", {"protocol": "https"}, "contradicts"),
        ("gopher://127.0.0.1:2379", {}, "scheme must be"),
        ("127.0.0.1:2379", {"protocol": "http", "cacert": "{ca}"}, "need protocol=https"),
        ("127.0.0.1:2379", {"cert": "{ca}"}, "cert and key go together"),
        ("127.0.0.1:2379", {"cacert": "/nonexistent/ca.pem"}, "not a readable file"),
        ("127.0.0.1:2379", {"cacert": "{ca}", "ca_cert": "/other"}, "differ"),
        ("127.0.0.1:2379", {"user": "root"}, "go together"),
        ("127.0.0.1:2379", {"password": "x"}, "go together"),
        ("127.0.0.1:2379", {"user": "u", "password": "x", "password_file": "{ca}"}, "one of"),
    ],
)
def test_bad_tls_and_auth_options_are_config_errors(
    certs: Certs, endpoint: str, conf: dict[str, str], expected: str
) -> None:
    conf = {k: v.format(ca=certs.ca) for k, v in conf.items()}
    with pytest.raises(RendezvousConfigError, match=expected):
        _parse(endpoint, **conf)


def test_tls_and_auth_options_are_parsed_and_the_password_is_not_shown(certs: Certs) -> None:
    config = _parse("HTTPS://127.0.0.1:2379/", cacert=str(certs.ca), user="u", password="pw-x")
    assert config.endpoint == "127.0.0.1:2379"  # type: ignore[attr-defined]
    assert config.etcd_tls.cacert == str(certs.ca)  # type: ignore[attr-defined]
    assert config.etcd_auth == EtcdAuth("u", "pw-x")  # type: ignore[attr-defined]
    assert "pw-x" not in repr(config)
    # Certificates alone mean https (torch would send them over plain http, i.e. nowhere).
    assert _parse(cacert=str(certs.ca)).etcd_tls is not None  # type: ignore[attr-defined]
    assert _parse().etcd_tls is None  # type: ignore[attr-defined]


def test_c10d_backend_refuses_etcd_only_options() -> None:
    params = RendezvousParameters("c10d", "127.0.0.1:0", "c", 1, 1, protocol="https")
    with pytest.raises(RendezvousConfigError, match="protocol: the c10d backend does not read"):
        parse_params(params)


# --- c10d stores bound to the address given ----------------------------------------


def _accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture
def other_loopback_address() -> str:
    # All of 127/8 reaches the loopback interface on Linux: a server on every
    # interface answers at 127.0.0.2, one bound to 127.0.0.1 does not.
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.2", 0))
        except OSError:
            pytest.skip("127.0.0.2 is not a local address here")
    return "127.0.0.2"


def test_c10d_store_listens_only_on_the_endpoint_address(
    handlers: list[RallypointHandler], other_loopback_address: str
) -> None:
    params = RendezvousParameters("c10d", "127.0.0.1:0", "bind", 1, 1, **FAST, is_host="true")
    handlers.append(create_handler(params))
    port = int(handlers[0].endpoint.rsplit(":", 1)[1])
    assert _accepts("127.0.0.1", port)
    assert not _accepts(other_loopback_address, port)


def test_bootstrap_store_listens_only_on_local_addr(
    handlers: list[RallypointHandler], other_loopback_address: str
) -> None:
    params = RendezvousParameters("c10d", "127.0.0.1:0", "bind-boot", 1, 1, **FAST, is_host="true")
    handlers.append(create_handler(params))
    info = handlers[0].next_rendezvous()
    bootstrap = info.bootstrap_store_info
    assert bootstrap is not None and bootstrap.master_addr == "127.0.0.1"
    assert _accepts("127.0.0.1", bootstrap.master_port)
    assert not _accepts(other_loopback_address, bootstrap.master_port)


def test_c10d_host_on_an_address_not_of_this_host_fails_at_once() -> None:
    # 192.0.2.1 is TEST-NET-1: never a local address.
    params = RendezvousParameters(
        "c10d", "192.0.2.1:29400", "bind-foreign", 1, 1, **FAST, is_host="true"
    )
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="not an address of this host"):
        create_handler(params)
    assert time.monotonic() - started < 20  # at once, not at the join timeout (60 s)


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("::1", "::1"),
        ("localhost", "loopback"),
        ("10.1.2.3", "10.1.2.3"),
    ],
)
def test_bind_address(host: str, expected: str) -> None:
    address = bind_address(host)
    if expected == "loopback":
        assert address is not None and ipaddress.ip_address(address).is_loopback
    else:
        assert address == expected


def test_rallypoint_run_over_tls_with_an_https_endpoint(
    tls_etcd: EtcdServer, certs: Certs, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], flush=True)\n")
    tls = f"cacert={certs.ca},cert={certs.client_cert},key={certs.client_key}"
    argv = [
        sys.executable, "-m", "rallypoint.run", "--nnodes", "1", "--nproc-per-node", "1",
        "--rdzv-backend", "etcd", "--rdzv-endpoint", f"https://{tls_etcd.endpoint}",
        "--rdzv-id", "cli-tls", "--local-addr", "127.0.0.1", "--log-dir", str(tmp_path / "logs"),
        "--rdzv-conf", f"{tls},read_timeout=10,join_timeout=30", str(script),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0" in proc.stdout
    # A contradicting protocol is a one-line usage error.
    argv[argv.index("--rdzv-conf") + 1] += ",protocol=http"
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "rallypoint run: error: --rdzv-conf protocol=http contradicts the https:// of "
        "--rdzv-endpoint; give one of them"
    ]


def test_etcd_with_auth_rides_out_a_server_restart(
    auth_etcd: EtcdServer, handlers: list[RallypointHandler]
) -> None:
    # etcd keeps auth tokens in memory: a restarted server answers "invalid auth
    # token" to a client that authenticated before, which must authenticate again
    # (pyetcd never does by itself). Two restarts, and every kind of call after
    # each: the round's store, the monitoring queries, the heartbeats (their
    # thread keeps the peer alive), a new round.
    params = _params(auth_etcd.endpoint, "auth-restart", 2, user="trainer", password="trainer-pw")
    handlers.extend(create_handler(params) for _ in range(2))
    infos = join_all(handlers, 60)
    store = infos[0].store  # type: ignore[attr-defined]
    store.set("before", b"1")
    for restart in range(2):
        auth_etcd.restart()
        store.set(f"after{restart}", b"2")
        assert infos[1].store.get("before") == b"1"  # type: ignore[attr-defined]
        for handler in handlers:
            assert handler.num_nodes_waiting() == 0
            assert not handler.is_closed()
        # A few liveness windows of heartbeats under the new tokens: nobody dies.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert all(h.dead_participants() == frozenset() for h in handlers)
            time.sleep(0.05)
    assert {info.rank for info in join_all(handlers, 60)} == {0, 1}  # type: ignore[attr-defined]
