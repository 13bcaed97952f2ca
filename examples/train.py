"""A small elastic DDP training job: checkpoints every few steps, resumes after a restart.

Run it with the launcher (the README's main job)::

    rallypoint run --standalone --nproc-per-node 2 examples/train.py

On a machine with GPUs each worker takes its local rank's device and uses NCCL
(``--nproc-per-node gpu``); otherwise the workers use gloo on the CPU. Nothing else
changes.

The model fits a noisy linear target. Every step draws its batch from a generator
seeded by (step, rank), so a resumed run sees the same data it would have seen.
Rank 0 writes the checkpoint (JSON, no pickle) atomically every
``--checkpoint-every`` steps; after a restart -- a crashed worker, a node that
joined or left -- every worker loads it and continues from that step, whatever the
new world size is. ``--crash-at-step`` makes rank 0 of the first attempt fail once,
to watch the restart happen (use it with ``--max-restarts 1``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rallypoint.agent import record
from rallypoint.agent.worker import live

IN_FEATURES = 16


class CheckpointDirError(RuntimeError):
    """The default checkpoint directory is not safe to use."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="total training steps")
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="shared directory for the checkpoint (default: a private temp dir named after "
        "the user and the run id)",
    )
    p.add_argument("--crash-at-step", type=int, default=-1, help="fail once at this step")
    return p.parse_args()


def checkpoint_path(args: argparse.Namespace) -> str:
    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, mode=0o700, exist_ok=True)
        return os.path.join(args.checkpoint_dir, "checkpoint.json")
    # Restarted workers must find the checkpoint again, so the default name cannot be
    # random as mkdtemp's are; it is made safe instead: created 0700 by this user, and
    # refused if someone else made it first (a symlink, a directory they can write).
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    safe_run_id = "".join(c if c.isalnum() or c in "._-" else "_" for c in run_id)[:64]
    directory = os.path.join(tempfile.gettempdir(), f"rallypoint-train-{os.getuid()}-{safe_run_id}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    info = os.lstat(directory)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or stat.S_IMODE(info.st_mode) & 0o077
    ):
        raise CheckpointDirError(
            f"{directory} exists but is not a private directory of this user (a symlink, "
            "someone else's, or open to others): remove it or pass --checkpoint-dir"
        )
    return os.path.join(directory, "checkpoint.json")


def save_checkpoint(path: str, model: nn.Module, step: int) -> None:
    state = {
        "step": step,
        "params": {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()},
    }
    # A fresh temp file, then an atomic rename: a reader never sees half a checkpoint,
    # and no fixed temp name exists for anyone to plant a symlink at.
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fp:
            json.dump(state, fp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def load_checkpoint(path: str, model: nn.Module, device: torch.device) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as fp:
        state = json.load(fp)
    model.load_state_dict({k: torch.tensor(v, device=device) for k, v in state["params"].items()})
    return int(state["step"])


def batch(step: int, rank: int, size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(step * 100_003 + rank)
    x = torch.randn(size, IN_FEATURES, generator=gen)
    true_w = torch.linspace(-1.0, 1.0, IN_FEATURES)
    y = x @ true_w + 0.5 + 0.01 * torch.randn(size, generator=gen)
    return x.to(device), y.unsqueeze(1).to(device)


@record
def main() -> None:
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    torch.manual_seed(0)
    model = nn.Linear(IN_FEATURES, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    # What survives a live regroup (rallypoint run --live): a newcomer gets it from a
    # peer. The checkpoint is read only when the whole job starts (restore); without
    # --live, rounds() yields one round, as a plain script would run.
    path = checkpoint_path(args)
    job = live.Job(
        model=model,
        optimizer=optimizer,
        backend=backend,
        restore=lambda: load_checkpoint(path, model, device),
        # Data parallel, each rank's batch drawn from (step, rank): the job may train
        # on without a lost worker while its replacement starts (within --nnodes).
        may_shrink=True,
    )
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    loss = torch.zeros((), device=device)
    began = time.monotonic()
    for rnd in job.rounds():
        with rnd:  # a peer lost mid-step ends the round; the next one starts from job.step
            ddp = DistributedDataParallel(
                model, device_ids=[device.index] if device.index is not None else None
            )
            if rnd.rank == 0:
                print(
                    f"round {rnd.number}: {rnd.world_size} workers ({backend}), "
                    f"starting at step {job.step}",
                    flush=True,
                )
            for step in rnd.steps(args.steps):
                if rnd.rank == 0 and first_attempt and step == args.crash_at_step:
                    raise RuntimeError(f"simulated crash at step {step}")
                x, y = batch(step, rnd.rank, args.batch_size, device)
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                optimizer.step()
                if rnd.rank == 0 and (step + 1) % args.checkpoint_every == 0:
                    with job.pause():
                        save_checkpoint(path, model, step + 1)
    world_size = dist.get_world_size()
    final = loss.detach().clone()
    dist.all_reduce(final)
    if dist.get_rank() == 0:
        print(
            f"final loss: {final.item() / world_size:.6f} after {args.steps} steps "
            f"({time.monotonic() - began:.2f} s on {world_size} workers)",
            flush=True,
        )
    # Leave together: a rank that tears gloo down while a peer still talks to it
    # can abort in the transport's destructor.
    dist.barrier()
    dist.destroy_process_group()
    # The job is done and its output flushed: leave without the interpreter's
    # teardown, where gloo's threads sometimes abort the process (SIGABRT), which
    # would turn a finished job into a failed one (torchrun's plain scripts share it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
