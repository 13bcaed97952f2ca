"""Rendezvous latency on loopback: rallypoint vs torch's DynamicRendezvousHandler.

For each n, n real processes join one rendezvous with min_nodes = max_nodes = n:
n-1 of them join first and settle, then the last one joins. The figure is the time
from the last node's ``next_rendezvous()`` call until every node has returned
(all clocks are the same host's CLOCK_MONOTONIC, so times compare across
processes). torch runs in the same invocation, on the same worker processes, over
the same kind of TCPStore; rallypoint also runs over a real etcd server.

Also printed: backend operations and bytes per node for one rendezvous, and the
state bytes one heartbeat writes per node at the largest n (rallypoint: its own
counter key; torch: a compare-and-set of the whole state, measured as the size of
the stored state).

    .venv/bin/python bench/rendezvous_latency.py                 # n = 2 4 8 16 32
    .venv/bin/python bench/rendezvous_latency.py --sizes 2 4 --no-etcd

Workers are this file run with ``--worker``: one process per node, reused across
trials, commanded by JSON lines on stdin (no pickle).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from queue import Empty, Queue
from typing import Any

# Loopback only, and quiet c10d logs (a timed-out TCPStore wait logs a warning).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

SETTLE_S = 1.5
CONF = {
    "join_timeout": "120",
    "last_call_timeout": "30",
    "keep_alive_interval": "5",
    "keep_alive_max_attempt": "3",
    "local_addr": "127.0.0.1",
}


# -- worker side -------------------------------------------------------------------


class _CountingStore:
    """Counts the operations and bytes torch's C10dRendezvousBackend sends."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.ops = 0
        self.bytes = 0

    @staticmethod
    def _size(value: Any) -> int:
        return len(value) if isinstance(value, (bytes, str)) else 0

    def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
        result = self._store.compare_set(key, expected, desired)
        self.ops += 1
        self.bytes += len(key) + self._size(expected) + self._size(desired) + self._size(result)
        return result

    def get(self, key: str) -> Any:
        result = self._store.get(key)
        self.ops += 1
        self.bytes += len(key) + self._size(result)
        return result

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, value)
        self.ops += 1
        self.bytes += len(key) + self._size(value)


class _Worker:
    def __init__(self) -> None:
        self.handler: Any = None
        self.counter: Any = None

    def create(self, cmd: dict[str, Any]) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        impl, endpoint, run_id, n = cmd["impl"], cmd["endpoint"], cmd["run_id"], cmd["n"]
        if impl == "torch-c10d":
            from torch.distributed import TCPStore
            from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
                C10dRendezvousBackend,
            )
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

            host, port = endpoint.rsplit(":", 1)
            store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120))
            self.counter = _CountingStore(store)
            backend = C10dRendezvousBackend(self.counter, run_id)  # type: ignore[arg-type]
            params = RendezvousParameters("c10d", endpoint, run_id, n, n, **CONF)
            self.handler = create_handler(store, backend, params)
        else:
            from rallypoint.adapters import create_handler as rp_create

            backend_name = "rallypoint-c10d" if impl == "rallypoint-c10d" else "rallypoint-etcd"
            conf = {**CONF, "is_host": "false"} if impl == "rallypoint-c10d" else CONF
            params = RendezvousParameters(backend_name, endpoint, run_id, n, n, **conf)
            self.handler = rp_create(params)

    def join(self) -> dict[str, Any]:
        called = time.monotonic()
        info = self.handler.next_rendezvous()
        returned = time.monotonic()
        result: dict[str, Any] = {
            "called": called,
            "returned": returned,
            "rank": info.rank,
            "world": info.world_size,
        }
        if self.counter is not None:
            result["ops"], result["bytes"] = self.counter.ops, self.counter.bytes
        else:
            stats = self.handler.sync.backend.stats
            result["ops"] = stats.ops
            result["bytes"] = stats.bytes_written + stats.bytes_read
        return result

    def heartbeat(self) -> dict[str, Any]:
        if self.counter is not None:
            return {}
        backend = self.handler.sync.backend
        before = backend.stats.heartbeat_bytes_written
        self.handler.sync.beat()
        return {
            "hb_bytes": backend.stats.heartbeat_bytes_written - before,
            "blob_bytes": len(backend.get_state()[0]),
        }

    def leave(self) -> None:
        handler, self.handler, self.counter = self.handler, None, None
        if handler is None:
            return
        if hasattr(handler, "close"):
            handler.close()
        else:
            handler._stop_heartbeats()  # torch: stop beating; the run id is discarded


def worker_main() -> None:
    worker = _Worker()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "create":
                worker.create(cmd)
                reply: dict[str, Any] = {}
            elif op == "join":
                print(json.dumps({"calling": True}), flush=True)
                reply = worker.join()
            elif op == "heartbeat":
                reply = worker.heartbeat()
            elif op == "leave":
                worker.leave()
                reply = {}
            else:
                reply = {"error": f"unknown op {op}"}
        except Exception as exc:  # reported to the coordinator, which aborts
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({"done": op, **reply}), flush=True)


# -- coordinator side -----------------------------------------------------------------


