"""Embedded etcd: the agents of the first nodes run the etcd members themselves.

A c10d store lives on one node and dies with it (docs/design.md, decision 12).
Here the store is an etcd cluster whose members are processes of the job's own
agents (3 or 5 members), bootstrapped statically from the member list every node is
given (``--rdzv-endpoint host1,host2,host3``: a headless service's or a Slurm node
list's stable names), and every agent uses the ordinary etcd backend against them.
Losing one member node of three keeps the quorum: the survivors regroup as for any
other node loss.

:class:`EmbeddedMember` is one member's life:

* start: remove a stale data directory (a SIGKILLed agent's), then ask the other
  members whether a cluster with a quorum exists. None: bootstrap (``new``), with the
  static member list. One exists: this node replaces its dead predecessor by etcd's
  runtime reconfiguration (remove the member with this peer URL, add it again, start
  with an empty data dir and ``--initial-cluster-state existing``), so a second loss
  later is survived too. A look that missed a running cluster (no answer in time)
  bootstraps, etcd refuses that for a member the cluster has seen started, and the
  member rejoins as a replacement instead.
* the process dies with the agent: the kernel SIGKILLs it when the agent's thread
  that started it ends (``PR_SET_PDEATHSIG``, util-linux ``setpriv``; that thread
  lives as long as the member), and a watchdog, a separate process in a session of
  its own holding a pipe only the agent writes to, kills the member and removes its
  data directory when the pipe reaches end-of-file without a clean stop.
* stop: :class:`Presence` first waits (bounded) until every agent still present has
  finished with the cluster, so that the last agents' final writes keep a quorum;
  then the member is stopped and its data directory removed.

Members: ``host:port`` is the member's client port; its peer port is ``port + 1``
(etcd's 2379/2380). Each member's name is its ``host-port``; the cluster token is
``rallypoint-<run id>``, so two jobs on the same hosts never join each other's
cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..c10d.store import bind_address
from ..config import ConfigError, EmbeddedEtcd, EtcdTLS, RendezvousConfig, format_endpoint
from ..errors import RendezvousConnectionError
from .backend import EtcdBackend
from .client import classify, error_text
from .server import EtcdServerError, find_etcd_binary
from .store import EtcdStore

__all__ = [
    "LINGER_S",
    "EmbeddedMember",
    "Presence",
    "create_embedded_backend",
    "member_name",
    "peer_port",
]

log = logging.getLogger(__name__)

#: The longest a member waits at the end for agents still using the cluster.
LINGER_S = 10.0
#: How long a stopping member may take before it is killed.
_STOP_GRACE = 1.0
#: What etcd logs when it exits because the cluster removed it.
_REMOVED = "permanently removed from the cluster"
#: What etcd logs when it exits because it was told to bootstrap a cluster
#: that runs already and had this member started before.
_BOOTSTRAPPED = "has already been bootstrapped"
#: How long one probe of another member waits for an answer.
_PROBE_TIMEOUT = 2.0

# The watchdog of one member (see the module docstring): argv = pipe fd, etcd pid,
# data dir, log file. A line "pid N" names the process of a restarted member; a
# line "done" means a clean stop; end-of-file without it means the agent died:
# SIGKILL the newest member process's group, remove its files.
_WATCHDOG = r"""
import os, shutil, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
fd, pid, data, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
seen = b""
while True:
    chunk = os.read(fd, 64)
    if not chunk:
        break
    seen += chunk
lines = seen.decode("ascii", "replace").split("\n")
pids = [int(x[4:]) for x in lines if x.startswith("pid ") and x[4:].isdigit()]
if "done" not in lines:
    try:
        os.killpg(pids[-1] if pids else pid, signal.SIGKILL)
    except OSError:
        pass
    shutil.rmtree(data, ignore_errors=True)
    try:
        os.unlink(log)
    except OSError:
        pass
"""


def peer_port(client_port: int) -> int:
    """A member's peer port: the next one after its client port."""
    return client_port + 1


