"""Sparsity reports: per-layer and global zero counts, pattern validity and skip reasons."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from torch import nn

from sparsekit.errors import UsageError
from sparsekit.io.zeros import mask_from_zeros
from sparsekit.reporting import Report, markdown_table
from sparsekit.prune.patterns import is_nm, nm_incompatibility, parse_pattern
from sparsekit.nn.select import PRUNABLE_TYPES, select_modules

# The layer types the report counts: the prunable ones, and those that higher layers register
# (sparsekit.quant registers its quantized layers, which keep their zeros too).
_REPORTED: list[type[nn.Module]] = list(PRUNABLE_TYPES)
NEAR_EMPTY = 0.99  # a layer with this fraction of zeros or more is flagged in the report


def register_reported_types(*types: type[nn.Module]) -> None:
    """Count layers of ``types`` in :func:`sparsity_report` too."""
    _REPORTED.extend(t for t in types if t not in _REPORTED)


@dataclass
class LayerSparsity:
    """One layer's weight: ``zeros`` of ``numel`` entries; ``pattern`` the N:M pattern it was
    pruned to (or detected), ``nm_ok`` whether every group holds it; ``skipped`` the reason it
    was left dense, or None; ``warning`` what looks wrong (a layer at 99% zeros or more: its
    output is nearly constant; a global threshold's choices the Pruner warned about), or None."""

    numel: int
    zeros: int
    pattern: str | None = None
    nm_ok: bool | None = None
    skipped: str | None = None
    warning: str | None = None

    @property
    def sparsity(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0


@dataclass
class SparsityReport(Report):
    """Per-layer statistics in model order. ``str(report)`` is a table; ``to_dict()`` is plain
    data, ``scalars()`` the ``sparsity/global`` and ``sparsity/<layer>`` numbers, ``log(writer,
    step)`` writes both (see :mod:`sparsekit.reporting`)."""

    tag: ClassVar[str] = "sparsity"

    layers: dict[str, LayerSparsity] = field(default_factory=dict)

    @property
    def zeros(self) -> int:
        return sum(s.zeros for s in self.layers.values())

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.layers.values())

    @property
    def global_sparsity(self) -> float:
        """Zeros over all reported weights (skipped layers included), in [0, 1]."""
        return self.zeros / self.numel if self.numel else 0.0

    @property
    def skipped(self) -> dict[str, str]:
        return {n: s.skipped for n, s in self.layers.items() if s.skipped}

    def to_dict(self) -> dict:
        return {
            "global": {"numel": self.numel, "zeros": self.zeros, "sparsity": self.global_sparsity},
            "layers": {n: {**asdict(s), "sparsity": s.sparsity} for n, s in self.layers.items()},
        }

    def scalars(self) -> dict[str, float]:
        """Flat ``{"sparsity/global": x, "sparsity/<layer>": y}`` for a metrics logger."""
        out = {"sparsity/global": self.global_sparsity}
        out.update({f"sparsity/{n}": s.sparsity for n, s in self.layers.items()})
        return out

    @property
    def warnings(self) -> dict[str, str]:
        """Layer name -> what looks wrong with it (see :class:`LayerSparsity`)."""
        return {n: s.warning for n, s in self.layers.items() if s.warning}

    def _pattern_cell(self, s: LayerSparsity) -> str:
        if s.skipped:
            return f"skipped: {s.skipped}"
        pat = s.pattern or "-"
        if s.nm_ok is not None:
            pat += " ok" if s.nm_ok else " VIOLATED"
        return pat + (f"  WARNING: {s.warning}" if s.warning else "")

    def to_markdown(self) -> str:
        rows = [[n, s.numel, s.zeros, f"{s.sparsity:.2%}", self._pattern_cell(s)]
                for n, s in self.layers.items()]
        rows.append(["global", self.numel, self.zeros, f"{self.global_sparsity:.2%}", ""])
        return markdown_table(["layer", "params", "zeros", "sparsity", "pattern"], rows)

    def __str__(self) -> str:
        width = max([len("layer"), *(len(n) for n in self.layers)])
        lines = [f"{'layer':<{width}}  {'params':>10}  {'zeros':>10}  {'sparsity':>8}  pattern"]
        for name, s in self.layers.items():
            pat = self._pattern_cell(s)
            lines.append(
                f"{name:<{width}}  {s.numel:>10}  {s.zeros:>10}  {s.sparsity:>8.2%}  {pat}"
            )
        lines.append(
            f"{'global':<{width}}  {self.numel:>10}  {self.zeros:>10}  {self.global_sparsity:>8.2%}"
        )
        return "\n".join(lines)


def sparsity_report(
    model: nn.Module,
    *,
    include: str | Sequence[str] | None = ("*",),
    exclude: str | Sequence[str] | None = (),
    pattern: str | None = None,
    skipped: Mapping[str, str] | None = None,
) -> SparsityReport:
    """Count zeros in the weights of the selected layers (default: every Linear and Conv).

    With ``pattern="N:M"`` each layer also says whether it satisfies that pattern; ``skipped``
    maps layer names to the reason they were left dense.

    >>> import torch
    >>> layer = torch.nn.Linear(8, 2)
    >>> with torch.no_grad():
    ...     layer.weight[:, :4] = 0
    >>> sparsity_report(torch.nn.Sequential(layer)).global_sparsity
    0.5
    """
    chosen = select_modules(model, include, exclude, types=tuple(_REPORTED))
    return build_report(chosen, pattern, skipped)


def _zeros(weight) -> int:
    return weight.numel() - int(mask_from_zeros(weight).sum())


def build_report(
    modules: Mapping[str, nn.Module],
    pattern: str | None = None,
    skipped: Mapping[str, str] | None = None,
) -> SparsityReport:
    """The report over exactly these named modules (see :func:`sparsity_report`)."""
    nm = parse_pattern(pattern) if pattern and pattern != "unstructured" else None
    skipped = dict(skipped or {})
    report = SparsityReport()
    for name, module in modules.items():
        w = module.weight
        if w.device.type == "meta":
            raise UsageError(f"sparsity_report: layer {name!r} has its weight on the meta device "
                             "(no values to count): materialize the model first")
        stats = LayerSparsity(numel=w.numel(), zeros=_zeros(w), skipped=skipped.get(name))
        if stats.numel and stats.sparsity >= NEAR_EMPTY:
            stats.warning = f"{stats.sparsity:.1%} zeros: the layer's output is nearly constant"
        if nm is not None and not stats.skipped:
            stats.pattern = pattern
            stats.nm_ok = nm_incompatibility(w.shape, nm[1]) is None and is_nm(w, *nm)
        report.layers[name] = stats
    return report
