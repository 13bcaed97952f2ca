"""Decisions + applications per second: rallypoint's pure core vs torch's join operator.

Both sides run the same scripted protocol in one process, with no backend: ``nodes``
nodes join one rendezvous (min=2, max=2*nodes, so the last call is what completes
it), every node then observes the complete round and finishes, and every node exits
so the round advances. One *step* is one operator decision plus, when the action
changes the state, its application. Torch's side drives ``_RendezvousJoinOp`` /
``_RendezvousExitOp`` and applies actions with ``_DistributedRendezvousOpExecutor``'s
own methods on a ``_RendezvousState``, with its dead-node sanitizer run before every
decision as its sync does; its event recording is patched out (it would
only add logging cost) and its last call is 1 us so its wall-clock comparison passes
at once. rallypoint's side drives each node through the core's driver, as an adapter
does: before every decision the node reads the shared state (``after_read``; a
routine read, without the side heartbeat counters, which a node reads every half
liveness window and this bench's logical clock never reaches), ``decide`` makes
the decision, and a write is stored and fed back (``after_write``; nobody else
writes in between, so it wins its compare-and-set); a wait or a finished operation
ends with ``after_wait``. Time is a logical ``now``. The two sides alternate
within each repeat, and each reports its best repeat.

Usage: python bench/core_throughput.py [--nodes 8] [--rounds 300]
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

from torch.distributed.elastic.rendezvous import dynamic_rendezvous as tdr

from rallypoint.core import (
    Action,
    Done,
    ExitOp,
    JoinOp,
    NodeDesc,
    NodeView,
    Read,
    RendezvousState,
    Settings,
    Wait,
    Write,
    after_read,
    after_wait,
    after_write,
    decide,
)

FAR = 1e18


def run_rallypoint(nodes: int, rounds: int) -> int:
    settings = Settings("bench", 2, 2 * nodes, last_call_timeout=1e-9)
    members = [NodeDesc("host", 1000 + i, 0) for i in range(nodes)]
    state = RendezvousState()
    views = [NodeView() for _ in members]
    now = 0.0
    steps = 0
    for _ in range(rounds):
        for op in (JoinOp(), ExitOp()):
            pending = list(range(nodes))
            while pending:
                still = []
                for i in pending:
                    node = members[i]
                    now += 1e-6  # far below the liveness window: nobody dies
                    view = after_read(views[i], node, state, None, now)
                    instruction = decide(view, node, settings, op, FAR, now)
                    while type(instruction) is Read:  # the driver asks for more first
                        counters: dict[NodeDesc, int] | None = {} if instruction.counters else None
                        intents: tuple[NodeDesc, ...] | None = () if instruction.intents else None
                        view = after_read(view, node, state, counters, now, intents)
                        instruction = decide(view, node, settings, op, FAR, now)
                    steps += 1
                    kind = type(instruction)
                    if kind is Write:
                        state = instruction.state
                        view = after_write(view, node, True, state, now)
                        still.append(i)
                    elif kind is Wait:
                        view = after_wait(view)
                        still.append(i)
                    else:
                        # Neither a Beat (no keep-alive falls due in this logical time)
                        # nor an Announce (no compare-and-set is ever lost).
                        assert kind is Done and instruction.action is Action.FINISH, instruction
                        view = after_wait(view)  # the next operation starts afresh
                    views[i] = view
                pending = still
    assert state.round == rounds, state.round
    return steps


def _torch_holder(settings: tdr.RendezvousSettings) -> tdr._BackendRendezvousStateHolder:
    """torch's state holder without a backend: its ``_sanitize`` (dead-node removal,
    run on every sync) works on ``_state``; ``sync`` itself is never called."""
    holder = tdr._BackendRendezvousStateHolder.__new__(tdr._BackendRendezvousStateHolder)
    holder._state = tdr._RendezvousState()
    holder._settings = settings
    holder._dead_nodes = []
    return holder


_TORCH_EFFECTS = {
    tdr._Action.KEEP_ALIVE: "_keep_alive",
    tdr._Action.ADD_TO_PARTICIPANTS: "_add_to_participants",
    tdr._Action.ADD_TO_WAIT_LIST: "_add_to_wait_list",
    tdr._Action.ADD_TO_REDUNDANCY_LIST: "_add_to_redundancy_list",
    tdr._Action.REMOVE_FROM_PARTICIPANTS: "_remove_from_participants",
    tdr._Action.REMOVE_FROM_WAIT_LIST: "_remove_from_wait_list",
    tdr._Action.REMOVE_FROM_REDUNDANCY_LIST: "_remove_from_redundancy_list",
    tdr._Action.MARK_RENDEZVOUS_COMPLETE: "_mark_rendezvous_complete",
    tdr._Action.MARK_RENDEZVOUS_CLOSED: "_mark_rendezvous_closed",
}


def run_torch(nodes: int, rounds: int) -> int:
    timeout = tdr.RendezvousTimeout(last_call=timedelta(microseconds=1))
    settings = tdr.RendezvousSettings(
        "bench", 2, 2 * nodes, timeout, timedelta(seconds=5), keep_alive_max_attempt=3
    )
    holder = _torch_holder(settings)
    members = [tdr._NodeDesc("host", 1000 + i, 0) for i in range(nodes)]
    executors = {n: tdr._DistributedRendezvousOpExecutor(n, holder, settings) for n in members}
    original_record = tdr._DistributedRendezvousOpExecutor._record
    tdr._DistributedRendezvousOpExecutor._record = lambda self, *a, **k: None  # type: ignore[method-assign]
    steps = 0
    try:
        for _ in range(rounds):
            for op in (tdr._RendezvousJoinOp(), tdr._RendezvousExitOp()):
                pending = list(members)
                while pending:
                    still = []
                    for node in pending:
                        holder._sanitize()
                        ctx = tdr._RendezvousContext(node, holder.state, settings)
                        action = op(ctx, FAR)
                        steps += 1
                        effect = _TORCH_EFFECTS.get(action)
                        if effect is not None:
                            executor = executors[node]
                            executor._state = holder.state
                            getattr(executor, effect)()
                            still.append(node)
                        elif action is not tdr._Action.FINISH:
                            still.append(node)
                    pending = still
    finally:
        tdr._DistributedRendezvousOpExecutor._record = original_record  # type: ignore[method-assign]
    assert holder.state.round == rounds, holder.state.round
    return steps


def measure(nodes: int, rounds: int, repeats: int) -> tuple[float, int, float, int]:
    """Steps per second of each side (best repeat) and its step count; the sides
    alternate, so that a load change on the machine hits both alike."""
    best = {run_rallypoint: float("inf"), run_torch: float("inf")}
    steps = dict.fromkeys(best, 0)
    for _ in range(repeats):
        for fn in best:
            start = time.perf_counter()
            steps[fn] = fn(nodes, rounds)
            best[fn] = min(best[fn], time.perf_counter() - start)
    return (
        steps[run_rallypoint] / best[run_rallypoint],
        steps[run_rallypoint],
        steps[run_torch] / best[run_torch],
        steps[run_torch],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{'nodes':>5} {'rallypoint steps/s':>19} {'torch steps/s':>14} {'ratio':>6}  steps")
    for nodes in args.nodes:
        rounds = max(1, args.rounds * 4 // nodes)
        ours, ours_steps, theirs, torch_steps = measure(nodes, rounds, args.repeats)
        print(
            f"{nodes:>5} {ours:>19,.0f} {theirs:>14,.0f} {ours / theirs:>5.2f}x"
            f"  {ours_steps} vs {torch_steps}"
        )


if __name__ == "__main__":
    main()
