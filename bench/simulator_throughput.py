"""Simulator throughput: node-steps per second at 64, 256 and 1,000 nodes.

One line per size: nodes, simulated seconds, node-steps, wall seconds, node-steps/s,
and backend writes and bytes per write (incremental size, see spec/simulator.py).
The run covers the first rendezvous (every node joins) and steady heartbeating.
Usage: python bench/simulator_throughput.py [--sizes 64,256,1000] [--duration 20]
"""

from __future__ import annotations

import argparse

from rallypoint.spec.simulator import SimConfig, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1000")
    parser.add_argument("--duration", type=float, default=20.0, help="simulated seconds")
    args = parser.parse_args()
    for n in (int(x) for x in args.sizes.split(",")):
        report = simulate(SimConfig(nodes=n, duration=args.duration, arrival_spread=2.0, seed=1))
        t = report.totals()
        print(
            f"nodes={n} simulated={report.simulated:.0f}s node_steps={report.node_steps} "
            f"wall={report.wall_seconds:.2f}s node_steps_per_s={report.steps_per_second:,.0f} "
            f"rounds={len(report.rounds)} writes={t.writes} "
            f"bytes_per_write={t.bytes_written / max(1, t.writes):,.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
