"""Rendezvous options as torchrun takes them, and the bound on reaching a store.

torchrun hands every ``--rdzv-conf`` key to every backend and each torch handler
skips the keys it does not read, so job scripts (and torch's own launcher tests)
pass ``timeout=`` to c10d. Such a job runs here too, with one warning; a key no
backend reads is still refused. Reaching a store that does not answer fails, on
every rallypoint backend, after the smaller of ``read_timeout`` and
``join_timeout``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rallypoint.adapters import create_handler
from rallypoint.adapters.errors import RendezvousConnectionError
from rallypoint.adapters.etcd.server import EtcdServer

pytestmark = pytest.mark.integration

#: Far above a rendezvous of one node, far below torch's 600 s store timeout.
RUN_TIMEOUT = 120


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    # One write each: the two workers share the agent's stdout.
    path.write_text("import os\nos.write(1, f\"rank{os.environ['RANK']}\\n\".encode())\n")
    return str(path)


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``rallypoint run ARGV`` to its end; its process group is killed if it hangs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(
        [sys.executable, "-m", "rallypoint", "run", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    ) as popen:
        try:
            out, err = popen.communicate(timeout=RUN_TIMEOUT)
        finally:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.communicate()
    return subprocess.CompletedProcess(popen.args, popen.returncode, out, err)


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[rallypoint WARNING]")]


@pytest.mark.parametrize(
    ("option", "warned"),
    [
        # The forms of torch's launcher tests (test/distributed/launcher/run_test.py),
        # the first with the shell quotes its argument list keeps.
        ("--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'", ["quotes", "timeout"]),
        ("--rdzv_conf=timeout=5", ["timeout"]),
        ("--rdzv-conf=join_timeout=5,last_call_timeout=1,timeout=5", ["timeout"]),
    ],
)
def test_c10d_job_with_torchs_timeout_key_runs_with_its_warning(
    option: str, warned: list[str], script: str, free_port: Callable[[], int]
) -> None:
    proc = _run(
        [
            "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{free_port()}",
            "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0", option, script,
        ]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == ["rank0", "rank1"]
    warnings = _warnings(proc.stderr)
    assert len(warnings) == len(warned), proc.stderr
    if "quotes" in warned:
        assert "reading it without its quotes" in warnings.pop(0)
    (warning,) = warnings
    assert "--rdzv-conf timeout is ignored by the c10d backend" in warning
    assert "join_timeout" in warning


def test_etcd_job_with_torchs_etcd_v1_keys_runs_with_a_warning_each(
    script: str, etcd_server: EtcdServer
) -> None:
    proc = _run(
        [
            "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd_server.endpoint}",
            f"--rdzv-id=keys-{os.getpid()}", "--nnodes=1", "--nproc-per-node=1",
            "--rdzv-conf=timeout=5,etcd_prefix=/torchelastic/p2p,last_call_timeout=1", script,
        ]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    warnings = _warnings(proc.stderr)
    assert len(warnings) == 2, proc.stderr
    assert "etcd_prefix is ignored by the etcd backend" in warnings[0]
    assert "timeout is ignored by the etcd backend" in warnings[1]


def test_misspelt_key_is_still_refused(script: str) -> None:
    proc = _run(
        [
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", "--nnodes=1",
            "--rdzv_conf=join_timeout=5,timout=5", script,
        ]
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "rallypoint run: error: --rdzv-conf 'timout' is unknown to the c10d backend; did you "
        "mean 'timeout'? known options: close_timeout, heartbeat_timeout, is_host, join_timeout, "
        "keep_alive_interval, keep_alive_max_attempt, last_call_timeout, read_timeout, "
        "stable_ranks, store_type"
    ]


# ------------------------------------------------ a store that does not answer


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


@pytest.fixture
def refused_port(free_port: Callable[[], int]) -> int:
    return free_port()


JOIN_TIMEOUT = 2


@pytest.mark.parametrize("backend", ["rallypoint-c10d", "rallypoint-etcd"])
@pytest.mark.parametrize("store", ["refused_port", "silent_port"])
def test_a_store_that_does_not_answer_fails_after_the_join_timeout(
    backend: str, store: str, request: pytest.FixtureRequest
) -> None:
    port = request.getfixturevalue(store)
    conf = {"join_timeout": str(JOIN_TIMEOUT)}  # read_timeout stays at its 60 s
    if backend.endswith("c10d"):
        conf["is_host"] = "false"
    params = RendezvousParameters(
        backend, f"127.0.0.1:{port}", f"unreachable-{os.getpid()}", 1, 1, "127.0.0.1", **conf
    )
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="the smaller of read_timeout and join"):
        create_handler(params)
    # Generous: the bound is what matters, not the exact figure (it was 60 s and more).
    assert time.monotonic() - started < JOIN_TIMEOUT + 10
