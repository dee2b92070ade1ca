"""Per-layer pruning sensitivity, and per-layer sparsity levels chosen from it.

:func:`sensitivity` prunes each selected layer alone at each level, measures the user's metric
and puts the layer back bit for bit. :func:`allocate` turns the table into per-layer levels
that reach an overall target sparsity with the smallest *predicted* loss, where the prediction
is the sum over layers of each layer's measured metric degradation (layers assumed to add up
independently), linearly interpolated between measured levels.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from sparsekit.progress import progress
from sparsekit.checks import check_module
from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.nn.calibration import CalibrationFn
from sparsekit.prune.patterns import parse_pattern
from sparsekit.prune.pruner import prune_
from sparsekit.reporting import Report, markdown_table
from sparsekit.nn.select import select_modules

DEFAULT_LEVELS = (0.25, 0.5, 0.75, 0.9)


@dataclass
class SensitivityTable(Report):
    """The metric after pruning one layer alone, per layer and level.

    ``levels``: sparsity levels (fraction of the layer's weights zeroed), ascending.
    ``metrics[layer][i]``: the metric with only ``layer`` pruned to ``levels[i]``.
    ``baseline``: the metric of the unpruned model. ``params[layer]``: weight elements.
    ``higher_is_better``: the metric's direction (False for loss or perplexity).
    ``skipped[layer]``: why a selected layer could not be pruned (it has no metrics).
    """

    tag: ClassVar[str] = "sensitivity"

    levels: list[float]
    baseline: float
    metrics: dict[str, list[float]]
    params: dict[str, int]
    pattern: str = "unstructured"
    criterion: str = "magnitude"
    higher_is_better: bool = False
    skipped: dict[str, str] = field(default_factory=dict)

    def degradation(self, layer: str) -> list[float]:
        """How much worse than the baseline the metric got at each level (positive = worse)."""
        sign = -1.0 if self.higher_is_better else 1.0
        return [sign * (m - self.baseline) for m in self.metrics[layer]]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable); :meth:`from_dict` reads it back."""
        return {
            "levels": list(self.levels),
            "baseline": self.baseline,
            "metrics": {k: list(v) for k, v in self.metrics.items()},
            "params": dict(self.params),
            "pattern": self.pattern,
            "criterion": self.criterion,
            "higher_is_better": self.higher_is_better,
            "skipped": dict(self.skipped),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SensitivityTable:
        return cls(**data)

    def to_markdown(self) -> str:
        header = ["layer", "params", "0%", *(f"{lv:.0%}" for lv in self.levels)]
        rows = [[n, self.params[n], f"{self.baseline:.4g}", *(f"{v:.4g}" for v in values)]
                for n, values in self.metrics.items()]
        rows += [[n, "", f"skipped: {why}"] + [""] * len(self.levels)
                 for n, why in self.skipped.items()]
        return markdown_table(header, rows)

    def log(self, writer: Any, step: int = 0) -> None:
        """One chart per layer, ``sensitivity/<layer>``: the metric at step = sparsity in percent
        (rounded to an integer; step 0 is the unpruned baseline), and the table as text
        ``sensitivity/report`` at ``step``."""
        self._log(writer, step, self.tag)

    def _log(self, writer: Any, step: int, tag: str) -> None:
        for name, values in self.metrics.items():
            writer.add_scalar(f"{tag}/{name}", self.baseline, 0)
            for level, value in zip(self.levels, values):
                writer.add_scalar(f"{tag}/{name}", value, round(level * 100))
        writer.add_text(f"{tag}/report", self.to_markdown(), step)

    def __str__(self) -> str:
        width = max([len("layer"), *(len(n) for n in self.metrics)])
        head = f"{'layer':<{width}}  {'params':>10}  {'0%':>10}" + "".join(
            f"  {f'{lv:.0%}':>10}" for lv in self.levels
        )
        lines = [head]
        for name, values in self.metrics.items():
            lines.append(
                f"{name:<{width}}  {self.params[name]:>10}  {self.baseline:>10.4g}"
                + "".join(f"  {v:>10.4g}" for v in values)
            )
        lines += [f"{name:<{width}}  skipped: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def _snapshot(module: nn.Module) -> list[tuple[str, bool, torch.Tensor, torch.Tensor]]:
    """(name, is_parameter, the tensor object, a copy of its data) of the module's own tensors."""
    out = [(n, True, p, p.detach().clone()) for n, p in module.named_parameters(recurse=False)]
    out += [(n, False, b, b.detach().clone()) for n, b in module.named_buffers(recurse=False)]
    return out


@torch.no_grad()
def _restore(module: nn.Module, snapshot: list[tuple[str, bool, torch.Tensor, torch.Tensor]]):
    """Put back the very tensor objects (so optimizers holding them stay valid) and their bits."""
    for name, is_param, tensor, data in snapshot:
        store = module._parameters if is_param else module._buffers
        if store.get(name) is not tensor:
            store[name] = tensor
        tensor.copy_(data)


def _levels(pattern: str, nm: tuple[int, int] | None,
            sparsities: Sequence[float] | None) -> list[float]:
    """The levels to measure: ``1 - N/M`` for an N:M pattern (which takes no ``sparsities``),
    else the distinct ``sparsities`` in (0, 1), sorted (default: 25/50/75/90%)."""
    if nm is not None:
        if sparsities is not None:
            raise UsageError(
                f"pattern {pattern!r} implies the level {1 - nm[0] / nm[1]:g}; "
                "leave sparsities=None"
            )
        return [1 - nm[0] / nm[1]]
    given = DEFAULT_LEVELS if sparsities is None else sparsities
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable) or any(
        isinstance(s, bool) or not isinstance(s, numbers.Real) for s in given
    ):
        raise ConfigTypeError(
            f"sparsities must be a list of numbers in (0, 1) such as [0.5, 0.9], got {given!r}"
        )
    levels = sorted(float(s) for s in given)
    if not levels or any(not 0 < s < 1 for s in levels) or len(set(levels)) != len(levels):
        raise UsageError(
            f"sparsities must be distinct levels in (0, 1), got {list(sparsities or [])}"
        )
    return levels


def sensitivity(
    model: nn.Module,
    evaluate: Callable[[nn.Module], float],
    *,
    sparsities: Sequence[float] | None = None,
    pattern: str = "unstructured",
    criterion: str = "magnitude",
    include: str | Sequence[str] | None = ("*",),
    exclude: str | Sequence[str] | None = (),
    calibration: Iterable[Any] | None = None,
    calibration_fn: CalibrationFn | None = None,
    higher_is_better: bool = False,
    criterion_options: Mapping[str, Any] | None = None,
) -> SensitivityTable:
    """Prune each selected layer alone at each level (one shot, through :func:`prune_`), record
    ``evaluate(model)``, and restore the layer's parameters and buffers exactly (bitwise, same
    tensor objects) before the next measurement, also when ``evaluate`` raises.

    ``sparsities`` defaults to 25/50/75/90% for ``"unstructured"``; an N:M pattern has the one
    level ``1 - N/M`` and takes no ``sparsities``. ``calibration`` is needed by the wanda and
    sparsegpt criteria (it should be re-iterable: each measurement reads it). Layers that cannot
    take the pattern are listed in ``table.skipped``. Costs ``layers * levels + 1`` evaluations.
    ``criterion_options``: as for :func:`~sparsekit.prune_`.

    >>> torch.manual_seed(0) and None
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    >>> x = torch.randn(32, 4)
    >>> target = net(x).detach()
    >>> mse = lambda m: float(((m(x) - target) ** 2).mean().detach())
    >>> table = sensitivity(net, mse, sparsities=[0.5, 0.9])
    >>> table.levels, table.baseline, list(table.metrics)
    ([0.5, 0.9], 0.0, ['0', '2'])
    >>> all(v > 0 for v in table.metrics["2"])
    True
    """
    nm = parse_pattern(pattern)
    levels = _levels(pattern, nm, sparsities)
    if calibration is not None and iter(calibration) is calibration:
        calibration = list(calibration)  # an iterator would be used up by the first layer
    check_module(model, where="sk.sensitivity: ")
    was_training = model.training
    layers = select_modules(model, include, exclude)
    baseline = float(evaluate(model))
    table = SensitivityTable(levels, baseline, {}, {}, pattern, criterion, higher_is_better)
    options = {"pattern": pattern, "criterion": criterion, "calibration": calibration,
               "calibration_fn": calibration_fn, "criterion_options": criterion_options}
    for name, module in progress(layers.items(), desc="sensitivity: layers", total=len(layers)):
        try:
            values = _measure_layer(model, evaluate, name, module, levels, nm, options, table)
        finally:
            model.train(was_training)
        if name not in table.skipped:
            table.metrics[name] = values
            table.params[name] = module.weight.numel()
    return table


def _measure_layer(model: nn.Module, evaluate: Callable[[nn.Module], float], name: str,
                   module: nn.Module, levels: list[float], nm: tuple[int, int] | None,
                   options: dict[str, Any], table: SensitivityTable) -> list[float]:
    """``evaluate(model)`` with layer ``name`` alone pruned (:func:`prune_` with ``options``)
    at each level, the layer restored after each and at the end (also when ``evaluate``
    raises); a layer that cannot take the pattern is recorded in ``table.skipped``."""
    snapshot = _snapshot(module)
    values: list[float] = []
    try:
        for level in levels:
            report = prune_(model, sparsity=None if nm is not None else level,
                            include=["re:" + re.escape(name)], **options)
            skipped = report.layers[name].skipped
            if skipped:
                table.skipped[name] = skipped
                break
            values.append(float(evaluate(model)))
            _restore(module, snapshot)
    finally:
        _restore(module, snapshot)
    return values


def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Lower convex hull of (x, y) points sorted by x (monotone chain)."""
    hull: list[tuple[float, float]] = []
    for p in points:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def allocate(
    table: SensitivityTable, target: float | None = None, *, max_level: float | None = None,
    dense_layers: int | None = None, dense_params: float | None = None,
) -> dict[str, float] | dict[str, str]:
    """Per-layer sparsity levels whose parameter-weighted mean is ``target`` (over the table's
    layers), chosen to minimise the predicted loss ``sum_l d_l(s_l)``, where ``d_l`` is layer
    ``l``'s measured degradation (:meth:`SensitivityTable.degradation`, 0 at level 0),
    linearly interpolated between the measured levels; no layer goes above the highest measured
    level (or ``max_level``).

    Method: greedy over the lower convex hull of every layer's (pruned weights, degradation)
    points, taking the cheapest degradation per pruned weight first; this is optimal for the
    convexified prediction. The last step taken is cut short, with its level interpolated, so
    that the target is met exactly (up to float round-off): at most one layer ends between two
    measured levels. The result is a ``{layer: level}`` mapping for ``Pruner(sparsity=...)``;
    the Pruner rounds each layer's count to whole weights (at most half a weight per layer).

    >>> metrics = {"a": [1.0, 1.1], "b": [3.0, 9.0]}  # b is the sensitive layer
    >>> t = SensitivityTable([0.5, 0.9], 1.0, metrics, {"a": 100, "b": 100})
    >>> allocate(t, 0.5)
    {'a': 0.9, 'b': 0.1}

    An N:M table (one level per layer) gives a per-layer *pattern* instead, for
    ``prune_(pattern=...)``: every layer takes the table's pattern except the most sensitive,
    kept ``"dense"`` (see :func:`allocate_dense`); give ``dense_layers`` or ``dense_params``
    instead of ``target``.

    >>> t24 = SensitivityTable([0.5], 1.0, {"a": [1.1], "b": [3.0]}, {"a": 100, "b": 100},
    ...                        pattern="2:4")
    >>> allocate(t24, dense_layers=1)
    {'a': '2:4', 'b': 'dense'}
    """
    if not isinstance(table, SensitivityTable):
        raise ConfigTypeError(f"allocate: table must be the SensitivityTable sk.sensitivity "
                              f"returns, got {type(table).__name__} {table!r:.60}")
    if table.pattern != "unstructured" or dense_layers is not None or dense_params is not None:
        if target is not None or max_level is not None:
            raise UsageError("an N:M sensitivity table takes dense_layers= or dense_params=, "
                             "not target= or max_level= (those are for unstructured levels)")
        return allocate_dense(table, dense_layers=dense_layers, dense_params=dense_params)
    top = _check_allocate(table, target, max_level)
    total = sum(table.params.values())
    need = target * total  # weights to prune
    steps = _hull_steps(table, top)
    reachable = sum(w for *_, w in steps)
    if need > reachable * (1 + 1e-12):
        raise UsageError(
            f"target {target} is above the reachable {reachable / total:.4g} (every layer at its "
            f"highest level, {top}): measure higher sparsities or lower the target"
        )
    levels = dict.fromkeys(table.metrics, 0.0)
    # slopes within a layer's hull increase, so a stable sort keeps each layer's steps in order
    for _slope, name, l0, l1, weights in sorted(steps, key=lambda s: s[0]):
        if need <= 0:
            break
        take = min(1.0, need / weights)
        levels[name] = l0 + take * (l1 - l0)
        need -= take * weights
    return {name: round(level, 12) for name, level in levels.items()}


def _check_allocate(table: SensitivityTable, target: float | None,
                    max_level: float | None) -> float:
    """The highest level :func:`allocate` may give a layer (``max_level``, or the table's
    highest), after checking ``target`` and ``max_level`` (UsageError naming the one at
    fault)."""
    if target is None:
        raise UsageError("allocate needs target= (an overall sparsity) for an unstructured table")
    if not table.metrics:
        raise UsageError("the sensitivity table has no measured layer")
    if not 0 <= target < 1:
        raise UsageError(f"target must be an overall sparsity in [0, 1), got {target}")
    top = max(table.levels) if max_level is None else max_level
    if not 0 < top < 1:
        raise UsageError(f"max_level must be in (0, 1), got {max_level}")
    return top


def _hull_steps(table: SensitivityTable, top: float) -> list[tuple]:
    """The segments of every layer's lower convex hull of (level, degradation) points up to
    level ``top``, as ``(cost per pruned weight, layer, level from, level to, weights)``."""
    steps = []
    for name, degr in ((n, table.degradation(n)) for n in table.metrics):
        pts = [(0.0, 0.0)] + [(lv, d) for lv, d in zip(table.levels, degr) if lv <= top + 1e-12]
        if any(math.isnan(d) for _, d in pts):
            raise UsageError(f"layer {name!r} has a NaN metric in the sensitivity table")
        hull = _lower_hull(pts)
        p = table.params[name]
        for (l0, d0), (l1, d1) in zip(hull, hull[1:]):
            steps.append(((d1 - d0) / ((l1 - l0) * p), name, l0, l1, (l1 - l0) * p))
    return steps


def allocate_dense(
    table: SensitivityTable, *, dense_layers: int | None = None,
    dense_params: float | None = None,
) -> dict[str, str]:
    """Per-layer patterns from an N:M sensitivity table: the table's pattern everywhere except
    the layers kept ``"dense"``, the most sensitive first. Give exactly one target:

    - ``dense_layers=N``: exactly the ``N`` layers of largest degradation (ties: model order);
    - ``dense_params=f``: a fraction in [0, 1) of the table's weights that may stay dense; the
      layers are ranked by degradation per weight and taken in that order while they fit, so
      the dense weights never exceed ``f`` of the total and no layer left out would still fit
      (a layer whose pruning cost nothing, degradation <= 0, is never kept dense).

    Layers the table skipped are not in the result (they stay as they are).

    >>> t = SensitivityTable([0.5], 1.0, {"a": [1.1], "b": [3.0], "c": [2.0]},
    ...                      {"a": 100, "b": 300, "c": 100}, pattern="2:4")
    >>> allocate_dense(t, dense_params=0.25)
    {'a': '2:4', 'b': '2:4', 'c': 'dense'}
    """
    if table.pattern == "unstructured":
        raise UsageError("dense_layers=/dense_params= need an N:M sensitivity table (measured "
                         "with pattern='2:4', say); for unstructured levels use target=")
    if (dense_layers is None) == (dense_params is None):
        raise UsageError("allocate: give exactly one of dense_layers= (a number of layers) or "
                         "dense_params= (a fraction of the weights kept dense)")
    names = list(table.metrics)
    if not names:
        raise UsageError("the sensitivity table has no measured layer")
    degr = {n: table.degradation(n)[0] for n in names}
    if any(math.isnan(d) for d in degr.values()):
        raise UsageError(f"layer {next(n for n in names if math.isnan(degr[n]))!r} has a NaN "
                         "metric in the sensitivity table")
    dense: list[str] = []
    if dense_layers is not None:
        if isinstance(dense_layers, bool) or not isinstance(dense_layers, int) or not (
                0 <= dense_layers <= len(names)):
            raise UsageError(f"dense_layers={dense_layers!r} must be an integer in "
                             f"[0, {len(names)}] (the table's layers)")
        dense = sorted(names, key=lambda n: -degr[n])[:dense_layers]  # stable: model order
    else:
        if isinstance(dense_params, bool) or not isinstance(dense_params, (int, float)) or not (
                0 <= dense_params < 1):
            raise UsageError(f"dense_params={dense_params!r} must be a fraction in [0, 1) of "
                             "the weights")
        budget = dense_params * sum(table.params[n] for n in names)
        used = 0
        for name in sorted(names, key=lambda n: -degr[n] / table.params[n]):
            if degr[name] > 0 and used + table.params[name] <= budget:
                dense.append(name)
                used += table.params[name]
    return {n: "dense" if n in dense else table.pattern for n in names}
