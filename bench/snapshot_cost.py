"""What sharded live regroup's snapshots cost when nothing fails, and what they save.

Two ranks over gloo on 127.0.0.1, each its own node (so each keeps its buddy's
copy), train an FSDP2 model (``fully_shard`` on a CPU mesh, Adam) through
``live.Job(build=...)`` with plain ``RANK``/``WORLD_SIZE`` variables (the live
API's single round). Each repeat runs the same steps with snapshots off and with
``snapshot_every=K``, interleaved, and compares the loop's time per step; as that
moves with the machine's load between runs by more than a snapshot costs, it also
prints the time the steps around each snapshot take beyond the run's median step,
spread over every step (the snapshot's own cost, measured within one run). And the
host memory the snapshots hold (``job.snapshots.bytes_kept``) against the rank's
own state.

Then, in the run with snapshots, the state's way back after rank 1 loses its shard:
from its buddy's copy (rank 0 sends it over the side group, rank 1 builds and loads
it: what a live regroup does) against a DCP checkpoint of the same state written
and read back (``torch.distributed.checkpoint`` save and load on local disk, what a
restart needs besides its start-up), timed on rank 1; and the state resharded into
another mesh (2 replicas of 1 shard: each rank needs the whole) in memory against
DCP's load of that checkpoint into that mesh. Usage::

    python bench/snapshot_cost.py [--steps 200] [--every 50] [--width 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def worker(steps: int, every: int, width: int) -> None:
    import torch
    import torch.distributed as dist

    from rallypoint.agent.worker import live

    torch.set_num_threads(1)

    def build() -> dict[str, live.Sharded]:
        return {"train": _sharded(width, (dist.get_world_size(),))}

    job = live.Job(build=build, backend="gloo", snapshot_every=every)
    for rnd in job.rounds():
        train = job.state["train"]
        assert isinstance(train, live.Sharded)
        x = torch.randn(64, width)
        with rnd:
            marks = []  # when each step's body began (a step's time includes its commit)
            for _ in rnd.steps(steps):
                marks.append(time.perf_counter())
                train.model(x).pow(2).mean().backward()
                train.optimizer.step()
                train.optimizer.zero_grad()
            marks.append(time.perf_counter())
    durations = [b - a for a, b in itertools.pairwise(marks)]
    took = marks[-1] - marks[5]  # warmed up after 5 steps
    job.snapshots.wait()
    recovery = _recovery_figures(job, train, width) if every else {}
    own = sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else 0
        for t in train.model.state_dict().values()
    )
    if dist.get_rank() == 0:
        line = {"s_per_step": took / (steps - 5), "kept": job.snapshots.bytes_kept, "params": own}
        line["excess"] = _snapshot_excess(durations[5:], every, 5) if every else 0.0
        print(json.dumps({**line, **recovery}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


#: How many times the state is resharded into the new mesh, and loaded there by
#: DCP, interleaved (after one of each that warms up): the medians are printed.
_RESHARDS = 3
#: Steps after a snapshot's that its background work may slow (and the next step's
#: optimizer wait for its copy).
_AFTER = 3


def _snapshot_excess(durations: list[float], every: int, first: int) -> float:
    """The time a snapshot adds, per step of the run, as a fraction of the median
    step: the steps around each snapshot (the one that took it and the
    :data:`_AFTER` after it) less as many median steps, summed over the snapshots
    and spread over every step. Unlike the runs' mean step time, drifts in the
    machine's load between runs do not enter it."""
    median = statistics.median(durations)
    excess = 0.0
    for index in range(len(durations)):
        if (first + index + 1) % every == 0:  # this step's commit took the snapshot
            window = durations[index : index + 1 + _AFTER]
            excess += sum(window) - len(window) * median
    return excess / len(durations) / median


