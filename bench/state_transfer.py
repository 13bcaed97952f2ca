"""How fast a live regroup moves the registered state from one rank to another.

Two ranks over gloo on 127.0.0.1 (two processes, as two workers of a round). For
each state size, interleaved in every repeat:

* ``memory copy``: the sender copies the state's tensors in its own memory (the
  limit: no transfer can beat it);
* ``tensors``: :func:`rallypoint.agent.worker.live_state.exchange_state` (a JSON layout,
  then the tensors' bytes, point to point; what live regroup uses);
* ``torch.save``: the path before it: ``torch.save`` into memory, the bytes
  broadcast, ``torch.load(weights_only=True)`` on the receiver.

The state looks like a model's: tensors of 4 MiB and a tail of small ones (an
optimizer's scalars). Each figure is the receiver's time from a barrier to having
the state (the memory copy: the sender's time to copy it), as MB/s, with the
ratios measured in the same run. Usage::

    python bench/state_transfer.py [--sizes 10,100,1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

WAYS = ("memory copy", "tensors", "torch.save")
_CHUNK = 1 << 20  # float32 elements: 4 MiB tensors


def make_state(megabytes: int) -> dict[str, torch.Tensor]:
    elements = megabytes * 10**6 // 4
    state = {}
    for i in range(elements // _CHUNK):
        state[f"layer{i}.weight"] = torch.randn(_CHUNK)
    rest = elements - len(state) * _CHUNK
    state["tail"] = torch.randn(rest)
    for i in range(200):  # an optimizer's per-parameter scalars
        state[f"step{i}"] = torch.tensor(float(i))
    return state


def _via_torch_save(state: dict[str, torch.Tensor] | None, rank: int) -> object:
    size = torch.zeros(1, dtype=torch.int64)
    payload = b""
    if rank == 0:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        size[0] = len(payload)
    dist.broadcast(size, src=0)
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if rank == 0
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    dist.broadcast(data, src=0)
    if rank == 0:
        return state
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def worker(rank: int, port: int, sizes: list[int], repeats: int) -> None:
    from rallypoint.agent.worker.live_state import exchange_state

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    for megabytes in sizes:
        state = make_state(megabytes) if rank == 0 else None
        for repeat in range(repeats):
            for way in WAYS:
                dist.barrier()
                started = time.perf_counter()
                if way == "memory copy":
                    if rank == 0:
                        assert state is not None
                        copied = {k: v.clone() for k, v in state.items()}
                        del copied
                    took = time.perf_counter() - started
                    took_t = torch.tensor([took])
                    dist.broadcast(took_t, src=0)  # the sender's figure
                    took = float(took_t.item())
                elif way == "tensors":
                    got, _ = exchange_state(
                        state,
                        send_to=[1] if rank == 0 else [],
                        receive_from=0 if rank == 1 else None,
                        group=dist.group.WORLD,
                    )
                    took = time.perf_counter() - started
                    del got
                else:
                    got = _via_torch_save(state, rank)
                    took = time.perf_counter() - started
                    del got
                if rank == 1:
                    line = {"mb": megabytes, "repeat": repeat, "way": way, "s": took}
                    print(json.dumps(line), flush=True)
        del state
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000", help="MB of state, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes takes megabytes such as 10,100: {args.sizes!r}")
    if args.rank is not None:
        worker(args.rank, args.port, sizes, args.repeats)
        return 0
    port = _free_port()
    command = [sys.executable, __file__, "--sizes", args.sizes, "--repeats", str(args.repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([*command, "--rank", str(r), "--port", str(port)], env=env,
                         stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]  # fmt: skip
    try:
        out = procs[1].communicate(timeout=3600)[0]
        procs[0].wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if any(p.returncode for p in procs):
        print("a rank failed", file=sys.stderr)
        return 1
    runs: dict[tuple[int, str], list[float]] = {}
    for line in out.splitlines():
        doc = json.loads(line)
        runs.setdefault((doc["mb"], doc["way"]), []).append(doc["s"])
    for megabytes in sizes:
        median = {way: statistics.median(runs[(megabytes, way)]) for way in WAYS}
        rates = {way: megabytes / s for way, s in median.items()}
        for way in WAYS:
            spread = ", ".join(f"{s:.3f}" for s in runs[(megabytes, way)])
            print(
                f"state transfer, {megabytes} MB, 2 gloo ranks on loopback, {way}: "
                f"{rates[way]:.0f} MB/s [runs, s: {spread}]"
            )
        versus_save = rates["tensors"] / rates["torch.save"]
        versus_copy = rates["tensors"] / rates["memory copy"]
        print(
            f"state transfer, {megabytes} MB: tensors {versus_save:.2f}x torch.save's rate, "
            f"{versus_copy:.2f}x a memory copy's"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
