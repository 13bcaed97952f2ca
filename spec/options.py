"""Range checks shared by the configs of the checker and the simulator.

A config names its rules (:class:`Rule`) and its own error type:
:func:`check_ranges` raises that error for the first field out of range, naming
it; :func:`check_settings` for the settings the config makes, when the core
refuses them (carrying the core's message over).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple, Protocol

from ..core import Settings

__all__ = ["Rule", "check_ranges", "check_settings"]


class Rule(NamedTuple):
    """Fields that must be numbers of at least ``low`` (above it, with ``strict``;
    and finite, with ``finite``). A field that is None is not set, and passes."""

    names: tuple[str, ...]
    low: float
    strict: bool = False
    finite: bool = False

    def problem(self, name: str, value: object) -> str | None:
        """What is wrong with ``value`` of field ``name`` (None: nothing)."""
        if value is None:
            return None
        if isinstance(value, (int, float)):
            above = value > self.low if self.strict else value >= self.low
            if above and (not self.finite or math.isfinite(value)):
                return None
        number = "a finite number" if self.finite else "a number"
        relation = ">" if self.strict else ">="
        return f"{name} must be {number} {relation} {self.low:g}, got {value!r}"


def check_ranges(config: object, error: type[ValueError], rules: Iterable[Rule]) -> None:
    """Check the fields of ``config`` against ``rules``.

    Raises:
        error: the first field out of range.
    """
    for rule in rules:
        for name in rule.names:
            problem = rule.problem(name, getattr(config, name))
            if problem is not None:
                raise error(problem)


class _MakesSettings(Protocol):
    def settings(self) -> Settings: ...


def check_settings(config: _MakesSettings, error: type[ValueError]) -> None:
    """Make the settings of ``config`` once, to see that the core takes them.

    Raises:
        error: with the core's reason for refusing them.
    """
    try:
        config.settings()
    except ValueError as exc:
        raise error(str(exc)) from None
