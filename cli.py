"""The ``rallypoint`` command: one entry point, one subcommand per area.

* ``rallypoint run ...``      -- the torchrun-compatible elastic launcher (agent/)
* ``rallypoint spec ...``     -- the formal model: ``diagram``, ``check`` (spec/)
* ``rallypoint simulate ...`` -- the many-node simulator (spec/)
* ``rallypoint events FILE``  -- the events an agent wrote with ``--events-file`` (agent/)

Each area owns its own argument parser; this module only dispatches, importing an
area lazily so that ``rallypoint spec`` does not pay for importing torch. A
command line it cannot dispatch is one line on stderr and status 2, as the
areas' own usage errors are.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple


class _Command(NamedTuple):
    help: str
    entry: str  # "module:function", relative to this package, imported when run

    def main(self, argv: list[str]) -> int:
        module, _, function = self.entry.partition(":")
        status: int = getattr(importlib.import_module(module, __package__), function)(argv)
        return status


#: The subcommands, in the order the usage lists them.
_COMMANDS = {
    "run": _Command(
        "launch an elastic job (torchrun-compatible flags; see 'rallypoint run -h')",
        ".agent.launcher:main",
    ),
    "spec": _Command(
        "the formal model: 'rallypoint spec diagram', 'rallypoint spec check'",
        ".spec.cli:spec_main",
    ),
    "simulate": _Command(
        "simulate many nodes joining, failing and leaving", ".spec.cli:simulate_main"
    ),
    "events": _Command(
        "print the events written by 'rallypoint run --events-file FILE'",
        ".agent.events:events_main",
    ),
}

_USAGE = f"usage: rallypoint {{{','.join(_COMMANDS)}}} ...\n\n" + "".join(
    f"  {name:<10} {command.help}\n" for name, command in _COMMANDS.items()
)


def _usage_error(problem: str) -> int:
    """Say ``problem`` in one line, naming the commands, as argparse's errors read."""
    commands = ", ".join(_COMMANDS)
    print(
        f"rallypoint: error: {problem}: expected one of {commands} (see 'rallypoint --help')",
        file=sys.stderr,
    )
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        return _usage_error("a command is needed")
    if args[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0
    command = _COMMANDS.get(args[0])
    if command is None:
        return _usage_error(f"unknown command {args[0]!r}")
    return command.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
