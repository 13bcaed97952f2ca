"""Simulator throughput: node-steps per second at 64, 256 and 1,000 nodes.

One line per size: nodes, simulated seconds, node-steps (driver decisions), wall
seconds, node-steps/s, rounds, and backend traffic: blob writes, bytes per blob write
(incremental size, see spec/simulator.py), reads and heartbeat beats per node. The
simulated nodes run the core's driver (the production code path), so the figures
include what a real node's decisions cost. The run covers the first rendezvous
(every node joins) and steady heartbeating; a size that needs more than --wall-limit
seconds stops early and says how far it got (simulated=...).
Usage: python bench/simulator_throughput.py [--sizes 64,256,1000] [--duration 20]
"""

from __future__ import annotations

import argparse
import time

from rallypoint.spec.simulator import SimConfig, Simulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1000")
    parser.add_argument("--duration", type=float, default=20.0, help="simulated seconds")
    parser.add_argument("--wall-limit", type=float, default=120.0, help="seconds per size")
    args = parser.parse_args()
    for n in (int(x) for x in args.sizes.split(",")):
        sim = Simulator(SimConfig(nodes=n, duration=args.duration, arrival_spread=2.0, seed=1))
        start = time.perf_counter()
        while sim.now < args.duration and time.perf_counter() - start < args.wall_limit:
            sim.run_until(min(args.duration, sim.now + 0.05))
        report = sim.report
        report.wall_seconds = time.perf_counter() - start
        t = report.totals()
        print(
            f"nodes={n} simulated={report.simulated:.0f}s node_steps={report.node_steps} "
            f"wall={report.wall_seconds:.2f}s node_steps_per_s={report.steps_per_second:,.0f} "
            f"rounds={len(report.rounds)} writes={t.writes} "
            f"bytes_per_write={(t.bytes_written - t.beat_bytes) / max(1, t.writes):,.0f} "
            f"reads_per_node={t.reads / n:.1f} beats_per_node={t.beats / n:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
