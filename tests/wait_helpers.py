"""Bounded waits shared by the tests of the handler and of real processes."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(condition: Callable[[], bool], timeout: float, pause: float = 0.02) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds (asked every
    ``pause`` seconds, and once more at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(pause)
    return condition()
