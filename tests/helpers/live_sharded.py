"""A sharded live-regroup training loop the tests check: ``live_sharded.py OUT STEPS STEP_TIME``.

A small MLP wrapped with FSDP2 (``fully_shard``) on a CPU device mesh, and Adam,
registered through ``live.Job(build=...)``. ``LIVE_SHARDED_MESH=hsdp`` (the
default) shards within a node and replicates across nodes (a replicate x shard
mesh of ``WORLD_SIZE / LOCAL_WORLD_SIZE`` x ``LOCAL_WORLD_SIZE``); ``fsdp`` shards
over the whole world. ``LIVE_SHARDED_BACKEND=nccl`` trains on the local rank's
CUDA device (the mesh and the model on it). ``LIVE_SHARDED_SNAPSHOT_EVERY=K`` keeps
a snapshot of each shard every K steps (``live.Job(snapshot_every=K)``). Every
rank trains on the same batch at step k (drawn from a generator seeded with k), so
a rank's result depends on the mesh and the step only: two runs of the same world
commit the same bits at every step.

Appends to ``OUT/records.jsonl``: ``start`` when the process runs, ``restore`` when
the job asks it to load its checkpoint (a whole-job start: there is none), ``round``
when a round is ready, and ``step`` for each committed step with ``digest``, a
SHA-256 of this rank's shards of the parameters and of the optimizer state, and
``shard`` (which part of the state this rank holds: ranks of one shard hold the
same bits). With ``LIVE_SHARDED_WHOLE=1`` each ``step`` and ``round`` record also
has ``whole``, a SHA-256 of the whole parameters and optimizer state (gathered
from every shard): the same in any mesh that holds the same values.
``done`` when it finished. Each step sleeps STEP_TIME until ``OUT/sprint`` exists;
with ``LIVE_SHARDED_PACED_FROM=K``, steps numbered below K do not (no fault strikes
before step K: the job needs no runway there).
Once ``OUT/sigkill-rank-R`` exists, the worker of rank R SIGKILLs itself after its
next step's work, before that step commits (and removes the file first).
Without a live agent (plain ``RANK``/``WORLD_SIZE``/``MASTER_*`` variables) it runs
one round: the undisturbed run the tests compare with.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from typing import Any


def _told_to_die(out: str, rank: int) -> bool:
    """Whether the test asked the worker of ``rank`` to SIGKILL itself here, once (it
    removes ``OUT/sigkill-rank-RANK``; its replacement finds none): between a step's
    work and its commit, so that the kill never lands inside a collective."""
    try:
        os.unlink(os.path.join(out, f"sigkill-rank-{rank}"))
    except FileNotFoundError:
        return False
    return True


def main() -> None:
    out, steps, step_time = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    records = open(os.path.join(out, "records.jsonl"), "a", buffering=1)  # noqa: SIM115
    pid = os.getpid()

    def record(event: str, **fields: object) -> None:
        records.write(
            json.dumps({"event": event, "pid": pid, "time": time.time(), **fields}) + "\n"
        )

    record("start", local_rank=int(os.environ["LOCAL_RANK"]))

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from rallypoint.agent.worker import live
    from rallypoint.agent.worker.live_state import shard_of

    torch.set_num_threads(1)
    mode = os.environ.get("LIVE_SHARDED_MESH", "hsdp")
    backend = os.environ.get("LIVE_SHARDED_BACKEND", "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)

    def build() -> dict[str, live.Sharded]:
        world = dist.get_world_size()
        if mode == "hsdp":
            local = int(os.environ["LOCAL_WORLD_SIZE"])
            shape, names = (world // local, local), ("dp", "shard")
        else:
            shape, names = (world,), ("shard",)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        torch.manual_seed(0)  # the same start on every rank and in every round
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 5)).to(device)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        return {"train": live.Sharded(model, optimizer)}

    def restore() -> int:
        record("restore", round=int(os.environ.get("RALLYPOINT_ROUND", "0")))
        return 0

    job = live.Job(
        build=build,
        backend=backend,
        # (a round's group may take a minute to form when four workers start at
        # once on a loaded host)
        timeout=120,
        restore=restore,
        may_shrink=True,
        snapshot_every=int(os.environ.get("LIVE_SHARDED_SNAPSHOT_EVERY", "0")),
    )

    def held(train: live.Sharded) -> tuple[list[Any], list[bytes]]:
        """The parameters and the optimizer state, in order, and this rank's bytes of
        each (its shard of a DTensor)."""
        assert all(isinstance(param, DTensor) for param in train.model.parameters())
        tensors = [*train.model.parameters()]
        tensors += [v for state in train.optimizer.state.values() for v in state.values()]
        mine = [
            (v.to_local() if isinstance(v, DTensor) else v).detach().cpu().numpy().tobytes()
            for v in tensors
        ]
        return tensors, mine

    def whole_digest(tensors: list[Any], mine: list[bytes]) -> str | None:
        if os.environ.get("LIVE_SHARDED_WHOLE") != "1":
            return None
        # One gather of every rank's pieces, not a full_tensor() (a collective) per
        # tensor: a whole tensor's bytes are its row shards' bytes in the order of
        # the mesh's shard dimension (in the first replica). The same digest as
        # full_tensor()'s, checked on this torch (FSDP over 4 and 2, HSDP 2 x 2, 20
        # steps each); a 4-rank run of 100 steps took 26.9 s CPU, not 34.0 s
        every: list[list[bytes]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, mine)
        digest = hashlib.sha256()
        for i, value in enumerate(tensors):
            if not isinstance(value, DTensor):
                digest.update(mine[i])
                continue
            index = tuple(0 if p.is_replicate() else slice(None) for p in value.placements)
            assert all(p.is_replicate() or p.is_shard(0) for p in value.placements)
            assert sum(p.is_shard(0) for p in value.placements) == 1, value.placements
            for rank in value.device_mesh.mesh[index].flatten().tolist():
                digest.update(every[rank][i])
        return digest.hexdigest()

    sprint = os.path.join(out, "sprint")
    paced_from = int(os.environ.get("LIVE_SHARDED_PACED_FROM", "0"))
    for rnd in job.rounds():
        train = job.state["train"]
        assert isinstance(train, live.Sharded)
        model, optimizer = train.model, train.optimizer
        shard = shard_of(train.state_dict()).index
        record(
            "round", round=rnd.number, rank=rnd.rank, world=rnd.world_size, step=job.step,
            shard=shard, whole=whole_digest(*held(train)),
        )  # fmt: skip
        with rnd:
            for step in rnd.steps(steps):
                batch = torch.Generator().manual_seed(step)
                x = torch.randn(16, 8, generator=batch).to(device)
                y = torch.randn(16, 5, generator=batch).to(device)
                loss = (model(x) - y).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                tensors, mine = held(train)
                digest = hashlib.sha256()
                for piece in mine:
                    digest.update(piece)
                if _told_to_die(out, rnd.rank):
                    os.kill(pid, signal.SIGKILL)
                if step_time and step + 1 >= paced_from and not os.path.exists(sprint):
                    time.sleep(step_time)
                record(
                    "step", round=rnd.number, rank=rnd.rank, world=rnd.world_size,
                    step=step + 1, shard=shard, digest=digest.hexdigest(),
                    whole=whole_digest(tensors, mine),
                )  # fmt: skip
    record("done", step=job.step)
    dist.barrier()
    dist.destroy_process_group()
    records.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's teardown at interpreter exit can abort the process


if __name__ == "__main__":
    main()
