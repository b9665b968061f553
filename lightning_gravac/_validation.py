"""Argument checks shared by the public constructors: each raises ValueError naming the argument and what is allowed."""

import inspect
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

_T = TypeVar("_T")


def fraction(value: float, argument: str) -> float:
    """``value`` in (0, 1], as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"`{argument}` must be in (0, 1], got {value!r}.")
    return float(value)


def whole(value: int, argument: str, minimum: int = 1) -> int:
    """``value`` a whole number of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{argument}` must be a whole number >= {minimum}, got {value!r}.")
    return value


def choice(value: _T, argument: str, allowed: Sequence[_T]) -> _T:
    """``value`` one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"`{argument}` must be one of {tuple(allowed)}, got {value!r}.")
    return value


def nonnegative(value: float, argument: str) -> float:
    """``value`` a finite number of at least 0, as a float."""
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"`{argument}` must be a finite number >= 0, got {value}.")
    return number


def argument_names(*takers: Callable[..., Any], skip: Collection[str] = ("self",)) -> set[str]:
    """The arguments ``takers`` take by name: their parameters but ``*args``, ``**kwargs`` and ``skip``."""
    return {
        name
        for taker in takers
        for name, parameter in inspect.signature(taker).parameters.items()
        if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL) and name not in skip
    }
