"""Bounded waits shared by the tests of the handler and of real processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def eventually(condition: Callable[[], bool], timeout: float, pause: float = 0.02) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds (asked every
    ``pause`` seconds, and once more at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(pause)
    return condition()


def join_all(handlers: Sequence[Any], timeout: float) -> list[Any]:
    """Every handler's ``next_rendezvous()``, called at once from threads, as
    nodes do; each must return within ``timeout`` seconds."""
    with ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), handlers, timeout=timeout))
