"""Termination signals in the agent: turned into :class:`SignalReceived` while the job
runs, ignored while the agent cleans up (a second signal must not cut that short)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "SignalReceived", "ignore_signals", "raise_on_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class SignalReceived(Exception):
    """The agent received one of its stop signals (``--signals-to-handle``, by default
    SIGTERM, SIGINT, SIGHUP, SIGQUIT); it stops its workers and exits."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}")


@contextlib.contextmanager
def raise_on_signals(signals: Sequence[signal.Signals] = STOP_SIGNALS) -> Iterator[None]:
    """Turn ``signals`` into :class:`SignalReceived` in the main thread (elsewhere:
    nothing is installed, the caller handles signals itself)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SignalReceived(signum)

    previous: dict[signal.Signals, Any] = {}
    try:
        for sig in signals:
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:
                # Not the main thread: the caller handles signals itself.
                break
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def ignore_signals(signals: Sequence[signal.Signals] = STOP_SIGNALS) -> None:
    """Ignore ``signals`` from now on (in the main thread; elsewhere nothing happens)."""
    with contextlib.suppress(ValueError):  # not the main thread: nothing was installed
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
