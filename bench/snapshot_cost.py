"""What sharded live regroup's snapshots cost when nothing fails.

Two ranks over gloo on 127.0.0.1, each its own node (so each keeps its buddy's
copy), train an FSDP2 model (``fully_shard`` on a CPU mesh, Adam) through
``live.Job(build=...)`` with plain ``RANK``/``WORLD_SIZE`` variables (the live
API's single round). Each repeat runs the same steps with snapshots off and with
``snapshot_every=K``, interleaved, and compares the loop's time per step; it also
prints the host memory the snapshots hold (``job.snapshots.bytes_kept``) against
the rank's own state. Usage::

    python bench/snapshot_cost.py [--steps 200] [--every 50] [--width 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def worker(steps: int, every: int, width: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rallypoint.agent import live

    torch.set_num_threads(1)

    def build() -> dict[str, live.Sharded]:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return {"train": live.Sharded(model, torch.optim.Adam(model.parameters(), lr=1e-4))}

    job = live.Job(build=build, backend="gloo", snapshot_every=every)
    for rnd in job.rounds():
        train = job.state["train"]
        assert isinstance(train, live.Sharded)
        x = torch.randn(64, width)
        with rnd:
            started = 0.0
            for step in rnd.steps(steps):
                if step == 5:  # warmed up
                    started = time.perf_counter()
                train.model(x).pow(2).mean().backward()
                train.optimizer.step()
                train.optimizer.zero_grad()
            took = time.perf_counter() - started
    job.snapshots.wait()
    own = sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else 0
        for t in train.model.state_dict().values()
    )
    if dist.get_rank() == 0:
        line = {"s_per_step": took / (steps - 5), "kept": job.snapshots.bytes_kept, "params": own}
        print(json.dumps(line), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(steps: int, every: int, width: int) -> dict[str, float]:
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
        )  # fmt: skip
        command = [sys.executable, __file__, "--worker", "--steps", str(steps)]
        command += ["--every", str(every), "--width", str(width)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
    try:
        out = procs[0].communicate(timeout=1800)[0]
        procs[1].wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError("a rank failed")
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50, help="steps between snapshots")
    parser.add_argument("--width", type=int, default=1024, help="the model's layer width")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps <= 5 or args.every < 1:
        parser.error("--steps must be above 5 and --every at least 1")
    if args.worker:
        worker(args.steps, args.every, args.width)
        return 0
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        runs["off"].append(run(args.steps, 0, args.width))  # interleaved: load hits both
        runs["on"].append(run(args.steps, args.every, args.width))
    per_step = {mode: statistics.median(r["s_per_step"] for r in rs) for mode, rs in runs.items()}
    state_mb = runs["on"][0]["params"] * 3 / 1e6  # parameters and Adam's two moments
    for mode, rs in runs.items():
        spread = ", ".join(f"{r['s_per_step'] * 1e3:.2f}" for r in rs)
        print(
            f"FSDP2, 2 gloo ranks, {args.width}-wide x 4 layers (~{state_mb:.0f} MB of state "
            f"per rank), snapshots {mode}: {per_step[mode] * 1e3:.2f} ms/step [runs: {spread}]"
        )
    kept = runs["on"][0]["kept"] / 1e6
    print(
        f"snapshot every {args.every} steps: {per_step['on'] / per_step['off'] - 1:+.1%} per step; "
        f"host memory held {kept:.0f} MB per rank ({kept / state_mb:.1f}x its state)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
