"""The protocol every sparsekit report follows (:class:`~sparsekit.SparsityReport`,
:class:`~sparsekit.ChannelReport`, :class:`~sparsekit.QuantReport`,
:class:`~sparsekit.SensitivityTable`, :class:`~sparsekit.AccelReport`):

- ``to_dict()``: plain, JSON-serialisable data;
- ``to_markdown()``: a Markdown table (TensorBoard's text tab, docs, issues);
- ``log(writer, step=0)``: the report's numbers as scalars (``scalars()``, keys under the
  report's ``tag``) and its Markdown as text ``<tag>/report``, on a TensorBoard
  ``SummaryWriter`` (or anything with ``add_scalar`` and ``add_text``).

``str(report)`` stays a plain-text table for the terminal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table; ``|`` inside cells is escaped.

    >>> print(markdown_table(["layer", "zeros"], [["fc", 3]]))
    | layer | zeros |
    | --- | --- |
    | fc | 3 |
    """

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *map(line, rows)])


class Report:
    """Base of the five report types: subclasses define ``tag``, :meth:`to_dict`,
    :meth:`to_markdown` and, where they have numbers worth a chart, :meth:`scalars`."""

    tag: ClassVar[str] = "report"

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_markdown(self) -> str:
        raise NotImplementedError

    def scalars(self) -> dict[str, float]:
        """Flat ``{"<tag>/<name>": number}`` for a metrics logger; finite values only."""
        return {}

    def log(self, writer: Any, step: int = 0) -> None:
        """Write :meth:`scalars` (non-finite values left out) and :meth:`to_markdown` (as text
        ``<tag>/report``) to ``writer`` at ``step``."""
        for key, value in self.scalars().items():
            if value is not None and math.isfinite(value):
                writer.add_scalar(key, value, step)
        writer.add_text(f"{self.tag}/report", self.to_markdown(), step)