def member_name(host: str, port: int) -> str:
    """A member's etcd name: ``host-port`` (an IPv6 host's ``:`` become ``_``)."""
    return f"{host.replace(':', '_')}-{port}"


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://{format_endpoint(host, port)}"


class EmbeddedMember:
    """The etcd member this node's agent runs (see the module docstring).

    Args:
        embedded: the member list and which one is this node's (its ``own`` must
            be set).
        run_id: names the data directory and the cluster token.
        tls: serve clients and peers over TLS with these files (the server's
            certificate and key are ``cert``/``key``, which then also authenticate
            this node to its peers; ``cacert`` verifies them); None: plain http.
        connect: builds a client to member ``i`` (the etcd backend's connector,
            with its TLS and authentication), for the probes and reconfiguration.
        binary: the etcd executable (default :func:`find_etcd_binary`).
    """

    def __init__(
        self,
        embedded: EmbeddedEtcd,
        run_id: str,
        *,
        tls: EtcdTLS | None,
        connect: Callable[[int], Any],
        binary: str | None = None,
    ) -> None:
        if embedded.own is None:
            raise ValueError("this node runs no member")
        self.embedded = embedded
        self.index = embedded.own
        self.host, self.client_port = embedded.members[self.index]
        self.name = member_name(self.host, self.client_port)
        self.scheme = "https" if tls is not None else "http"
        self.tls = tls
        self.token = f"rallypoint-{run_id}"
        self.data_dir = Path(embedded.data_dir) / f"rallypoint-etcd-{run_id}-{self.name}"
        self.log_file = self.data_dir.with_name(self.data_dir.name + ".log")
        self._connect = connect
        self._binary = binary
        self._proc: subprocess.Popen[bytes] | None = None
        # Held while a process is spawned or taken for stopping: a restart never
        # starts a process that stop() no longer sees.
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervised = threading.Event()
        self._keeper_stop = threading.Event()
        self._watchdog_fd: int | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._stopped = False
        self._timeout = 60.0
        self._argv_in_use: list[str] = []
        self._log_offset = 0
        #: "new" (static bootstrap) or "existing" (replaced a dead predecessor).
        self.joined_as = ""
        #: How often the member's etcd process exited on its own and was restarted.
        self.restarts = 0

    # -- names and addresses ---------------------------------------------------------

    def _peer_url(self, index: int) -> str:
        host, port = self.embedded.members[index]
        return _url(self.scheme, host, peer_port(port))

    @property
    def peer_url(self) -> str:
        return self._peer_url(self.index)

    @property
    def client_url(self) -> str:
        """The URL the member advertises to clients: its host as listed (a name
        stays a name)."""
        return _url(self.scheme, self.host, self.client_port)

    def _listen_url(self, port: int) -> str:
        # etcd binds IP addresses only, and a listed host name is what peers and
        # clients keep using when a rescheduled node comes back with a new address:
        # advertise the name, listen on the address it stands for here (the c10d
        # store's rule: every interface where that is ambiguous).
        return _url(self.scheme, bind_address(self.host) or "0.0.0.0", port)

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None else proc.pid

    def is_running(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None

    # -- start -----------------------------------------------------------------------

    def start(self, timeout: float) -> None:
        """Start the member and wait until it serves a quorum read; from then on
        an etcd process that exits on its own is restarted (see :meth:`_recover`).

        Raises:
            RendezvousConnectionError: etcd is missing, exited, or found no quorum
                within ``timeout`` seconds (the message names the members that do
                not answer).
        """
        self._timeout = timeout
        deadline = time.monotonic() + timeout
        self.log_file.unlink(missing_ok=True)
        try:
            while True:
                shutil.rmtree(self.data_dir, ignore_errors=True)  # a SIGKILLed agent's
                self.data_dir.mkdir(mode=0o700, parents=True)
                initial, state = self._initial_cluster(max(deadline - time.monotonic(), 0.1))
                self.joined_as = state
                self._launch(initial, state)
                try:
                    self._wait_serving(max(deadline - time.monotonic(), 0.1))
                    break
                except RendezvousConnectionError:
                    # No other member answered the first look (a loaded host, a
                    # slow network), so this one bootstrapped: etcd refuses when
                    # the cluster is running and had a member here before. That
                    # answer is certain where the look was not: rejoin.
                    missed = state == "new" and _BOOTSTRAPPED in self._log_since(self._log_offset)
                    if not missed or time.monotonic() >= deadline:
                        raise
                log.warning("embedded etcd member %s: the running cluster did not answer "
                            "at first; rejoining it", self.name)  # fmt: skip
        except BaseException:
            self.stop()
            raise
        self._supervised.set()
        log.info(
            "embedded etcd member %s serving at %s (%s cluster)",
            self.name,
            self.client_url,
            "joined the running" if state == "existing" else "bootstrapped a new",
        )

    def _others(self) -> list[int]:
        return [i for i in range(len(self.embedded.members)) if i != self.index]

    def _client(self, index: int) -> Any:
        return self._connect(index)

    def _quorum_client(self) -> Any:
        """A client to another member that serves a quorum read now, or None."""
        for index in self._others():
            client = None
            try:
                client = self._client(index)
                client.get(f"/rallypoint-probe/{self.token}")
                return client
            except Exception as exc:
                if client is not None:
                    with contextlib.suppress(Exception):
                        client.close()
                log.debug("member %d: %s", index, error_text(exc))
        return None

    def _initial_cluster(self, timeout: float) -> tuple[str, str]:
        """(``--initial-cluster``, ``--initial-cluster-state``): the static list
        when no cluster has a quorum; else this member re-added to the running one.

        etcd refuses a reconfiguration ("unhealthy cluster") until the members
        that keep the quorum have been connected for 5 s (a cluster just
        bootstrapped, a member just replaced): that is retried for ``timeout``.
        """
        static = ",".join(
            f"{member_name(host, port)}={self._peer_url(i)}"
            for i, (host, port) in enumerate(self.embedded.members)
        )
        deadline = time.monotonic() + timeout
        while True:
            client = self._quorum_client()
            if client is None:
                return static, "new"
            try:
                return self._rejoin(client), "existing"
            except Exception as exc:
                if classify(exc) is None or time.monotonic() >= deadline:
                    raise RendezvousConnectionError(
                        f"the embedded etcd member {self.name} cannot rejoin the running "
                        f"cluster ({error_text(exc)}); its other members must be healthy"
                    ) from exc
                log.info("embedded etcd: rejoining the cluster: %s; retrying", error_text(exc))
            finally:
                with contextlib.suppress(Exception):
                    client.close()
            time.sleep(0.5)

    def _rejoin(self, client: Any) -> str:
        """Remove this member's predecessor (same name, or same peer URL: one added
        and never started has no name yet) and add it anew, by etcd's runtime
        reconfiguration; the new ``--initial-cluster``.

        The peer URL carries the listed host, so a predecessor that ran at
        another address under the same name is found too."""
        for member in list(client.members):
            if member.name == self.name or self.peer_url in list(member.peer_urls):
                log.warning(
                    "embedded etcd: replacing member %s (id %x) of the running cluster",
                    member.name or self.name,
                    member.id,
                )
                client.remove_member(member.id)
        client.add_member([self.peer_url])
        entries: list[str] = []
        for member in client.members:
            urls = list(member.peer_urls)
            name = member.name or (self.name if self.peer_url in urls else "")
            if not name:  # another member added and not started yet
                continue
            entries.extend(f"{name}={url}" for url in urls)
        return ",".join(entries)

    def _argv(self, initial: str, state: str) -> list[str]:
        args = [
            self._binary or find_etcd_binary(),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self._listen_url(self.client_port)}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self._listen_url(peer_port(self.client_port))}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={initial}",
            f"--initial-cluster-state={state}",
            f"--initial-cluster-token={self.token}",
            "--log-level=warn",
        ]
        if self.tls is not None:
            if self.tls.cert is None or self.tls.key is None:
                raise RendezvousConnectionError(
                    "the embedded etcd over TLS needs cert and key (this member's "
                    "certificate, for its clients and its peers)"
                )
            args += [f"--cert-file={self.tls.cert}", f"--key-file={self.tls.key}"]
            args += [f"--peer-cert-file={self.tls.cert}", f"--peer-key-file={self.tls.key}"]
            if self.tls.cacert is not None:
                args += ["--client-cert-auth", f"--trusted-ca-file={self.tls.cacert}"]
                args += ["--peer-client-cert-auth", f"--peer-trusted-ca-file={self.tls.cacert}"]
        return args

    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes] | None:
        """Start the etcd process (from the keeper thread only: the kernel kills
        it when the thread that forked it ends); None once stopping."""
        with self._lock:
            if self._stopping.is_set():
                return None
            with open(self.log_file, "ab") as log_file:
                self._log_offset = log_file.tell()
                proc = subprocess.Popen(
                    _die_with_this_thread(argv),
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # a Ctrl-C to the agent's group misses it
                )
            self._proc = proc
            self._argv_in_use = argv
            fd = self._watchdog_fd
            if fd is not None:  # a restart: the watchdog must kill this one now
                with contextlib.suppress(OSError):
                    os.write(fd, f"\npid {proc.pid}\n".encode())
            return proc

    def _launch(self, initial: str, state: str) -> None:
        argv = self._argv(initial, state)
        started: dict[str, Any] = {}
        ready = threading.Event()

        def keep() -> None:
            # PR_SET_PDEATHSIG fires when the *thread* that forked ends: this one
            # lives until the member is stopped (or the process dies), and starts
            # every restart of the member itself.
            try:
                started["proc"] = self._spawn(argv)
            except OSError as exc:
                started["error"] = exc
            finally:
                ready.set()
            proc = started.get("proc")
            if proc is not None:
                self._supervise(proc)
            self._keeper_stop.wait()

        threading.Thread(target=keep, name=f"rallypoint-etcd-{self.name}", daemon=True).start()
        ready.wait()
        if "error" in started:
            raise RendezvousConnectionError(f"cannot start etcd ({started['error']})")
        if started.get("proc") is None:
            raise RendezvousConnectionError(f"the embedded etcd member {self.name} was stopped")
        if self._watchdog_fd is None:  # else _spawn told the running watchdog
            self._start_watchdog(started["proc"].pid)

    # -- a member process that exits on its own --------------------------------------

    def _exit_code(self, proc: subprocess.Popen[bytes]) -> int | None:
        """Wait until ``proc`` exits (its code) or the member is stopping (None)."""
        while not self._stopping.is_set():
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
        return None

    def _supervise(self, proc: subprocess.Popen[bytes]) -> None:
        """Restart the member each time its process exits on its own, until the
        member is stopping. A process that exits before :meth:`start` succeeded
        is start's failure to report, not one to restart."""
        while True:
            code = self._exit_code(proc)
            if code is None or self._stopping.is_set():  # stop() ended it
                return
            while not self._supervised.is_set():
                if self._stopping.wait(0.1) or self._proc is not proc:
                    return  # stopping, or start launched another process since
            if _REMOVED in self._log_since(self._log_offset):
                # Another node runs this member now (a replacement under the same
                # name): re-adding this one would remove that one, and so on.
                log.error("embedded etcd member %s was removed from the cluster (a "
                          "replacement took its place); this node goes on as a client "
                          "only", self.name)  # fmt: skip
                return
            restarted = self._recover(code)
            if restarted is None:
                return
            proc = restarted

    def _recover(self, code: int) -> subprocess.Popen[bytes] | None:
        """The member's etcd exited with ``code`` while its agent lives: start it
        again, so that the cluster does not run one member short until this node
        goes. First with its data, as it was (etcd resumes from its write-ahead
        log and rejoins by itself); when that process exits too (the data is
        gone or damaged), by reconfiguration, as a replacement does: empty data,
        the old member removed and added anew. Retried, with growing pauses,
        until a process serves or the member is stopping (None)."""
        self.restarts += 1
        last = self.tail().splitlines()[-1:] or ["(empty log)"]
        log.warning("embedded etcd member %s exited with %s; restarting it (its log: %s)",
                    self.name, code, last[0][:300])  # fmt: skip
        with_data = (self.data_dir / "member").is_dir()
        pause = 0.5
        while not self._stopping.is_set():
            argv = self._argv_in_use if with_data else self._reconfigured_argv()
            proc = None if argv is None else self._spawn(argv)
            if proc is not None:
                outcome = self._restart_outcome(proc)
                if outcome != "exited":
                    log.warning("embedded etcd member %s restarted (%s, %s)", self.name,
                                "with its data" if with_data else "by reconfiguration",
                                outcome)  # fmt: skip
                    return proc
                log.warning("embedded etcd member %s exited again with %s: %s", self.name,
                            proc.returncode, self.tail().splitlines()[-1:])  # fmt: skip
                with_data = False
            if self._stopping.wait(pause):
                break
            pause = min(2 * pause, 10.0)
        return None

    def _reconfigured_argv(self) -> list[str] | None:
        """The command line of this member re-added to the running cluster with
        an empty data directory; None while no other member serves a quorum or
        the reconfiguration fails (the caller retries)."""
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        client = self._quorum_client()
        if client is None:
            log.warning("embedded etcd member %s: no other member serves a quorum to "
                        "rejoin; retrying", self.name)  # fmt: skip
            return None
        try:
            initial = self._rejoin(client)
        except Exception as exc:
            log.warning("embedded etcd member %s: rejoining the cluster: %s; retrying",
                        self.name, error_text(exc))  # fmt: skip
            return None
        finally:
            with contextlib.suppress(Exception):
                client.close()
        return self._argv(initial, "existing")

    def _restart_outcome(self, proc: subprocess.Popen[bytes]) -> str:
        """"serving" (it answers a quorum read), "exited", "stopping", or
        "running" (alive and silent for the start timeout: the quorum is what is
        missing, not this process)."""
        deadline = time.monotonic() + self._timeout
        client = None
        try:
            while True:
                if self._stopping.is_set():
                    return "stopping"
                if proc.poll() is not None:
                    return "exited"
                try:
                    if client is None:
                        client = self._client(self.index)
                    client.get(f"/rallypoint-probe/{self.token}")
                    return "serving"
                except Exception as exc:
                    if classify(exc) is None:
                        log.debug("probing the restarted member: %s", error_text(exc))
                if time.monotonic() >= deadline:
                    return "running"
                time.sleep(0.1)
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()

    def _start_watchdog(self, pid: int) -> None:
        if os.name != "posix":
            return
        read_end, write_end = os.pipe()
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(read_end), str(pid),
                 str(self.data_dir), str(self.log_file)],
                pass_fds=(read_end,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            os.close(write_end)
            log.warning("no watchdog for the embedded etcd member (%s)", exc)
        else:
            with self._lock:
                self._watchdog_fd = write_end
                proc = self._proc
                if proc is not None and proc.pid != pid:  # restarted meanwhile
                    with contextlib.suppress(OSError):
                        os.write(write_end, f"\npid {proc.pid}\n".encode())
        finally:
            os.close(read_end)

    def _wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = self._client(self.index)
        try:
            while True:
                proc = self._proc
                if proc is None or proc.poll() is not None:
                    code = None if proc is None else proc.returncode
                    raise RendezvousConnectionError(
                        f"the embedded etcd member {self.name} exited with {code}: {self.tail()}"
                    )
                try:
                    client.get(f"/rallypoint-probe/{self.token}")
                    return
                except Exception as exc:
                    if classify(exc) is None:
                        raise
                if time.monotonic() >= deadline:
                    raise RendezvousConnectionError(
                        f"the embedded etcd has no quorum after {timeout:g} s: "
                        f"{self.quorum_report() or 'no member answers'}"
                    )
                time.sleep(0.1)
        finally:
            with contextlib.suppress(Exception):
                client.close()

    # -- what is wrong -----------------------------------------------------------------

    def quorum_report(self) -> str | None:
        """Which members do not answer, when too few do for a quorum (else None)."""
        return quorum_report(self.embedded, self._connect)

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_file, "rb") as log_file:
                log_file.seek(offset)
                return log_file.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-1500:].strip() or "(empty log)"
        except OSError:
            return "(no log)"

    # -- stop --------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the member and remove its data directory and log (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        with self._lock:
            self._stopping.set()
            proc, self._proc = self._proc, None
        started = time.monotonic()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                # The last members wait seconds for a quorum that is gone before
                # they exit; their data is thrown away, nothing is lost by a kill.
                proc.wait(timeout=_STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.debug("etcd member %s stopped in %.2f s", self.name, time.monotonic() - started)
        self._keeper_stop.set()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.log_file.unlink(missing_ok=True)
        with self._lock:
            fd, self._watchdog_fd = self._watchdog_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, b"\ndone\n")
            os.close(fd)
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            try:
                watchdog.wait(timeout=5)
            except subprocess.TimeoutExpired:
                watchdog.kill()
                watchdog.wait()


