"""What core/node.py tells an embedder's executor to do agrees with the bundled
executors (StateSync, the asyncio executor): the backoff after a lost
compare-and-set, the poll cap and wake margin of a Wait, and the answer to a Read
that keeps the held state."""

from __future__ import annotations

import inspect
import random

import pytest

from rallypoint.adapters import StateSync, sync
from rallypoint.adapters.aio import AsyncRendezvous
from rallypoint.core import dispatch
from rallypoint.core import node as node_module


def _doc() -> str:
    return " ".join((node_module.__doc__ or "").split())


def test_the_documented_backoff_is_the_executors_backoff() -> None:
    doc = _doc()
    assert f"min({dispatch.MAX_BACKOFF:g}, 0.001 * 2**losses)" in doc
    rng = random.Random(0)
    for losses in range(0, 20):
        cap = min(dispatch.MAX_BACKOFF, 0.001 * 2**losses)
        assert all(0 <= sync.backoff_delay(losses, rng) <= cap for _ in range(50))


def test_the_documented_poll_and_wake_margin_are_the_executors() -> None:
    doc = _doc()
    for executor in (StateSync, AsyncRendezvous):
        poll = inspect.signature(executor).parameters["poll_interval"].default
        assert poll == 1.0, executor
    assert "poll every second" in doc
    assert f"{dispatch.WAKE_EPSILON * 1000:g} ms past ``until``" in doc
    assert sync.wait_timeout(None, 0.0, 1.0) == 1.0
    assert sync.wait_timeout(5.0, 4.9, 1.0) == pytest.approx(0.1 + dispatch.WAKE_EPSILON)