def _sharded(width: int, mesh_shape: tuple[int, ...]) -> object:
    """The bench's model, FSDP2 on a CPU mesh of ``mesh_shape`` (2-D: replicas x
    shards), with Adam, as a :class:`live.Sharded`."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rallypoint.agent.worker import live

    names = ("shard",) if len(mesh_shape) == 1 else ("dp", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return live.Sharded(model, torch.optim.Adam(model.parameters(), lr=1e-4))


def _recovery_figures(job: object, train: object, width: int) -> dict[str, float]:
    """Seconds for rank 1's shard to come back from its buddy's snapshot, and for a
    DCP checkpoint of the state to be saved and loaded (both ranks, timed on 1);
    then for the state to be resharded into another mesh (2 replicas of 1 shard:
    each rank needs the whole state) in memory, and for DCP to load the checkpoint
    into that mesh."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rallypoint.agent.worker import live
    from rallypoint.agent.worker.live_reshard import reshard
    from rallypoint.agent.worker.live_state import (
        exchange_packed,
        local_shards,
        read_layout,
        unpack_state,
    )

    assert isinstance(job, live.Job) and isinstance(train, live.Sharded)
    me = dist.get_rank()
    like = job._tree()
    layout = job._shard.layout
    step = max(c.step for c in job.snapshots.copies(layout, me))
    dist.barrier()
    started = time.perf_counter()
    sends = {1: job.snapshots.get(layout, 1, step)} if me == 0 else {}
    received = exchange_packed(sends, [0] if me == 1 else [], group=dist.group.WORLD)
    if received:
        packed = received[0]
        job._load(unpack_state(read_layout(packed.layout), packed.transfers, like=like))
    from_buddy = time.perf_counter() - started
    folder = os.path.join(os.environ["SNAPSHOT_BENCH_DIR"], "dcp")  # one, as shared storage
    dist.barrier()
    started = time.perf_counter()
    dcp.save({"train": train}, checkpoint_id=folder)
    dist.barrier()
    saved = time.perf_counter() - started
    started = time.perf_counter()
    dcp.load({"train": train}, checkpoint_id=folder)
    loaded = time.perf_counter() - started
    dist.barrier()
    whole = _sharded(width, (2, 1))
    assert isinstance(whole, live.Sharded)
    held = local_shards(train.state_dict())
    taken: dict[str, list[float]] = {"resharded": [], "dcp_resharded": []}
    for attempt in range(1 + _RESHARDS):  # the first of each warms up (imports, caches)
        dist.barrier()
        started = time.perf_counter()
        tree, _, _ = reshard([held], whole.state_dict(), reference=0, group=dist.group.WORLD)
        whole.load_state_dict(tree)
        resharded = time.perf_counter() - started
        dist.barrier()
        started = time.perf_counter()
        dcp.load({"train": whole}, checkpoint_id=folder)
        dcp_resharded = time.perf_counter() - started
        if attempt:
            taken["resharded"].append(resharded)
            taken["dcp_resharded"].append(dcp_resharded)
    dist.barrier()
    resharded = statistics.median(taken["resharded"])
    dcp_resharded = statistics.median(taken["dcp_resharded"])
    return {
        "from_buddy": from_buddy,
        "dcp_save": saved,
        "dcp_load": loaded,
        "resharded": resharded,
        "dcp_resharded": dcp_resharded,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(steps: int, every: int, width: int, folder: str) -> dict[str, float]:
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
            SNAPSHOT_BENCH_DIR=folder,
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
    if args.worker:  # every 0: the run without snapshots
        worker(args.steps, args.every, args.width)
        return 0
    if args.steps <= 5 or args.every < 1:
        parser.error("--steps must be above 5 and --every at least 1")
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="rallypoint-snapshots-") as folder:
            # interleaved: load drifts hit both alike
            runs["off"].append(run(args.steps, 0, args.width, folder))
            runs["on"].append(run(args.steps, args.every, args.width, folder))
    per_step = {mode: statistics.median(r["s_per_step"] for r in rs) for mode, rs in runs.items()}
    state_mb = runs["on"][0]["params"] * 3 / 1e6  # parameters and Adam's two moments
    for mode, rs in runs.items():
        spread = ", ".join(f"{r['s_per_step'] * 1e3:.2f}" for r in rs)
        print(
            f"FSDP2, 2 gloo ranks, {args.width}-wide x 4 layers (~{state_mb:.0f} MB of state "
            f"per rank), snapshots {mode}: {per_step[mode] * 1e3:.2f} ms/step [runs: {spread}]"
        )
    kept = runs["on"][0]["kept"] / 1e6
    excess = [r["excess"] for r in runs["on"]]
    spread = ", ".join(f"{e:+.1%}" for e in excess)
    print(
        f"snapshot every {args.every} steps: {per_step['on'] / per_step['off'] - 1:+.1%} per step "
        f"(runs' means); {statistics.median(excess):+.1%} per step (the steps around each "
        f"snapshot against the run's median step) [runs: {spread}]; host memory held "
        f"{kept:.0f} MB per rank ({kept / state_mb:.1f}x its state)"
    )
    keys = ("from_buddy", "dcp_save", "dcp_load", "resharded", "dcp_resharded")
    figures = {k: statistics.median(r[k] for r in runs["on"]) for k in keys}
    disk = figures["dcp_save"] + figures["dcp_load"]
    print(
        f"a lost shard back: from its buddy's snapshot {figures['from_buddy'] * 1e3:.0f} ms; "
        f"a DCP checkpoint saved {figures['dcp_save'] * 1e3:.0f} ms + loaded "
        f"{figures['dcp_load'] * 1e3:.0f} ms (local disk); {disk / figures['from_buddy']:.1f}x"
    )
    disk = figures["dcp_save"] + figures["dcp_resharded"]
    print(
        f"a new mesh (2 shards -> each rank whole): resharded in memory "
        f"{figures['resharded'] * 1e3:.0f} ms; a DCP checkpoint saved "
        f"{figures['dcp_save'] * 1e3:.0f} ms + loaded into the new mesh "
        f"{figures['dcp_resharded'] * 1e3:.0f} ms; {disk / figures['resharded']:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
