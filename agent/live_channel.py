"""Deprecated: moved to :mod:`rallypoint.agent.worker.live_channel` (what runs in a worker's
process lives in ``rallypoint.agent.worker``). Every name still works from here, with
a ``DeprecationWarning``, until the next release (CHANGELOG.md)."""

from __future__ import annotations

from ..core.deprecation import moved_module

__getattr__ = moved_module(__name__, f"{__package__}.worker.live_channel")
