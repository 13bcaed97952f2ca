"""``python -m rallypoint.spec diagram|check|simulate ...``."""

from __future__ import annotations

import sys

from .cli import simulate_main, spec_main


def main(argv: list[str]) -> int:
    if argv and argv[0] == "simulate":
        return simulate_main(argv[1:])
    return spec_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
