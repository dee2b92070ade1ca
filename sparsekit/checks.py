"""Argument checks shared by the public API: numbers in range, modules, mappings.

Each check raises :class:`~sparsekit.errors.ConfigTypeError` for a value of the wrong type (a
bool is not a number here) and :class:`~sparsekit.errors.UsageError` for one out of range, with
a message naming the argument; it returns the value in its canonical type.
"""

from __future__ import annotations

import math

from sparsekit.errors import ConfigTypeError, UsageError


def _what(value: object) -> str:
    """``type value`` for an error message, the value's repr cut to 60 characters."""
    return f"{type(value).__name__} {value!r:.60}"


def check_module(value: object, name: str = "model", where: str = "") -> object:
    """``value`` if it is a ``torch.nn.Module``; a ConfigTypeError naming ``name`` (and the
    verb ``where``, e.g. ``"sk.save: "``) otherwise: not an AttributeError deep inside.

    >>> check_module("model", where="sk.save: ")
    Traceback (most recent call last):
    ...
    sparsekit.errors.ConfigTypeError: sk.save: model must be a torch.nn.Module, got str 'model'
    """
    from torch import nn

    if not isinstance(value, nn.Module):
        raise ConfigTypeError(f"{where}{name} must be a torch.nn.Module, got {_what(value)}")
    return value


def check_mapping(value: object, name: str, allowed: str) -> object:
    """``value`` if it is a mapping (a dict); a ConfigTypeError naming ``name`` and what it
    holds (``allowed``) otherwise."""
    from collections.abc import Mapping

    if not isinstance(value, Mapping):
        raise ConfigTypeError(f"{name} must be a dict ({allowed}), got {_what(value)}")
    return value


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
