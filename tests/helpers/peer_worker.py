"""A worker without torch for the agent reliability tests: ``peer_worker.py OUT MODE``.

Appends one JSON record per start to ``OUT/records.jsonl`` (its ranks, round, restart
count, pid and its agent's pid), then, by MODE:

* ``watch``: like a worker in a collective, exits 1 as soon as a worker of its round
  on another node is gone (a lost peer breaks the collective at once, long before
  the agent can see the peer's heartbeat stop); exits 0 once ``OUT/finish`` exists.
* ``fail-rank1``: rank 1 exits 3 once every worker of its round has started (a bug
  that repeats on every attempt); the others wait for ``OUT/finish``.
* ``spawn``: starts a child, which starts a grandchild, both in the worker's process
  group and both looping forever; writes their pids to ``OUT/spawned.<rank>``; waits
  for ``OUT/finish``.
* ``quick``: exits 0 after half a second.
* ``fail-by-round``: in round R, the worker of group rank R mod the group's size exits
  3 once every worker of its round has started (each node's workers fail in turn);
  the others wait for ``OUT/finish``.
* ``checkpoint``: on SIGTERM, "checkpoints" for a second (writes
  ``OUT/checkpoint.<pid>`` with the time the signal came and the time it finished),
  then exits 0; otherwise waits for ``OUT/finish``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

LOOP = "import time\nwhile True: time.sleep(0.1)\n"
SPAWN_CHILD = (
    "import subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', sys.argv[1]])\n"
    "print(g.pid, flush=True)\n"
    "while True: time.sleep(0.1)\n"
)


def record(out: str) -> dict[str, object]:
    env = {
        k: os.environ.get(k)
        for k in (
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "RALLYPOINT_ROUND", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        )
    }  # fmt: skip
    rec: dict[str, object] = {**env, "pid": os.getpid(), "agent_pid": os.getppid()}
    rec["time"] = time.time()
    with open(os.path.join(out, "records.jsonl"), "a") as fp:
        fp.write(json.dumps(rec) + "\n")
    return rec


def my_round(out: str, me: dict[str, object]) -> list[dict[str, object]]:
    with open(os.path.join(out, "records.jsonl")) as fp:
        recs = [json.loads(line) for line in fp if line.strip()]
    return [r for r in recs if r["RALLYPOINT_ROUND"] == me["RALLYPOINT_ROUND"]]


def wait_for_round(out: str, me: dict[str, object]) -> list[dict[str, object]]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        mine = my_round(out, me)
        if len(mine) >= int(str(me["WORLD_SIZE"])):
            return mine
        time.sleep(0.01)
    sys.exit(9)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (dead, not yet reaped by whoever adopted it,
    which can take a second) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as fp:
            state = fp.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    me = record(out)
    finish = os.path.join(out, "finish")
    if mode == "quick":
        time.sleep(0.5)
        return
    if mode == "fail-rank1" and me["RANK"] == "1":
        wait_for_round(out, me)
        print("rank 1: a bug that fails every attempt", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "fail-by-round":
        size = int(str(me["GROUP_WORLD_SIZE"]))
        if int(str(me["GROUP_RANK"])) == int(str(me["RALLYPOINT_ROUND"])) % size:
            wait_for_round(out, me)
            print(f"group rank {me['GROUP_RANK']}: failing in its turn", file=sys.stderr)
            sys.exit(3)
    if mode == "checkpoint":
        import signal

        def checkpoint(signum: int, frame: object) -> None:
            got = time.time()
            time.sleep(1.0)
            with open(os.path.join(out, f"checkpoint.{os.getpid()}"), "w") as fp:
                json.dump({"signal": got, "done": time.time()}, fp)
            sys.exit(0)

        signal.signal(signal.SIGTERM, checkpoint)
    if mode == "spawn":
        child = subprocess.Popen(
            [sys.executable, "-c", SPAWN_CHILD, LOOP], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        path = os.path.join(out, f"spawned.{me['RANK']}")
        with open(path + ".tmp", "w") as fp:
            json.dump({"worker": os.getpid(), "child": child.pid, "grandchild": grandchild}, fp)
        os.replace(path + ".tmp", path)
    peers: list[int] = []
    if mode == "watch":
        peers = [
            int(str(r["pid"]))
            for r in wait_for_round(out, me)
            if r["GROUP_RANK"] != me["GROUP_RANK"]
        ]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if os.path.exists(finish):
            return
        lost = [pid for pid in peers if not alive(pid)]
        if lost:
            print(f"rank {me['RANK']}: peer worker(s) {lost} gone", file=sys.stderr, flush=True)
            sys.exit(1)
        time.sleep(0.01)
    sys.exit(7)


if __name__ == "__main__":
    main()