class _Proc:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.lines: Queue[dict[str, Any]] = Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def expect(self, key: str, timeout: float = 180.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except Empty:
                raise TimeoutError(f"worker {self.proc.pid}: no {key!r} in {timeout} s") from None
            if "error" in msg:
                raise RuntimeError(f"worker {self.proc.pid}: {msg['error']}")
            if key in msg:
                return msg

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@dataclass
class Trial:
    latency_ms: float
    ops_per_node: float
    bytes_per_node: float
    extra: dict[str, Any] = field(default_factory=dict)


def _participants(backend: Any) -> int:
    from rallypoint.core import decode_state

    current = backend.get_state()
    return 0 if current is None else len(decode_state(current[0]).participants)


def run_trial(
    procs: list[_Proc], impl: str, endpoint: str, run_id: str, observer: Any = None
) -> Trial:
    n = len(procs)
    for p in procs:
        p.send(op="create", impl=impl, endpoint=endpoint, run_id=run_id, n=n)
    for p in procs:
        p.expect("done")
    early, last = procs[:-1], procs[-1]
    for p in early:
        p.send(op="join")
    for p in early:
        p.expect("calling")
    # Let the first n-1 register: rallypoint's state can be read here, so wait
    # until they are all participants; torch's is pickled (not read here), so give
    # it a fixed settle time (its 0-0.3 s random delay, then its CAS).
    if observer is not None:
        deadline = time.monotonic() + 120
        while _participants(observer) < n - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{impl}: {n - 1} nodes did not join within 120 s")
            time.sleep(0.05)
    time.sleep(SETTLE_S)
    last.send(op="join")
    results = [p.expect("done") for p in procs]
    latency = max(r["returned"] for r in results) - results[-1]["called"]
    if sorted(r["rank"] for r in results) != list(range(n)):
        raise RuntimeError(f"{impl}: ranks {sorted(r['rank'] for r in results)} for n={n}")
    extra: dict[str, Any] = {}
    if impl.startswith("rallypoint"):
        last.send(op="heartbeat")
        extra = last.expect("done")
    for p in procs:
        p.send(op="leave")
    for p in procs:
        p.expect("done")
    return Trial(
        latency_ms=latency * 1000,
        ops_per_node=statistics.mean(r["ops"] for r in results),
        bytes_per_node=statistics.mean(r["bytes"] for r in results),
        extra=extra,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--no-etcd", action="store_true", help="skip the etcd runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main()
        return 0

    import pyetcd
    from torch.distributed import TCPStore

    from rallypoint.adapters.c10d import C10dBackend
    from rallypoint.adapters.etcd import EtcdBackend

    procs = [_Proc() for _ in range(max(args.sizes))]
    etcd = None
    try:
        for p in procs:
            p.expect("ready")
        if not args.no_etcd:
            from rallypoint.adapters.etcd import EtcdServer

            etcd = EtcdServer().start()
        print(f"# {os.cpu_count()} CPUs, loopback; latency = last node's call -> all returned")
        print(f"{'n':>3} {'backend':<6} {'rallypoint ms':>14} {'torch ms':>10} {'ratio':>8}")
        rows: list[tuple[int, str, Trial, Trial | None]] = []
        for n in args.sizes:
            group = procs[:n]
            trials: dict[str, Trial] = {}
            for impl in ("rallypoint-c10d", "torch-c10d"):
                server = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
                endpoint = f"127.0.0.1:{server.port}"
                run_id = f"bench-{impl}-{n}"
                observer = None
                if impl == "rallypoint-c10d":
                    client = TCPStore("127.0.0.1", server.port, is_master=False)
                    observer = C10dBackend(client, run_id, endpoint=endpoint)
                trials[impl] = run_trial(group, impl, endpoint, run_id, observer)
                if impl == "torch-c10d":
                    # The stored state's size: what each torch keep-alive rewrites.
                    key = f"torch.rendezvous.bench-{impl}-{n}"
                    trials[impl].extra["state_bytes"] = len(server.get(key))
                del server
            rp, tc = trials["rallypoint-c10d"], trials["torch-c10d"]
            print(
                f"{n:>3} {'c10d':<6} {rp.latency_ms:>14.1f} {tc.latency_ms:>10.1f} "
                f"{tc.latency_ms / rp.latency_ms:>7.0f}x",
                flush=True,
            )
            rows.append((n, "c10d", rp, tc))
            if etcd is not None:
                run_id = f"bench-etcd-{n}"
                client = pyetcd.client("127.0.0.1", etcd.client_port)
                observer = EtcdBackend(client, run_id, endpoint=etcd.endpoint)
                et = run_trial(group, "rallypoint-etcd", etcd.endpoint, run_id, observer)
                client.close()
                print(
                    f"{n:>3} {'etcd':<6} {et.latency_ms:>14.1f} {'n/a':>10} {'n/a':>8}",
                    flush=True,
                )
                rows.append((n, "etcd", et, None))
        if etcd is not None:
            print("# torch etcd: n/a (torch's etcd backends need the etcd v2 API and python-etcd)")
        print()
        print(
            f"{'n':>3} {'backend':<6} {'ops/node rp':>12} {'ops/node torch':>15} "
            f"{'bytes/node rp':>14} {'bytes/node torch':>17}"
        )
        for n, kind, rp, tc in rows:
            print(
                f"{n:>3} {kind:<6} {rp.ops_per_node:>12.1f} "
                f"{(f'{tc.ops_per_node:.1f}' if tc else 'n/a'):>15} {rp.bytes_per_node:>14.0f} "
                f"{(f'{tc.bytes_per_node:.0f}' if tc else 'n/a'):>17}"
            )
        n, _, rp, tc = max((r for r in rows if r[1] == "c10d"), key=lambda r: r[0])
        assert tc is not None
        torch_beat = 2 * tc.extra["state_bytes"]  # a CAS sends the old and the new state
        print()
        print(
            f"heartbeat bytes written per node per beat at n={n}: rallypoint "
            f"{rp.extra['hb_bytes']} (state blob {rp.extra['blob_bytes']} B, not rewritten), "
            f"torch ~{torch_beat} (CAS of the {tc.extra['state_bytes']} B state); "
            f"ratio {torch_beat / rp.extra['hb_bytes']:.0f}x"
        )
    finally:
        for p in procs:
            p.stop()
        if etcd is not None:
            etcd.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
