"""The code generator keeps meaning: a caller with rules inlined answers as the plain one.

Each case compares a caller compiled with ``inline`` against the same caller calling
its rules plainly (``__wrapped__``), on every input of a small grid: early returns,
nested branches, defaults, a rule calling a rule, a rule in an ``if`` test and in a
``return``, and locals whose names clash with the caller's.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from rallypoint.core import driver
from rallypoint.core.codegen import inline, renamed

LIMIT = 3


def _bounded(value: int) -> int:
    if value > LIMIT:
        return LIMIT
    if value < -LIMIT:
        return -LIMIT
    return value


def _sign(value: int) -> int:
    if value > 0:
        result = 1
    elif value < 0:
        result = -1
    else:
        return 0
    return result


def _scaled(value: int, factor: int = 2) -> int:
    value = value * factor  # a rule that assigns to its own parameter
    return _bounded(value)


def _positive(value: int) -> bool:
    return value > 0


def _nothing(value: int) -> None:
    if value:
        return
    _ = value


def caller(value: int, other: int) -> tuple[Any, ...]:
    result = _sign(value)  # the caller's local has a rule's local's name
    bounded = _bounded(other)
    scaled = _scaled(value)
    tripled = _scaled(other, 3)
    nothing = _nothing(value)
    if _positive(other):
        return (result, bounded, scaled, tripled, nothing, "positive")
    return _rest(result, bounded, scaled, tripled, nothing)


def _rest(*parts: Any) -> tuple[Any, ...]:
    return (*parts, "not positive")


def returning(value: int) -> int:
    return _scaled(value, 1)


def test_an_inlined_caller_answers_as_the_plain_one() -> None:
    fast = inline(caller, _sign, _bounded, _scaled, _positive, _nothing)
    assert fast is not caller and fast.__wrapped__ is caller  # type: ignore[attr-defined]
    for value, other in itertools.product(range(-5, 6), repeat=2):
        assert fast(value, other) == caller(value, other), (value, other)
    spliced = inline(returning, _scaled, _bounded)
    for value in range(-5, 6):
        assert spliced(value) == returning(value)


def test_the_inlined_form_makes_no_call_to_an_inlined_rule() -> None:
    fast = inline(caller, _sign, _bounded, _scaled, _positive, _nothing)
    names = set(fast.__code__.co_names)
    assert not names & {"_sign", "_bounded", "_scaled", "_positive", "_nothing"}
    assert "_rest" in names  # not named: called as written


def _keyword_caller(value: int) -> int:
    return _scaled(value, factor=3)


def test_a_call_it_cannot_inline_is_refused() -> None:
    with pytest.raises(ValueError, match="positional"):
        inline(_keyword_caller, _scaled)


def test_the_drivers_hot_functions_are_compiled_forms_of_their_source() -> None:
    for name in ("after_read", "after_write", "decide"):
        function = getattr(driver, name)
        assert function.__wrapped__.__name__ == name
        assert function.__code__ is not function.__wrapped__.__code__
    inlined = set(driver.decide.__code__.co_names)
    assert not inlined & {"_none_expired", "_write", "_no_write", "_phased", "current_form"}


def test_a_renamed_expression_reads_the_other_variable_and_nothing_else() -> None:
    assert renamed("state.complete and len(state.p) < n", {"state": "a"}) == (
        "a.complete and len(a.p) < n"
    )
    assert renamed("everyone_back(state)", {"state": "b"}) == "everyone_back(b)"
