"""The asyncio executor (adapters/aio.py), and the embedding examples of README.md and
docs/adapters.md, run as written: on the asyncio memory backend and on a real etcd."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rallypoint.adapters.aio import (
    AsyncBackend,
    AsyncMemoryBackend,
    AsyncRendezvous,
    ThreadedBackend,
)
from rallypoint.adapters.backend import MemoryBackend
from rallypoint.adapters.errors import RendezvousConnectionError
from rallypoint.core import (
    Action,
    Done,
    Joined,
    NodeDesc,
    Regroup,
    RendezvousNode,
    Settings,
)

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(path: Path, containing: str) -> list[str]:
    """The ```python blocks of ``path`` that contain ``containing``."""
    blocks = re.findall(r"^```python\n(.*?)^```", path.read_text(), re.M | re.S)
    return [block for block in blocks if containing in block]


def docs_example() -> str:
    (block,) = python_blocks(ROOT / "docs" / "adapters.md", "async def four_nodes")
    return block


def four_nodes_on(backend_of: Any) -> dict[int, Any]:
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    exec(compile(docs_example(), "docs/adapters.md", "exec"), namespace)
    return asyncio.run(namespace["four_nodes"](backend_of))  # type: ignore[no-any-return]


def check_the_last_two(rounds: dict[int, Any]) -> None:
    """Nodes 0 and 1 hold one round of exactly the two of them."""
    first, second = rounds[0], rounds[1]
    assert first == second._replace(rank=first.rank)
    assert first.members == {NodeDesc("127.0.0.1", 0, 0), NodeDesc("127.0.0.1", 1, 0)}
    assert {first.rank, second.rank} == {0, 1} and first.world_size == 2
    # one round to join, one without the killed node, one without the leaver
    assert first.round >= 2


def test_the_readme_embedding_example_runs() -> None:
    (block,) = python_blocks(ROOT / "README.md", "AsyncRendezvous")
    ran = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert sorted(line for line in lines if "rank" in line) == [
        "node 0: rank 0 of 2 in round 0",
        "node 1: rank 1 of 2 in round 0",
    ]
    assert sorted(line for line in lines if line.endswith("FINISH")) == [
        "node 0: FINISH",
        "node 1: FINISH",
    ]


def test_the_docs_example_is_short() -> None:
    assert len(docs_example().strip().splitlines()) < 60


def test_four_nodes_join_one_is_killed_one_leaves_on_the_memory_backend() -> None:
    memory = AsyncMemoryBackend()
    check_the_last_two(four_nodes_on(lambda i: memory))


def test_an_asyncio_embedder_never_imports_torch() -> None:
    # torch's import takes seconds, and an embedder on its own store has no use for
    # it: the executor, the backends' protocol and the memory backends run without.
    script = (
        docs_example().split('if __name__ == "__main__":')[0]
        + "import sys\n"
        + "import rallypoint.adapters.backend, rallypoint.adapters.sync\n"
        + "memory = AsyncMemoryBackend()\n"
        + "asyncio.run(four_nodes(lambda i: memory))\n"
        + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[-1] == "[]"


@pytest.fixture
def cpu_load() -> Iterator[None]:
    """Two processes that keep the CPUs busy while the test runs (the races of a
    loaded machine), stopped after it."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@pytest.mark.integration
def test_cancelled_nodes_end_cleanly_under_load(cpu_load: None, tmp_path: Path) -> None:
    # The docs' example cancels every node's task and awaits them. Cancelled in
    # the middle of a wait for the phase, none may raise at shutdown or stay
    # pending for ever; several runs, since one cancel lands at a random point.
    script = tmp_path / "cancel_nodes.py"
    script.write_text(
        docs_example().split('if __name__ == "__main__":')[0]
        + "for run in range(8):\n"
        + "    memory = AsyncMemoryBackend()\n"
        + "    asyncio.run(four_nodes(lambda i: memory))\n"
        + "    print('run', run, 'ended', flush=True)\n"
    )
    try:
        ran = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"asyncio.run did not end after its nodes were cancelled: {exc.stdout!r}")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.count("ended") == 8
    assert "Traceback" not in ran.stderr and "exception" not in ran.stderr, ran.stderr


def test_four_nodes_on_the_blocking_memory_backend_in_threads() -> None:
    memory = MemoryBackend("threads")
    check_the_last_two(four_nodes_on(lambda i: ThreadedBackend(memory)))
    memory.close()


@pytest.fixture
def etcd_backends(etcd_server: Any) -> Iterator[Any]:
    """A factory of one etcd backend per node (own client), on a fresh run id; all
    are closed at teardown."""
    import pyetcd

    from rallypoint.adapters.etcd import EtcdBackend

    run_id = f"aio-{uuid.uuid4().hex[:8]}"
    made: list[EtcdBackend] = []

    def backend_of(_: int) -> ThreadedBackend:
        client = pyetcd.client("127.0.0.1", etcd_server.client_port, timeout=5)
        backend = EtcdBackend(client, run_id, endpoint=etcd_server.endpoint)
        made.append(backend)
        return ThreadedBackend(backend)

    try:
        yield backend_of
    finally:
        for backend in made:
            backend.close()


@pytest.mark.integration
def test_four_nodes_join_one_is_killed_one_leaves_on_a_real_etcd(etcd_backends: Any) -> None:
    check_the_last_two(four_nodes_on(etcd_backends))


def test_the_backends_meet_the_async_protocol() -> None:
    assert isinstance(AsyncMemoryBackend(), AsyncBackend)
    assert isinstance(ThreadedBackend(MemoryBackend()), AsyncBackend)


SETTINGS = Settings("aio", min_nodes=1, max_nodes=1, keep_alive_interval=0.2, join_timeout=2.0)


async def _events_of(rendezvous: AsyncRendezvous, limit: int) -> list[object]:
    seen: list[object] = []
    async for event in rendezvous.events():
        seen.append(event)
        if isinstance(event, Joined):
            rendezvous.close()
        if len(seen) >= limit:
            break
    return seen


def test_a_close_ends_the_events_with_done() -> None:
    node = RendezvousNode(NodeDesc("127.0.0.1", 1, 0), SETTINGS)
    rendezvous = AsyncRendezvous(AsyncMemoryBackend(), node)
    rendezvous.join()
    seen = asyncio.run(asyncio.wait_for(_events_of(rendezvous, 5), 30))
    assert [type(e) for e in seen] == [Joined, Done]
    done = seen[1]
    assert isinstance(done, Done) and done.action is Action.FINISH and done.state.closed
    assert not node.busy


class _Unreachable(AsyncMemoryBackend):
    async def get_state(self) -> Any:
        raise RendezvousConnectionError("the store is down (injected)")


def test_an_unreachable_store_fails_the_join_at_its_deadline() -> None:
    node = RendezvousNode(NodeDesc("127.0.0.1", 1, 0), SETTINGS)
    rendezvous = AsyncRendezvous(_Unreachable(), node, retry_pause=0.05)
    rendezvous.join()
    with pytest.raises(RendezvousConnectionError, match="injected"):
        asyncio.run(asyncio.wait_for(_events_of(rendezvous, 5), 30))


def test_a_member_that_cannot_renew_its_lease_regroups_fenced() -> None:
    """The node asks for the fence: its workers stop before its peers may declare
    it dead, and it joins again."""

    class Failing(AsyncMemoryBackend):
        down = False

        async def beat(self, node: str) -> int:
            if self.down:
                raise RendezvousConnectionError("the store is down (injected)")
            return await super().beat(node)

        async def get_state(self) -> Any:
            if self.down:
                raise RendezvousConnectionError("the store is down (injected)")
            return await super().get_state()

    backend = Failing()
    node = RendezvousNode(NodeDesc("127.0.0.1", 1, 0), SETTINGS)
    rendezvous = AsyncRendezvous(backend, node, retry_pause=0.02)
    rendezvous.join()

    async def run() -> list[object]:
        seen: list[object] = []
        async for event in rendezvous.events():
            seen.append(event)
            backend.down = True
            if isinstance(event, Regroup):
                return seen
        return seen

    seen = asyncio.run(asyncio.wait_for(run(), 30))
    assert [type(e) for e in seen] == [Joined, Regroup]
    regroup = seen[1]
    assert isinstance(regroup, Regroup) and regroup.fenced and regroup.round == 0
