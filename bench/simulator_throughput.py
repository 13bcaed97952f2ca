"""Simulator throughput and the cost per node of one rendezvous, at 1,000 and 10,000 nodes.

docs/design.md, decision 8: judge every protocol change at 1,000 and 10,000 simulated
nodes. Per size, n nodes arrive uniformly within --spread seconds (2 s) for a round
of exactly n (min = max = n: the round completes when the last node is admitted,
and every node returns from the same join; --half-min uses min = n/2, where the
round completes a last call after n/2 joined and late nodes wait for the next one).
The simulated nodes run the core's driver (the production code path), so the
figures include what a real node's decisions cost.

One line per size:

* first_round_wall: wall seconds until every node returned from the first join
  (first_round_sim: simulated seconds), or how far it got within --wall-limit
  (partial: simulated time, nodes admitted, nodes returned);
* node_steps_per_s: driver decisions per wall second over that run;
* per node, up to that point: wake-ups (waits ended by a phase or a timer),
  phase notifications, reads, writes, CAS losses, intent-log announces, bytes read
  (states, side counters and intent logs), and the state's size at the end;
* with --steady S, a second line: S further simulated seconds of training
  (keep-alive beats, the agent's monitor), node-steps/s and per-node figures.

Usage: python bench/simulator_throughput.py [--sizes 1000,10000] [--wall-limit 600]
       [--steady 20] [--half-min] [--seed 1]
"""

from __future__ import annotations

import argparse
import time

from rallypoint.spec.simulator import NodeStats, SimConfig, Simulator


def _per_node(totals: NodeStats, n: int) -> str:
    return (
        f"wakeups_per_node={totals.wakeups / n:.2f} "
        f"notifications_per_node={totals.notifications / n:.2f} "
        f"reads_per_node={totals.reads / n:.2f} writes_per_node={totals.writes / n:.2f} "
        f"cas_losses_per_node={totals.conflicts / n:.2f} "
        f"announces_per_node={totals.announces / n:.2f} "
        f"bytes_read_per_node={totals.bytes_read / n:,.0f}"
    )


def _delta(after: NodeStats, before: NodeStats) -> NodeStats:
    return NodeStats(**{k: getattr(after, k) - getattr(before, k) for k in vars(after)})


def run(n: int, args: argparse.Namespace) -> None:
    config = SimConfig(
        nodes=n,
        min_nodes=n // 2 if args.half_min else n,
        max_nodes=n,
        duration=3600.0,
        arrival_spread=args.spread,
        seed=args.seed,
    )
    sim = Simulator(config)
    report = sim.report
    start = time.perf_counter()
    next_progress = start + args.progress
    while not report.rounds and time.perf_counter() - start < args.wall_limit:
        sim.run_until(sim.now + 0.01)
        if args.progress and time.perf_counter() > next_progress:
            next_progress += args.progress
            returned = sum(node.phase == "training" for node in sim.nodes)
            print(
                f"  ... nodes={n} wall={time.perf_counter() - start:.0f}s "
                f"simulated={sim.now:.2f}s node_steps={report.node_steps} "
                f"admitted={len(sim.state.participants)} returned={returned}",
                flush=True,
            )
    wall = time.perf_counter() - start
    totals = report.totals()
    mode = "min=n/2,max=n" if args.half_min else "min=max=n"
    if report.rounds:
        first = report.rounds[0]
        outcome = (
            f"first_round_wall={wall:.2f}s first_round_sim={first.completed:.3f}s "
            f"round_size={first.size}"
        )
    else:
        returned = sum(node.phase == "training" for node in sim.nodes)
        outcome = (
            f"first_round_wall>{wall:.0f}s (stopped by --wall-limit) partial: "
            f"simulated={sim.now:.2f}s admitted={len(sim.state.participants)} "
            f"returned={returned}"
        )
    print(
        f"nodes={n} ({mode}, arrivals within {args.spread:g}s) {outcome} "
        f"node_steps={report.node_steps} node_steps_per_s={report.node_steps / wall:,.0f} "
        f"{_per_node(totals, n)} phases={report.phases} state_bytes={sim.size.value:,} "
        f"violations={len(report.violations)}",
        flush=True,
    )
    if not (args.steady and report.rounds):
        return
    steps, before = report.node_steps, totals
    start = time.perf_counter()
    end = sim.now + args.steady
    while sim.now < end and time.perf_counter() - start < args.wall_limit:
        sim.run_until(min(end, sim.now + 0.5))
    wall = time.perf_counter() - start
    steps = report.node_steps - steps
    print(
        f"nodes={n} steady: simulated={args.steady - max(0.0, end - sim.now):.1f}s "
        f"wall={wall:.2f}s node_steps={steps} node_steps_per_s={steps / wall:,.0f} "
        f"{_per_node(_delta(report.totals(), before), n)} "
        f"violations={len(report.violations)} false_deaths={report.false_deaths}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--spread", type=float, default=2.0, help="arrival window, s")
    parser.add_argument("--half-min", action="store_true", help="min_nodes = n/2")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--wall-limit", type=float, default=600.0, help="wall seconds per size (and phase)"
    )
    parser.add_argument("--steady", type=float, default=0.0, help="simulated seconds after")
    parser.add_argument(
        "--progress", type=float, default=30.0, help="a progress line every this many s (0: none)"
    )
    args = parser.parse_args()
    for n in (int(x) for x in args.sizes.split(",")):
        run(n, args)


if __name__ == "__main__":
    main()
