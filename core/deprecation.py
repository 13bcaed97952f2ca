"""Old public names that keep working for one release, with a warning.

A public name that is renamed or moved keeps an alias until the release after the
one that renamed it (CHANGELOG.md lists each, under "Deprecated"); using the alias
warns with :class:`DeprecationWarning`, naming the new spelling. This module is a
leaf: it imports nothing of the package, so any module may use it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_module", "moved_names", "renamed_method"]


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release: use {new}",
        DeprecationWarning,
        stacklevel=3,
    )


def moved_names(module: str, moves: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` (PEP 562) for ``module`` that serves each old
    name in ``moves`` (old name -> ``"package.module:new_name"``) with a warning.

    Only names the module no longer defines reach it, so the current names cost
    nothing.
    """

    def __getattr__(name: str) -> Any:
        target = moves.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, _, new = target.partition(":")
        _warn(f"{module}.{name}", f"{where}.{new}")
        return getattr(importlib.import_module(where), new)

    return __getattr__


def moved_module(module: str, new: str) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` (PEP 562) for ``module``, a module whose
    contents moved whole to the module ``new``: each name ``new`` defines is served
    from there with a warning naming its new spelling. The alias module keeps only
    its docstring and this; ``new`` is imported on the first name asked for.

    ``from old import *`` works too, warning for each name (``__all__`` itself is
    served without a warning); other dunder names are not forwarded.
    """

    def __getattr__(name: str) -> Any:
        if name.startswith("__") and name != "__all__":
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target = importlib.import_module(new)
        if not hasattr(target, name):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if name != "__all__":
            _warn(f"{module}.{name}", f"{new}.{name}")
        return getattr(target, name)

    return __getattr__


def renamed_method(old: str, new: str) -> Any:
    """A method ``old`` that warns and calls the method ``new`` of the same object
    (assign it in the class body: ``monitor = renamed_method("monitor", "watch")``)."""

    def alias(self: Any, *args: Any, **kwargs: Any) -> Any:
        _warn(f"{type(self).__name__}.{old}", f"{type(self).__name__}.{new}")
        return getattr(self, new)(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old
    alias.__doc__ = f"Deprecated alias of :meth:`{new}` (removed in the next release)."
    return alias
