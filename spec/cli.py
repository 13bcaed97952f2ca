"""``rallypoint spec ...`` and ``rallypoint simulate ...``: argument parsing and output.

* ``rallypoint spec diagram [--output PATH] [--source]`` writes the lifecycle diagram
  (PNG via graphviz's ``dot``) and its ``.dot`` and mermaid sources.
* ``rallypoint spec check --nodes 3`` runs the model checker (nodes run by the core's driver).
* ``rallypoint spec check --live [--nodes 3] [--max-crashes 1] [--live-backend both]``
  checks the live round switch's model instead (ranks, faults; gloo and/or NCCL
  collectives).
* ``rallypoint simulate --nodes 1000 --crash-rate 0.01 --seed 7 [--plot out.png]``
  runs the simulator and prints a summary table.

Both take the job-wide restart budget and self-exclusion: ``spec check
--max-failures N --max-exclusions N [--restart-budget B] [--exclusion-rounds R]``,
``simulate --worker-failure-rate F --health-failure-rate H [--restart-budget B]
[--exclusion-rounds R]`` (all off by default). ``simulate --newcomer-startup S
[--no-shrink]`` simulates live regroup's admission of newcomers.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import psutil

if TYPE_CHECKING:
    from rich.console import Console

    from .check import CheckConfig, CheckResult
    from .simulator import SimReport

__all__ = ["simulate_main", "spec_main"]


#: The share of the memory available at its start that a check may fill by default.
#: A search the out-of-memory killer ends leaves nothing (before
#: CheckerWorkerError, a killed worker left it waiting forever for its chunk);
#: one stopped at the limit leaves its figures. The default 4-node space peaks at
#: about 18 GiB (its memo tables are bounded): 90% of a 23 GiB machine's 22.5
#: available holds it, 80% would stop it near its end.
_DEFAULT_MEMORY_SHARE = 0.9


class _Parser(argparse.ArgumentParser):
    """A usage error is one line, ``PROG: error: MESSAGE``, and status 2, as the other
    commands report theirs: argparse's own starts with the whole usage, many lines
    (``-h`` still prints it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _spec_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of ``rallypoint spec``, and the names of its commands."""
    parser = _Parser(prog="rallypoint spec", description=__doc__.splitlines()[0])
    # Not required=True: argparse would name the destination ("command"), not the commands.
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    diagram = sub.add_parser("diagram", help="write the state diagram of one node's lifecycle")
    diagram.add_argument(
        "--output", default="docs/spec-diagram.png", help="image path (.png, .svg)"
    )
    diagram.add_argument(
        "--source", action="store_true", help="only write the .dot and .mmd sources (no graphviz)"
    )
    check = sub.add_parser("check", help="model-check the core, run by its driver, exhaustively")
    check.add_argument("--nodes", type=int, default=3)
    check.add_argument("--min", dest="min_nodes", type=int, default=2)
    check.add_argument("--max", dest="max_nodes", type=int, default=3)
    check.add_argument(
        "--max-round",
        type=int,
        default=None,
        help="keep concrete round numbers and stop expanding after this round "
        "(default: every round, through the round abstraction)",
    )
    check.add_argument("--max-crashes", type=int, default=1)
    check.add_argument("--no-close", action="store_true", help="nodes never close")
    check.add_argument(
        "--leaves",
        action="store_true",
        help="training nodes may also leave for good (an agent stopping), not only exit to rejoin",
    )
    check.add_argument("--stable-ranks", action="store_true", help="check the stable-ranks option")
    check.add_argument("--no-symmetry", action="store_true", help="disable symmetry reduction")
    check.add_argument(
        "--no-subsumption",
        action="store_true",
        help="step every state, also those a state with earlier deadlines simulates",
    )
    check.add_argument("--max-states", type=int, default=None, help="stop after this many")
    check.add_argument(
        "--max-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="stop once the checker's processes hold this much memory, in GiB "
        "(default: 90%% of the memory available when the check starts)",
    )
    check.add_argument(
        "--max-failures",
        type=int,
        default=0,
        help="times a training node's workers may fail (it charges the restart budget); "
        "default 0: none",
    )
    check.add_argument(
        "--max-exclusions",
        type=int,
        default=0,
        help="times a node may exclude itself (a failed health check); default 0: none",
    )
    check.add_argument(
        "--restart-budget",
        type=int,
        default=None,
        help="job-wide restarts before a failure closes the rendezvous (default: no budget)",
    )
    check.add_argument(
        "--exclusion-rounds", type=int, default=1, help="rounds an excluded node sits out"
    )
    check.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes that expand states (default: one per CPU core)",
    )
    check.add_argument(
        "--quiet",
        action="store_true",
        help="no progress display (it shows only on a terminal anyway)",
    )
    check.add_argument(
        "--live",
        action="store_true",
        help="check the live round switch's model instead: --nodes ranks, --max-crashes "
        "faults, --max-states (see docs/spec.md)",
    )
    check.add_argument(
        "--live-backend",
        choices=("gloo", "nccl", "both"),
        default="both",
        help="with --live: how a collective meets a lost peer: it fails (gloo) or waits "
        "until aborted (nccl); default both, one search each",
    )
    return parser, list(sub.choices)


def spec_main(argv: list[str]) -> int:
    """Entry point of ``rallypoint spec``; returns the exit status."""
    parser, commands = _spec_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(
            f"a command is needed: expected one of {', '.join(commands)} "
            "(see 'rallypoint spec --help')"
        )
    if args.command == "diagram":
        return _diagram(Path(args.output), source_only=args.source)
    if args.live:
        return _check_live(args)
    from .check import CheckConfig, CheckerWorkerError, check

    changes = {
        "allow_close": not args.no_close,
        "symmetry": not args.no_symmetry,
        "subsumption": not args.no_subsumption,
    }
    if args.max_memory is None:
        changes["max_memory"] = _DEFAULT_MEMORY_SHARE * psutil.virtual_memory().available / 2**30
    config = _config("rallypoint spec check", CheckConfig, args, changes)
    if config is None:
        return 2
    workers = args.workers if args.workers is not None else os.cpu_count() or 1
    if workers < 1:
        print(
            f"rallypoint spec check: --workers must be at least 1, got {workers}", file=sys.stderr
        )
        return 2
    try:
        if args.quiet or not sys.stderr.isatty():
            result = check(config, workers=workers)
        else:
            result = _check_with_progress(config, workers)
    except CheckerWorkerError as exc:
        print(f"rallypoint spec check: {exc}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0 if result.ok else 1


def _check_live(args: argparse.Namespace) -> int:
    """``rallypoint spec check --live``: one search of the live switch's model per
    backend, a summary of each (violations with their traces)."""
    from .check.live_switch import LiveSwitchConfig, check_live_switch

    prog = "rallypoint spec check --live"
    backends = ("gloo", "nccl") if args.live_backend == "both" else (args.live_backend,)
    bounds: dict[str, Any] = {"ranks": args.nodes, "max_faults": args.max_crashes}
    if args.max_states is not None:
        bounds["max_states"] = args.max_states
    try:
        configs = [LiveSwitchConfig(backend=backend, **bounds) for backend in backends]
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    ok = True
    for config in configs:
        result = check_live_switch(config)
        print(result.summary())
        ok = ok and result.ok
    return 0 if ok else 1


_Config = TypeVar("_Config")


def _config(
    prog: str, make: Callable[..., _Config], args: argparse.Namespace, changes: dict[str, Any]
) -> _Config | None:
    """The config ``make`` builds from the options of the same names in ``args``
    (and ``changes``); None, after saying why on stderr, when it refuses them."""
    names = set(inspect.signature(make).parameters)
    options = {k: v for k, v in vars(args).items() if k in names}
    try:
        return make(**{**options, **changes})
    except ValueError as exc:  # the configs' errors are ValueErrors naming the field
        print(f"{prog}: {exc}", file=sys.stderr)
        return None


def _diagram(out: Path, *, source_only: bool) -> int:
    prog = "rallypoint spec diagram"
    problem = _unwritable(out, "--output")
    if problem is None and not source_only:
        problem = _unknown_image_format(out)
    if problem is not None:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    from .model.machine import ModelUnavailableError, diagram_source, write_diagram

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".dot").write_text(diagram_source("graphviz"))
        out.with_suffix(".mmd").write_text(diagram_source("mermaid"))
        print(f"wrote {out.with_suffix('.dot')} and {out.with_suffix('.mmd')}")
        if source_only:
            return 0
        write_diagram(out)
    except ModelUnavailableError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{prog}: cannot write {exc.filename or out}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _unwritable(path: Path, option: str) -> str | None:
    """Why ``path`` cannot be written (None: nothing found), checked before any work.

    Catches what is wrong with the path itself: a directory, a file where a
    directory is needed, a directory this user cannot write. Failures the file
    system only shows when writing (a full disk, a read-only mount) remain.
    """
    if path.is_dir():
        return f"{option} {str(path)!r} is a directory; give a file name"
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{option} {str(path)!r}: {str(ancestor)!r} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{option} {str(path)!r}: no permission to write in {str(ancestor)!r}"
    return None


def _unknown_image_format(path: Path) -> str | None:
    fmt = path.suffix.lstrip(".") or "png"
    try:
        from graphviz import FORMATS
    except ImportError:  # write_diagram reports what is missing
        return None
    if fmt.lower() not in FORMATS:
        return (
            f"--output {str(path)!r}: graphviz cannot write {fmt!r} images; use .png, .svg or .pdf"
        )
    return None


def _check_with_progress(config: CheckConfig, workers: int) -> CheckResult:
    """Run the checker with a live line on stderr: states, transitions, depth,
    states per second, the memory its processes hold and elapsed time (rich
    redraws it in place)."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .check import check

    columns = (
        SpinnerColumn(),
        TextColumn(
            "{task.fields[states]:,} states, {task.fields[transitions]:,} transitions, "
            "depth {task.fields[depth]}, {task.fields[rate]:,.0f} states/s, "
            "{task.fields[memory]:.1f} GiB"
        ),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(
            "checking", total=None, states=0, transitions=0, depth=0, rate=0.0, memory=0.0
        )

        def progress(r: CheckResult) -> None:
            rate = r.states / r.seconds if r.seconds > 0 else 0.0
            bar.update(
                task,
                states=r.states,
                transitions=r.transitions,
                depth=r.depth,
                rate=rate,
                memory=r.memory,
            )

        return check(config, progress, workers)


#: Most nodes ``rallypoint simulate`` takes: 10x the largest size the docs measure
#: (10,000 nodes in seconds); far beyond, a run takes hours or exhausts memory.
MAX_SIMULATED_NODES = 100_000


def _simulate_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="rallypoint simulate", description="simulate many rendezvous nodes deterministically"
    )
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--min", dest="min_nodes", type=int, default=None)
    p.add_argument("--max", dest="max_nodes", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=300.0, help="simulated seconds")
    p.add_argument("--crash-rate", type=float, default=0.0, help="crashes per node per minute")
    p.add_argument("--partition-rate", type=float, default=0.0, help="per node per minute")
    p.add_argument("--partition-duration", type=float, default=30.0)
    p.add_argument("--leave-rate", type=float, default=0.0, help="leaves per node per minute")
    p.add_argument("--restart-delay", type=float, default=10.0)
    p.add_argument(
        "--worker-failure-rate",
        type=float,
        default=0.0,
        help="workers' failures per training node per minute (the node charges the "
        "restart budget, exits and joins again)",
    )
    p.add_argument(
        "--health-failure-rate",
        type=float,
        default=0.0,
        help="failed health checks per node per minute (the node excludes itself and "
        "joins again as a spare)",
    )
    p.add_argument(
        "--restart-budget",
        type=int,
        default=None,
        help="job-wide restarts before a failure closes the rendezvous (default: no budget)",
    )
    p.add_argument(
        "--exclusion-rounds", type=int, default=1, help="rounds an excluded node sits out"
    )
    p.add_argument(
        "--newcomer-startup",
        type=float,
        default=None,
        metavar="SECONDS",
        help="live regroup: new workers (replacements, a starting node's) are ready after "
        "this long, and the node follows the core's admission rule meanwhile "
        "(default: off, a node joins at once)",
    )
    p.add_argument(
        "--no-shrink",
        dest="may_shrink",
        action="store_false",
        help="live: the script does not let the world shrink while newcomers start",
    )
    p.add_argument("--latency", type=float, default=0.002, help="one-way backend latency, s")
    p.add_argument("--jitter", type=float, default=0.001)
    p.add_argument("--conflict-rate", type=float, default=0.0, help="spurious CAS failures")
    p.add_argument("--clock-offset", type=float, default=0.0, help="max clock offset, s")
    p.add_argument("--drift", type=float, default=0.0, help="max clock drift (0.01 = 1%%)")
    p.add_argument("--last-call", type=float, default=1.0, help="last call timeout, s")
    p.add_argument("--arrival-spread", type=float, default=2.0)
    p.add_argument("--plot", type=Path, default=None, help="PNG of round-completion times")
    p.add_argument("--no-timing", action="store_true", help="omit the wall-clock line")
    return p


def simulate_main(argv: list[str]) -> int:
    """Entry point of ``rallypoint simulate``; returns the exit status."""
    args = _simulate_parser().parse_args(argv)
    prog = "rallypoint simulate"
    problem = _simulate_input_problem(args)
    if problem is not None:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            print(
                f"{prog}: --plot needs matplotlib: pip install 'rallypoint[plot]'", file=sys.stderr
            )
            return 1
        problem = _unknown_plot_format(args.plot)
        if problem is not None:
            print(f"{prog}: {problem}", file=sys.stderr)
            return 2
    from .simulator import SimConfig, simulate

    config = _config(prog, SimConfig, args, {"last_call_timeout": args.last_call})
    if config is None:
        return 2
    report = simulate(config)
    console = _print_report(report, timing=not args.no_timing)
    if args.plot is not None:
        try:
            _plot(report, args.plot)
        except OSError as exc:
            print(
                f"{prog}: cannot write {exc.filename or args.plot}: {exc.strerror}",
                file=sys.stderr,
            )
            return 1
        console.print(f"wrote {args.plot}")
    return 0 if report.ok else 1


def _print_report(report: SimReport, *, timing: bool) -> Console:
    """The report as a table (and its violations), on stdout; the console used."""
    from rich.console import Console
    from rich.table import Table

    config = report.config
    console = Console()
    table = Table(title=f"rallypoint simulate: {config.nodes} nodes, seed {config.seed}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in report.summary_rows():
        table.add_row(name, value)
    console.print(table)
    for violation in report.violations:
        console.print(violation.format(), markup=False)
    if timing:
        console.print(
            f"wall {report.wall_seconds:.2f} s, {report.steps_per_second:,.0f} node-steps/s"
        )
    return console


def _simulate_input_problem(args: argparse.Namespace) -> str | None:
    for option, value in (
        ("--nodes", args.nodes),
        ("--min", args.min_nodes),
        ("--max", args.max_nodes),
    ):
        if value is not None and value > MAX_SIMULATED_NODES:
            return f"{option} must be at most {MAX_SIMULATED_NODES:,}, got {value:,}"
    if args.plot is not None:
        return _unwritable(args.plot, "--plot")
    return None


def _unknown_plot_format(path: Path) -> str | None:
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = path.suffix.lstrip(".").lower()
    if suffix and suffix not in FigureCanvasBase.get_supported_filetypes():
        return f"--plot {str(path)!r}: matplotlib cannot write {suffix!r} files; use .png or .svg"
    return None


def _plot(report: object, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = report.rounds  # type: ignore[attr-defined]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([r.round for r in rounds], [r.duration for r in rounds])
    ax.set_xlabel("round")
    ax.set_ylabel("seconds from first join to last return")
    ax.set_title(f"round completion, {report.config.nodes} nodes")  # type: ignore[attr-defined]
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
