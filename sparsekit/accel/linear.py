"""The accelerated linear layer: one forward that reads a frozen per-layer plan.

A :class:`LayerPlan` is data: routes, each a range of token counts M (rows of the input) and
the registered kernel (:mod:`sparsekit.accel.kernels`) that runs them, with its configuration.
:class:`AccelLinear` holds its plan and the weight copies (one per format) that the plan's
kernels read, nothing else; its forward takes the first route whose range holds the input's M
(a Python branch on the shape: one compiled graph per shape) and calls that kernel's ``run``.
A layer starts on the plan the registry gives it untimed (:meth:`AccelLinear.start`: its
preferred small-M kernel up to that kernel's range, its preferred kernel for every other M);
the planner may replace it (:meth:`AccelLinear.use`), re-encoding the weight for a format it
does not hold yet from one it holds (exactly) and dropping the copies no route reads.

The numerics (activation quantization, scales, bias) are the subclasses'
(:mod:`sparsekit.accel.layers`, :mod:`sparsekit.accel.layers_int4`); the kernels read them
from the layer: ``precision``, ``sparse``, ``fmt``, ``weight_only``, ``bias``, ``w_scale``,
``quant(x2d)``, ``epilogue(acc, x_scale)``, ``scalar_scale``, ``alg_id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sparsekit.accel import kernels
from sparsekit.accel.kernels import UNBOUNDED


@dataclass(frozen=True)
class Route:
    """Token counts ``lo`` <= M <= ``hi`` run on kernel ``kernel`` with ``config`` (one
    configuration per bucket of the kernel's ``buckets``; None: its default)."""

    lo: int
    hi: int
    kernel: str
    config: tuple | None = None

    def covers(self, m: int) -> bool:
        return self.lo <= m <= self.hi


@dataclass(frozen=True)
class LayerPlan:
    """A layer's routes, taken in order (the first that covers M runs); the last covers every
    M >= 1. Plain data: :meth:`to_json` / :meth:`from_json` for the plan cache."""

    routes: tuple[Route, ...]

    def __post_init__(self) -> None:
        if not self.routes or self.routes[-1].lo > 1 or self.routes[-1].hi < UNBOUNDED:
            raise ValueError(f"a layer plan's last route must cover every token count, got "
                             f"{self.routes}")

    def route(self, m: int) -> Route:
        """The route token count ``m`` takes."""
        return next(r for r in self.routes if r.covers(m))

    def kernels(self) -> tuple[str, ...]:
        """The kernels the plan runs, in route order."""
        return tuple(dict.fromkeys(r.kernel for r in self.routes))

    def segments(self) -> list[tuple[int, int, Route]]:
        """(lo, hi, route): the token counts in order, each run of counts that one route
        takes (what the report shows)."""
        cuts = sorted({1} | {r.lo for r in self.routes} | {r.hi + 1 for r in self.routes
                                                            if r.hi < UNBOUNDED})
        out: list[tuple[int, int, Route]] = []
        for lo, nxt in zip(cuts, cuts[1:] + [UNBOUNDED + 1]):
            route = self.route(lo)
            if out and out[-1][2] == route:
                out[-1] = (out[-1][0], nxt - 1, route)
            else:
                out.append((lo, nxt - 1, route))
        return out

    def text(self) -> str:
        """E.g. ``M 1: mma_sp [8x4x1x1/...]; M 2-32: cublas; M 33+: cusparselt``."""
        parts = []
        for lo, hi, r in self.segments():
            span = f"{lo}+" if hi >= UNBOUNDED else (f"{lo}" if lo == hi else f"{lo}-{hi}")
            cfg = f" [{kernels.get(r.kernel).config_text(r.config)}]" if r.config else ""
            parts.append(f"M {span}: {r.kernel}{cfg}")
        return "; ".join(parts)

    def to_json(self) -> list:
        return [[r.lo, r.hi, r.kernel, None if r.config is None else [list(c) for c in r.config]]
                for r in self.routes]

    @classmethod
    def from_json(cls, data: list) -> LayerPlan:
        return cls(tuple(Route(int(lo), int(hi), str(k), None if c is None else
                               tuple(tuple(x) for x in c)) for lo, hi, k, c in data))


class Weights(nn.Module):
    """One format's copy of a layer's weight: its tensors as buffers, other values (a layout
    name, a dtype) as attributes; ``format`` names the registered format."""

    def __init__(self, fmt: str, packed: dict[str, Any]):
        super().__init__()
        self.format = fmt
        self.fields = tuple(packed)
        for name, value in packed.items():
            if isinstance(value, torch.Tensor):
                self.register_buffer(name, value)
            else:
                setattr(self, name, value)

    def items(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.fields}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return self.format


def _format(kernel: str) -> kernels.Format:
    fmt = kernels.get(kernel).format
    if fmt is None:
        raise ValueError(f"kernel {kernel!r} reads no weight: no linear layer runs it")
    return fmt


class AccelLinear(nn.Module):
    """``x @ W.T + b`` for x (..., K) -> (..., N) in bfloat16 on the kernels of its
    ``plan`` (:class:`LayerPlan`), holding one weight copy per format they read
    (``formats``: format name -> :class:`Weights`). ``choices``: the kernels the registry
    offers it ("small": small-M kernels, "large": the others; the last of each is the one it
    prefers, those before are alternatives the planner may time); ``refused``: the small-M
    kernels declared for it that cannot run it here, with why."""

    variant = ""
    precision = ""
    sparse = False
    fmt = None  # the 8-bit quant Format of weights and activations (None: bf16 or int4)
    weight_only = False
    tune_limit = False  # the planner times up to which M its small-M kernel serves
    uses_alg = False  # its large-M kernel takes a cuSPARSELt algorithm (alg_id)
    # activation scale x weight scale where each is one number (a static per-tensor fp8
    # layer): a kernel may apply it inside its GEMM
    scalar_scale: float | None = None
    bias: torch.Tensor | None
    w_scale: torch.Tensor | None

    def start(self, source: Any, large: str | None = None) -> None:
        """Set ``choices`` and ``refused`` for ``source`` (the weight, see
        :class:`~sparsekit.accel.kernels.Format`) and run the plan the registry gives
        untimed: the preferred small-M kernel up to the top of its range, the preferred
        other kernel (or ``large``, one of the alternatives) for every M."""
        self.formats = nn.ModuleDict()
        self.choices = {"small": tuple(kernels.choices(self, source, True)),
                        "large": tuple(kernels.choices(self, source, False))}
        self.refused = kernels.refused(self, source, True)
        if not self.choices["large"]:
            why = "; ".join(kernels.refused(self, source, False).values()) or "none registered"
            raise ValueError(f"{self.describe()}: no kernel runs it ({why})")
        routes = []
        if self.choices["small"]:
            small = kernels.get(self.choices["small"][-1])
            routes.append(Route(small.tokens[0], small.tokens[1], small.name))
        routes.append(Route(1, UNBOUNDED, large or self.choices["large"][-1]))
        self.use(LayerPlan(tuple(routes)), source)

    def describe(self) -> str:
        return f"{self.variant} layer ({self.shape_text()})"

    def shape_text(self) -> str:
        """``NxK`` (an int4 layer adds its group: ``NxK gG``)."""
        return f"{self.out_features}x{self.in_features}"

    def use(self, plan: LayerPlan, source: Any = None, keep: bool = False) -> None:
        """Run ``plan`` from now on: the formats its kernels read that this layer lacks are
        packed from ``source`` or (None) from a copy it holds (exactly); the copies no route
        reads are dropped unless ``keep`` (the planner's timing moves between plans)."""
        need = {_format(r.kernel).name: _format(r.kernel) for r in plan.routes}
        missing = [f for name, f in need.items() if name not in self.formats]
        if missing:
            src = self.source() if source is None else source
            for fmt in missing:
                self.formats[fmt.name] = Weights(fmt.name, fmt.pack(self, src))
        if not keep:
            for name in [n for n in self.formats if n not in need]:
                del self.formats[name]
        self.plan = plan
        # what forward reads: per route its range, its kernel's run, its format, its config
        self._routes = tuple((r.lo, r.hi, kernels.get(r.kernel).run, _format(r.kernel).name,
                              r.config) for r in plan.routes)

    def source(self) -> Any:
        """The weight as the formats take it, unpacked from a copy this layer holds."""
        for name, weights in self.formats.items():
            got = _format_named(name).unpack(self, weights.items())
            if got is not None:
                return got
        raise ValueError(f"{self.describe()}: none of its weight copies "
                         f"({', '.join(self.formats)}) can be unpacked for another format")

    def weights(self, kernel: str) -> Weights:
        """The copy of the weight that ``kernel`` (one of the plan's) reads."""
        return self.formats[_format(kernel).name]

    def weight_bytes(self) -> int:
        """Bytes of the weight copies this layer holds (all formats together)."""
        return sum(w.nbytes() for w in self.formats.values())

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = self._input(x)
        m = x2d.shape[0]
        for lo, hi, run, fmt, config in self._routes:
            if lo <= m <= hi:
                y = run(self, x2d, self.formats[fmt], config)
                break
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        alg = f", alg_id={self.alg_id}" if self.uses_alg else ""
        return (f"{self.in_features}, {self.out_features}, variant={self.variant}{alg}, "
                f"plan=[{self.plan.text()}]")


def _format_named(name: str) -> kernels.Format:
    return next(k.format for k in kernels.kernels()
                if k.format is not None and k.format.name == name)


__all__ = ["AccelLinear", "LayerPlan", "Route", "Weights"]
