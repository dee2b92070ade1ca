"""Argument checks shared by the public API: numbers in range, and old keyword spellings.

Each check raises :class:`~sparsekit.errors.ConfigTypeError` for a value of the wrong type (a
bool is not a number here) and :class:`~sparsekit.errors.UsageError` for one out of range, with
a message naming the argument; it returns the value in its canonical type.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from sparsekit.errors import ConfigTypeError, UsageError

F = TypeVar("F", bound=Callable[..., Any])


def check_fraction(name: str, value: object, meaning: str = "") -> float:
    """``value`` as a float in [0, 1); ``meaning`` (e.g. "fraction of weights set to zero")
    goes into the range error.

    >>> check_fraction("ratio", 0.5)
    0.5
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{name} must be a number in [0, 1), got {value!r}")
    if math.isnan(value) or not 0.0 <= float(value) < 1.0:
        why = f" ({meaning})" if meaning else ""
        raise UsageError(f"{name}={value!r} must be in [0, 1){why}")
    return float(value)


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``.

    >>> check_int("steps", 3, 1)
    3
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise UsageError(f"{name}={value} must be an integer >= {minimum}")
    return value


def renamed(where: str, old: str, new: str, old_value: Any, new_value: Any,
            default: Any = None) -> Any:
    """The value of keyword ``new``, taking a value passed under its old name ``old`` with a
    DeprecationWarning (``where`` names the function). Passing both is a UsageError. An
    ``old_value`` of None means the old name was not passed; ``new_value == default`` means
    the new one was not.

    >>> renamed("f", "ignore", "exclude", None, ["fc"], default=())
    ['fc']
    """
    if old_value is None:
        return new_value
    if new_value is not default and new_value != default:
        raise UsageError(f"{where}: pass {new}= only ({old}= is its old name)")
    warnings.warn(f"{where}: {old}= is deprecated; use {new}=", DeprecationWarning, stacklevel=4)
    return old_value


def positional_until(names: tuple[str, ...], leading: int = 2) -> Callable[[F], F]:
    """Decorate a function whose arguments after the first ``leading`` (``self`` counts) are
    keyword-only, so that calls written when they were positional keep working: extra
    positional arguments are passed as ``names`` (their old order) with a DeprecationWarning.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            extra = args[leading:]
            if extra:
                if len(extra) > len(names):
                    raise ConfigTypeError(
                        f"{fn.__qualname__} takes {leading} positional arguments, got "
                        f"{len(args)}; pass the others by keyword"
                    )
                given = names[: len(extra)]
                warnings.warn(
                    f"{fn.__qualname__}: pass {', '.join(given)} by keyword (positional use is "
                    "deprecated)", DeprecationWarning, stacklevel=2,
                )
                clash = [n for n in given if n in kwargs]
                if clash:
                    raise ConfigTypeError(f"{fn.__qualname__} got {clash[0]} twice")
                kwargs.update(zip(given, extra))
            return fn(*args[:leading], **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
