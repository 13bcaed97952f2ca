"""A live-regroup training loop the tests check: ``live_steps.py OUT STEPS STEP_TIME [HANG_AT]``.

The registered state is one parameter. Step k (counting from 0) all-reduces k + 1
and adds the mean to the parameter, so after k committed steps the parameter holds
k(k+1)/2 on every rank: a rank whose state is wrong, or a step lost or applied
twice, shows in the value. Nothing is ever written to disk for the state: a
newcomer can only have it from a peer.

Each worker prints ``round R rank K pid P`` when a round is ready, and appends to
``OUT/records.jsonl``: ``start`` when it runs (before torch
loads), ``restore`` when the job asks it to load its checkpoint (a whole-job start;
there is none, so it restores nothing), ``round`` when a round is ready (its step
and parameter then), ``step`` for each committed step, ``done`` when it finished.
Each step sleeps STEP_TIME until ``OUT/sprint`` exists. With HANG_AT, the first
worker of local rank 0 stops taking part at that step: it sleeps without calling
into the API (a worker that ignores the new round). ``LIVE_STEPS_BACKEND=nccl``
trains on the local rank's CUDA device. ``LIVE_STEPS_MAY_SHRINK=1`` declares that the
job may train on without a lost worker (``live.Job(may_shrink=True)``). A worker
that starts while ``OUT/slow_start`` exists sleeps the seconds it holds before
``job.rounds()`` (a slow start-up: a big model built, a CUDA context), or until the
file is removed, then records ``ready``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    out, steps, step_time = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    hang_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    records = open(os.path.join(out, "records.jsonl"), "a", buffering=1)  # noqa: SIM115
    pid = os.getpid()

    def record(event: str, **fields: object) -> None:
        records.write(
            json.dumps({"event": event, "pid": pid, "time": time.time(), **fields}) + "\n"
        )

    first_life = (
        os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RALLYPOINT_ROUND"] == "0"
    )
    record(
        "start", local_rank=int(os.environ["LOCAL_RANK"]), round=int(os.environ["RALLYPOINT_ROUND"])
    )

    import torch
    import torch.distributed as dist
    from torch import nn

    from rallypoint.agent.worker import live

    backend = os.environ.get("LIVE_STEPS_BACKEND", "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    param = nn.Parameter(torch.zeros(1, dtype=torch.float64, device=device))
    holder = nn.Module()
    holder.register_parameter("value", param)

    def restore() -> int:
        record("restore", round=int(os.environ["RALLYPOINT_ROUND"]))
        return 0

    may_shrink = os.environ.get("LIVE_STEPS_MAY_SHRINK") == "1"
    job = live.Job(
        model=holder, backend=backend, timeout=60, restore=restore, may_shrink=may_shrink
    )
    slow_start = os.path.join(out, "slow_start")
    if os.path.exists(slow_start):
        with open(slow_start) as f:
            until = time.monotonic() + float(f.read())
        while time.monotonic() < until and os.path.exists(slow_start):
            time.sleep(0.05)
        record("ready")
    sprint = os.path.join(out, "sprint")
    for rnd in job.rounds():
        record(
            "round",
            round=rnd.number,
            rank=rnd.rank,
            world=rnd.world_size,
            step=job.step,
            value=param.item(),
            local_rank=rnd.local_rank,
        )
        print(f"round {rnd.number} rank {rnd.rank} pid {pid}", flush=True)
        with rnd:
            for step in rnd.steps(steps):
                if first_life and step == hang_at and rnd.local_rank == 0:
                    time.sleep(3600)
                total = torch.tensor([float(step + 1)], dtype=torch.float64, device=device)
                dist.all_reduce(total)
                with torch.no_grad():
                    param += total / rnd.world_size
                if step_time and not os.path.exists(sprint):
                    time.sleep(step_time)
                record(
                    "step",
                    round=rnd.number,
                    rank=rnd.rank,
                    world=rnd.world_size,
                    step=step + 1,
                    value=param.item(),
                )
    record("done", step=job.step, value=param.item())
    dist.barrier()
    dist.destroy_process_group()
    # gloo's teardown at interpreter exit sometimes aborts the process (SIGABRT, under
    # torchrun too): these tests check regroups, not that race, so leave without it.
    records.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
