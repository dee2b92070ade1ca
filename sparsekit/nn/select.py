"""Layer selection by qualified module name: fnmatch globs or ``re:<regex>``."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from sparsekit.checks import check_module
from sparsekit.errors import ConfigTypeError, NumericsError, UsageError

PRUNABLE_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def as_patterns(patterns: str | Iterable[str] | None) -> list[str]:
    if patterns is None:
        return []
    if isinstance(patterns, str):
        return [patterns]
    try:
        out = list(patterns)
    except TypeError:
        out = [patterns]
    bad = [p for p in out if not isinstance(p, str)]
    if bad:
        raise ConfigTypeError(
            f"layer patterns must be strings (fnmatch globs or 're:<regex>'), got {bad[0]!r}"
        )
    return out


def include_patterns(include: str | Iterable[str] | None, option: str = "include") -> list[str]:
    """``include`` as a list of patterns: None selects every layer (``["*"]``); an empty list
    selects none, which is refused (UsageError naming ``option``) rather than read as "all"."""
    if include is None:
        return ["*"]
    patterns = as_patterns(include)
    if not patterns:
        raise UsageError(f"{option}={include!r} selects no layer: pass {option}=['*'] (or None) "
                         "for every layer, or name the layers to select")
    return patterns


def _regex(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern[3:])
    except re.error as e:
        raise UsageError(
            f"{pattern!r} is not a valid regular expression ({e}); write 're:<python regex>' "
            "or an fnmatch glob such as 'layers.*.fc1'"
        ) from None


def name_matches(name: str, pattern: str) -> bool:
    """True when qualified module ``name`` matches ``pattern`` (a glob, or ``re:<regex>``
    matched against the whole name)."""
    if pattern.startswith("re:"):
        return _regex(pattern).fullmatch(name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def name_filter(
    names: Iterable[str],
    include: str | Sequence[str] | None = ("*",),
    exclude: str | Sequence[str] | None = (),
) -> Callable[[str], bool]:
    """``keep(name)``: True when ``name`` matches an include pattern and no exclude pattern.
    Raises UsageError when a pattern (other than ``"*"``) matches none of ``names``, the
    qualified names it may select from (a typo should not silently select nothing)."""
    include_l = include_patterns(include)
    exclude_l = as_patterns(exclude)
    names = list(names)
    for kind, pats in (("include", include_l), ("exclude", exclude_l)):
        for p in pats:
            if p != "*" and not any(name_matches(n, p) for n in names):
                shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
                raise UsageError(f"{kind} pattern {p!r} matches no selectable layer; layers "
                                 f"are: {shown}")

    def keep(name: str) -> bool:
        return any(name_matches(name, p) for p in include_l) and not any(
            name_matches(name, p) for p in exclude_l)

    return keep


def select_modules(
    model: nn.Module,
    include: str | Sequence[str] | None = ("*",),
    exclude: str | Sequence[str] | None = (),
    types: tuple[type[nn.Module], ...] = PRUNABLE_TYPES,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> dict[str, nn.Module]:
    """Modules of ``types`` whose qualified name matches an include pattern and no exclude
    pattern, in model order. Raises ValueError when an include or exclude pattern matches no
    module of those types (a typo should not silently prune nothing); ConfigTypeError when
    ``model`` is not a module."""
    check_module(model)
    candidates = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, types) and (filter_fn is None or filter_fn(m, name))
    }
    keep = name_filter(candidates, include, exclude)
    chosen = {n: m for n, m in candidates.items() if keep(n)}
    if not chosen:
        raise UsageError(
            f"include={include_patterns(include)} exclude={as_patterns(exclude)} select no "
            "layer of types "
            f"{[t.__name__ for t in types]}"
        )
    return chosen


def check_finite_weight(name: str, weight: torch.Tensor, action: str = "pruning") -> None:
    """NumericsError naming layer ``name`` when its weight holds NaN or inf (no score can rank
    such weights, and a mask picked from them would be arbitrary; no scale quantizes them);
    ``action`` ("pruning", "quantizing") goes into the message."""
    w = weight.detach()
    if w.is_floating_point() and not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise NumericsError(
            f"layer {name!r} has {bad} non-finite (NaN or inf) weight(s) of {w.numel()}: fix or "
            f"exclude the layer before {action} it"
        )


