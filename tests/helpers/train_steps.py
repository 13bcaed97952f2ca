"""A training loop whose step counter the chaos tests check: ``train_steps.py OUT STEPS STEP_TIME``.

Every worker appends a ``start`` record to ``OUT/records.jsonl`` the moment it runs
(before torch loads: "the survivors run a new round"), and a ``resumed`` record
once its first step in the round is done. Each step all-reduces the step number
over gloo, and every rank checks that all ranks are at the same step (a mismatch
exits 5); each step then sleeps STEP_TIME, until ``OUT/sprint`` exists (the
test's faults are over: the remaining steps run at full speed). Rank 0
checkpoints the step counter to ``OUT/ckpt.json`` every ``CHECKPOINT_EVERY``
steps (atomically, with the round and a history of every write), and a restarted
round resumes from it. When all steps are done rank 0
writes ``OUT/done.json``. A lost peer makes the collective fail (or the agent
stops the worker first); the agent then starts a new round, which resumes.
"""

from __future__ import annotations

import json
import os
import sys
import time

CHECKPOINT_EVERY = 5


def append(out: str, rec: dict[str, object]) -> None:
    with open(os.path.join(out, "records.jsonl"), "a") as fp:
        fp.write(json.dumps(rec) + "\n")


def write_atomic(path: str, data: dict[str, object]) -> None:
    with open(path + f".{os.getpid()}.tmp", "w") as fp:
        json.dump(data, fp)
    os.replace(path + f".{os.getpid()}.tmp", path)


def main() -> None:
    out, steps, step_time = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    base = {
        "rank": int(os.environ["RANK"]),
        "world": int(os.environ["WORLD_SIZE"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "group_world": int(os.environ["GROUP_WORLD_SIZE"]),
        "round": int(os.environ["RALLYPOINT_ROUND"]),
        "restarts": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "pid": os.getpid(),
        "agent_pid": os.getppid(),
    }
    append(out, {**base, "event": "start", "time": time.time()})

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_path = os.path.join(out, "ckpt.json")
    sprint = os.path.join(out, "sprint")
    ckpt: dict[str, object] = {"step": 0, "round": -1, "history": []}
    if os.path.exists(ckpt_path):
        with open(ckpt_path) as fp:
            ckpt = json.load(fp)
    start = int(str(ckpt["step"]))
    history = list(ckpt["history"])  # type: ignore[call-overload]
    for step in range(start, steps):
        value = torch.tensor([float(step)], dtype=torch.float64)
        dist.all_reduce(value)
        if value.item() != step * world:
            print(f"rank {rank}: step counters disagree at step {step}", file=sys.stderr)
            sys.exit(5)
        if step == start:
            append(out, {**base, "event": "resumed", "step": step, "time": time.time()})
        if step_time and os.path.exists(sprint):
            step_time = 0.0
        time.sleep(step_time)
        done = step + 1
        if rank == 0 and (done % CHECKPOINT_EVERY == 0 or done == steps):
            history.append([base["round"], done])
            write_atomic(ckpt_path, {"step": done, "round": base["round"], "history": history})
    dist.barrier()
    if rank == 0:
        write_atomic(os.path.join(out, "done.json"), {"step": steps, "round": base["round"]})
    append(out, {**base, "event": "finished", "time": time.time()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