def _die_with_this_thread(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped so the kernel SIGKILLs it when the thread that starts it
    ends (Linux, util-linux ``setpriv``); as is elsewhere (the watchdog remains)."""
    setpriv = shutil.which("setpriv") if sys.platform == "linux" else None
    if setpriv is None:
        return list(argv)
    return [setpriv, "--pdeathsig", "KILL", "--", *argv]


def quorum_report(embedded: EmbeddedEtcd, connect: Callable[[int], Any]) -> str | None:
    """What to tell the user when fewer than a majority of the members answer a
    status request (naming those that do not); None when a majority does."""
    lost = []
    for index, (host, port) in enumerate(embedded.members):
        client = None
        try:
            client = connect(index)
            client.status()
        except Exception:
            lost.append(member_name(host, port))
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
    total = len(embedded.members)
    needed = total // 2 + 1
    if total - len(lost) >= needed:
        return None
    alive = total - len(lost)
    return (
        f"the embedded etcd lost its quorum: members {', '.join(lost)} do not answer "
        f"({alive} of {total} answer{'s' if alive == 1 else ''}, {needed} needed); "
        "their nodes are gone: restart the job"
    )


class Presence:
    """Which agents still use the cluster, so that members stop last.

    Each agent puts ``agents/<node>`` under a lease it keeps alive; at the end it
    puts ``done/<node>``. A member's agent, at the end, waits (at most
    :data:`LINGER_S`) until every agent still present is done, so the final writes
    of the others (closing the rendezvous, leaving) keep a quorum; a SIGKILLed
    agent's key expires with its lease.

    Args:
        call: runs ``op(client)`` once, with no retry (raises on failure).
        root: this run's key prefix (``/rallypoint/<run_id>/``).
        node: this agent's name.
        ttl: the lease, seconds.
    """

    def __init__(
        self, call: Callable[[Callable[[Any], Any]], Any], root: str, node: str, ttl: int
    ) -> None:
        self._call = call
        self._agents = f"{root}embedded/agents/"
        self._done = f"{root}embedded/done/"
        self._node = node
        self._ttl = ttl
        self._lease: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def enter(self) -> None:
        """Register this agent and keep its lease alive (a daemon thread)."""
        self._lease = self._call(lambda c: c.lease(self._ttl))
        lease = self._lease
        self._call(lambda c: c.put(self._agents + self._node, b"1", lease=lease))
        self._thread = threading.Thread(
            target=self._keep_alive, name="rallypoint-etcd-presence", daemon=True
        )
        self._thread.start()

    def _keep_alive(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            with contextlib.suppress(Exception):
                self._call(lambda c: c.refresh_lease(self._lease.id))

    def _pending(self) -> set[str]:
        def names(prefix: str) -> set[str]:
            pairs = self._call(lambda c: list(c.get_prefix(prefix)))
            return {meta.key.decode()[len(prefix) :] for _, meta in pairs}

        return names(self._agents) - names(self._done)

    def leave(self, wait: float) -> None:
        """Say this agent is done; then, for up to ``wait`` seconds (0: not at
        all), wait until every agent still present is done. Never raises."""
        self._stop.set()
        if self._lease is None:
            return
        lease = self._lease
        try:
            self._call(lambda c: c.put(self._done + self._node, b"1", lease=lease))
        except Exception as exc:
            log.debug("embedded etcd: marking %s done: %s", self._node, error_text(exc))
            return
        started = time.monotonic()
        deadline = started + wait
        while time.monotonic() < deadline:
            try:
                pending = self._pending()
            except Exception:  # the cluster is going: nobody can use it any more
                break
            if not pending:
                break
            # Keep this agent present while it waits, or the others stop early.
            with contextlib.suppress(Exception):
                self._call(lambda c: c.refresh_lease(lease.id))
            time.sleep(0.1)
        log.debug("embedded etcd: %s waited %.2f s for the others", self._node,
                  time.monotonic() - started)  # fmt: skip
        with contextlib.suppress(Exception):
            self._call(lambda c: c.revoke_lease(lease.id))


def create_embedded_backend(config: RendezvousConfig) -> tuple[EtcdBackend, EtcdStore]:
    """Start this node's member (if it runs one), then the etcd backend on every
    member, which on close says this agent is done, waits for the agents still
    present (a member only) and stops the member.

    Raises:
        ConfigError: this node runs a member and no etcd binary is installed.
        RendezvousConnectionError: the member cannot start or finds no quorum
            within ``join_timeout`` (naming the members that do not answer), or
            the cluster does not answer within ``read_timeout``.
    """
    from .store import _connector, create_etcd_backend

    embedded = config.embedded
    assert embedded is not None
    members = list(embedded.members)
    connect = _connector(members, config, _PROBE_TIMEOUT)
    member: EmbeddedMember | None = None
    if embedded.own is not None:
        try:
            binary = find_etcd_binary()
        except EtcdServerError as exc:  # an install to fix, before anything starts
            address = format_endpoint(*members[embedded.own])
            raise ConfigError(f"this node runs the etcd member {address}, but {exc}") from exc
        member = EmbeddedMember(embedded, config.settings.run_id, tls=config.etcd_tls,
                                connect=connect, binary=binary)  # fmt: skip
        member.start(timeout=config.settings.join_timeout)
    own = [] if embedded.own is None else [embedded.own]
    order = own + [i for i in range(len(members)) if i not in own]
    client_config = dataclasses.replace(
        config, endpoint=",".join(format_endpoint(*members[i]) for i in order)
    )
    presence: list[Presence] = []

    def leave() -> None:
        for each in presence:
            each.leave(LINGER_S if member is not None else 0.0)

    def stop_member() -> None:
        if member is not None:
            member.stop()

    try:
        backend, store = create_etcd_backend(
            client_config,
            diagnose=lambda: quorum_report(embedded, connect),
            on_close=[leave, stop_member],
            first_listed=member is not None,  # its own member: no network hop
        )
    except BaseException:
        stop_member()
        raise

    def once(op: Callable[[Any], Any]) -> Any:
        connection = backend.connection
        client = connection.current()
        try:
            return op(client)
        except Exception as exc:
            kind = classify(exc)
            if kind is not None:
                connection.failed(client, kind)
            raise

    node = f"{config.local_addr}_{os.getpid()}_{secrets.token_hex(4)}"
    ttl = max(3, math.ceil(2 * config.settings.keep_alive_interval))
    agent = Presence(once, backend.key(""), node, ttl)
    try:
        backend.call(lambda _c: agent.enter())
    except BaseException:
        backend.close()
        raise
    presence.append(agent)
    return backend, store
