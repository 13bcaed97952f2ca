"""The live mode's cost per training step when nothing fails, on examples/train.py.

Runs ``rallypoint run --standalone --nproc-per-node 2 examples/train.py --steps N``
without ``--live`` (the script still runs in the live API's single round) and with
``--live`` (the ranks agree every ~0.2 s on a pending round, each step is reported
to the agent), interleaved, and compares the training time the script prints (its
loop only, not start-up). With ``--live`` the agent also starts its warm spare
after the first steps (an interpreter importing torch beside the training); the
``--live --no-live-spare`` column leaves it out. Usage::

    python bench/live_overhead.py [--steps 3000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"
MODES = {"plain": [], "--live": ["--live"], "--live --no-live-spare": ["--live", "--no-live-spare"]}
_TIME = re.compile(r"final loss: \S+ after \d+ steps \(([0-9.]+) s on")


def train_seconds(flags: list[str], steps: int) -> float:
    with tempfile.TemporaryDirectory(prefix="rallypoint-overhead-") as ckpt:
        out = subprocess.run(
            [sys.executable, "-m", "rallypoint.run", "--standalone", "--nproc-per-node", "2",
             *flags, str(EXAMPLE), "--steps", str(steps), "--checkpoint-every", str(10**9),
             "--checkpoint-dir", ckpt],
            capture_output=True, text=True, timeout=600, check=True,
        )  # fmt: skip
    match = _TIME.search(out.stdout)
    if match is None:
        raise RuntimeError(f"no timing in the output:\n{out.stdout}\n{out.stderr[-2000:]}")
    return float(match.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode, flags in MODES.items():  # interleaved: load drifts hit all alike
            times[mode].append(train_seconds(flags, args.steps))
    plain = statistics.median(times["plain"])
    for mode, runs in times.items():
        median = statistics.median(runs)
        spread = ", ".join(f"{t:.2f}" for t in runs)
        print(
            f"examples/train.py, 2 workers, {args.steps} steps, {mode}: "
            f"{median / args.steps * 1e3:.3f} ms/step, {median / plain - 1:+.1%} vs plain "
            f"[runs, s: {spread}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
