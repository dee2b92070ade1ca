"""What a quantization pass did to each layer: quantized, prepared for QAT, skipped (with the
reason) or excluded by the include/exclude patterns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from sparsekit.reporting import Report, markdown_table

@dataclass
class QuantLayer:
    """One layer's outcome. ``rel_error`` is the relative L2 error of the quantized layer's
    output against the float layer's on the calibration batches (None without calibration)."""

    name: str
    kind: str
    status: str  # "quantized" | "qat" | "skipped" | "excluded"
    reason: str = ""
    rel_error: float | None = None


@dataclass
class QuantReport(Report):
    """Per-layer outcome of ``quantize_``, ``prepare_qat_`` or ``convert_``; ``str()`` is a
    table, ``to_dict()`` plain data, ``log(writer, step)`` the counts and per-layer errors
    (see :mod:`sparsekit.reporting`)."""

    tag: ClassVar[str] = "quant"

    scheme: str
    layers: list[QuantLayer] = field(default_factory=list)

    @property
    def quantized(self) -> list[str]:
        """Names of the layers quantized (or prepared for QAT)."""
        return [ly.name for ly in self.layers if ly.status in ("quantized", "qat")]

    @property
    def skipped(self) -> dict[str, str]:
        """Layer name -> why the scheme could not take it."""
        return {ly.name: ly.reason for ly in self.layers if ly.status == "skipped"}

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "layers": [asdict(ly) for ly in self.layers]}

    def set_errors(self, errors: dict[str, float]) -> None:
        """Each layer's ``rel_error`` from ``errors`` (layer name -> relative output error;
        None for a layer it does not name)."""
        for ly in self.layers:
            ly.rel_error = errors.get(ly.name)

    def scalars(self) -> dict[str, float]:
        """``quant/quantized`` and ``quant/skipped`` (layer counts) and
        ``quant/rel_error/<layer>`` where it was measured."""
        out = {"quant/quantized": float(len(self.quantized)),
               "quant/skipped": float(len(self.skipped))}
        out.update({f"quant/rel_error/{ly.name}": ly.rel_error for ly in self.layers
                    if ly.rel_error is not None})
        return out

    def to_markdown(self) -> str:
        rows = [[ly.name, ly.kind, ly.status,
                 "" if ly.rel_error is None else f"{ly.rel_error:.2e}", ly.reason]
                for ly in self.layers]
        return f"quantization: {self.scheme}\n\n" + markdown_table(
            ["layer", "type", "status", "rel_error", "reason"], rows)

    def __str__(self) -> str:
        rows = [("layer", "type", "status", "rel_error", "reason")]
        for ly in self.layers:
            err = "" if ly.rel_error is None else f"{ly.rel_error:.2e}"
            rows.append((ly.name, ly.kind, ly.status, err, ly.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"quantization: {self.scheme}"]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
        return "\n".join(line.rstrip() for line in lines)
