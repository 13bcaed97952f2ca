"""The ``rallypoint`` command: one entry point, one subcommand per area.

* ``rallypoint run ...``      -- the torchrun-compatible elastic launcher (agent/)
* ``rallypoint spec ...``     -- the formal model: ``diagram``, ``check`` (spec/)
* ``rallypoint simulate ...`` -- the many-node simulator (spec/)
* ``rallypoint events FILE``  -- the events an agent wrote with ``--events-file`` (agent/)

Each area owns its own argument parser; this module only dispatches, importing an
area lazily so that ``rallypoint spec`` does not pay for importing torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

_USAGE = """usage: rallypoint {run,spec,simulate,events} ...

  run        launch an elastic job (torchrun-compatible flags; see 'rallypoint run -h')
  spec       the formal model: 'rallypoint spec diagram', 'rallypoint spec check'
  simulate   simulate many nodes joining, failing and leaving
  events     print the events written by 'rallypoint run --events-file FILE'
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # a usage error: the usage goes to stderr, as argparse does
        print(_USAGE, end="", file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0
    command, rest = args[0], args[1:]
    if command == "run":
        from .agent.launcher import main as run_main

        return run_main(rest)
    if command == "spec":
        from .spec.cli import spec_main

        return spec_main(rest)
    if command == "simulate":
        from .spec.cli import simulate_main

        return simulate_main(rest)
    if command == "events":
        from .agent.events import events_main

        return events_main(rest)
    print(f"rallypoint: unknown command {command!r}\n\n{_USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
