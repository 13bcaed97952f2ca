"""How many examples a property test draws.

``make test`` (CI) draws what each test asks for. ``make test-fast`` sets
``RALLYPOINT_FAST_EXAMPLES=1``: every property then draws a tenth of its count (at
least 10; hypothesis's default of 100 becomes 10), so the edit loop takes seconds and
the full counts still run before anything lands.
"""

from __future__ import annotations

import os

from hypothesis import settings

__all__ = ["FAST", "examples"]

FAST = os.environ.get("RALLYPOINT_FAST_EXAMPLES") == "1"

settings.register_profile("fast", max_examples=10)
if FAST:
    settings.load_profile("fast")


def examples(count: int, **options: object) -> settings:
    """Settings that draw ``count`` examples (a tenth, at least 10, under
    ``make test-fast``), with hypothesis's other ``options``."""
    return settings(max_examples=max(10, count // 10) if FAST else count, **options)  # type: ignore[arg-type]
