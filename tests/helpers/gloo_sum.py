"""A worker that leaves its gloo group undestroyed: ``sum_ranks()`` joins a gloo
group, all-reduces its rank + 1 and returns the sum; run as a script it prints
``sum <total>``. gloo's teardown at interpreter exit can then abort the process
(what the worker-exit tests and bench/worker_exit.py look for). Import it as
``gloo_sum`` with this folder on the path: function workers import it by name."""

import os
import sys

import torch
import torch.distributed as dist


def sum_ranks() -> int:
    dist.init_process_group("gloo")
    total = torch.tensor([int(os.environ["RANK"]) + 1])
    dist.all_reduce(total)
    return int(total.item())


if __name__ == "__main__":
    # One write: the two workers share the console, and an unbuffered print writes
    # its pieces one by one, so two prints could interleave mid-line.
    sys.stdout.write(f"sum {sum_ranks()}\n")
