"""The kernel registry: every kernel the accelerated layers run, with what it supports.

One folder per family: ``dense`` (cuBLAS: bf16, fp8 and int8 dense, fp8 weights widened),
``cusparselt`` (large-M 2:4 for bf16, fp8 and int8), ``triton24`` (sparsekit's 2:4 format and
its small-M Triton kernel), ``mma_sp`` (the small-M 2:4 CUDA library on the sparse tensor
cores: bf16, fp8 and int4 weights), ``int4`` (the W4A16 Triton kernels, dense and 2:4) and
``attention`` (decode attention over a static KV cache). A folder holds the source, the weight
format, the custom ops (``op.py``: a CUDA implementation, a plain-torch CPU reference and a
fake each) and, in its ``__init__``, the registration: one :class:`Format` per way it stores
a weight and one :class:`Kernel` per way it multiplies.

A :class:`Kernel` declares the layers it serves (``kind``, ``precisions``, ``sparse``), the
token counts it is meant for (``tokens``), a ``check`` of one layer (shape, device, the
library built: None or why not), the :class:`Format` it reads, its ``run`` (the product of one
call, in the layer's numerics), the configurations the planner may time (``configs``) and its
ops. A :class:`Format` declares how it packs a layer's weight, how it unpacks one (to move a
layer to another format, exactly) and its bytes per weight.

Layers and the planner go through :func:`kernels` and :func:`get`: the kernels for a layer
in registration order (families in :data:`FAMILIES` order, then each family's order) and
never name one. A new kernel is one folder here plus its name in :data:`FAMILIES` (or a
:func:`register` call, as the tests do with a toy kernel).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

M_MULTIPLE = 16  # rows the 8-bit and 2:4 CUDA GEMMs take as they are; fewer are padded
UNBOUNDED = 1 << 30  # a token range's top when the kernel takes any M
# the families, in the order their kernels are offered (the first a layer takes is its default)
FAMILIES = ("dense", "cusparselt", "mma_sp", "triton24", "int4", "attention")


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` (M, K) with zero rows appended up to a multiple of ``multiple`` (at least one)."""
    m = x.shape[0]
    if m % multiple == 0 and m > 0:
        return x
    out = torch.zeros((max(multiple, -(-m // multiple) * multiple), x.shape[1]), dtype=x.dtype,
                      device=x.device)
    out[:m] = x
    return out


def _never(layer: Any) -> None:
    return None


@dataclass(frozen=True)
class Format:
    """One way a layer keeps its weight. ``pack(layer, weight)``: the tensors (name -> tensor)
    of ``weight`` (N, K) in the layer's values dtype (bf16, fp8 e4m3, int8; an int4 layer's
    int8 values in [-8, 7]); ``unpack(tensors)``: that weight back, exactly (None: the format
    cannot give it back, e.g. cuSPARSELt's opaque buffer); ``bytes_per_weight(dtype)``: its
    bytes per dense weight for a weight of ``dtype`` (the report's bytes per layer)."""

    name: str
    pack: Callable[[Any, torch.Tensor], dict[str, torch.Tensor]]
    bytes_per_weight: Callable[[torch.dtype], float]
    unpack: Callable[[dict[str, torch.Tensor]], torch.Tensor | None] = lambda t: None


@dataclass(frozen=True)
class Kernel:
    """One kernel a layer may run for some token counts M.

    - ``kind``: the layers it serves ("linear"; "attention" for the decode attention);
    - ``precisions``: the layer precisions whose numerics it computes ("bf16", "fp8" (W8A8),
      "fp8w" (fp8 weight-only), "int8", "int4");
    - ``sparse``: True for 2:4 weights, False for dense ones, None for either;
    - ``tokens``: (lo, hi), the M it is meant for (``hi`` :data:`UNBOUNDED`: any);
    - ``check(layer)``: None when it runs this layer here, else why not (shape, device,
      library); ``prefer(layer)``: whether a layer takes it untimed over the kernels after it
      (False: only the planner may choose it, by timing both);
    - ``format``: the :class:`Format` it reads;
    - ``run(layer, x2d, weights, config)``: y (M, N) bf16 for x2d (M, K), ``weights`` the
      tensors of its format (an ``nn.Module`` holding them as buffers), ``config`` one of
      ``configs`` (or None: the kernel's default);
    - ``configs(layer, weights)``: the configurations the planner times (empty: none to
      choose), ``config_text(config)`` their text in the report;
    - ``ops``: its custom ops (``sparsekit::<op>``), each with a CPU reference and a fake.
    """

    name: str
    family: str
    kind: str
    precisions: tuple[str, ...]
    sparse: bool | None
    tokens: tuple[int, int]
    format: Format | None
    run: Callable[..., torch.Tensor]
    check: Callable[[Any], str | None] = _never
    prefer: Callable[[Any], bool] = lambda layer: True
    configs: Callable[[Any, Any], list] = lambda layer, weights: []
    config_text: Callable[[Any], str] = str
    ops: tuple[str, ...] = field(default=())

    def serves(self, layer: Any, kind: str = "linear") -> bool:
        """Whether this kernel is declared for ``layer``'s kind, precision and pattern (its
        ``check`` not asked)."""
        return (self.kind == kind and layer.precision in self.precisions
                and self.sparse in (None, layer.sparse))

    def covers(self, lo: int, hi: int) -> bool:
        """Whether token counts ``lo``..``hi`` are inside this kernel's range."""
        return self.tokens[0] <= lo and hi <= self.tokens[1]


_REGISTRY: dict[str, Kernel] = {}
_FORMATS: dict[str, Format] = {}
_loaded: list[bool] = []


def register(kernel: Kernel) -> Kernel:
    """Add ``kernel`` (and its format) to the registry; ValueError on a name taken by another
    kernel or format. Returns it (usable as a module-level statement)."""
    old = _REGISTRY.get(kernel.name)
    if old is not None and old is not kernel:
        raise ValueError(f"kernel {kernel.name!r} is registered already (family {old.family})")
    if kernel.format is not None:
        fmt = _FORMATS.get(kernel.format.name)
        if fmt is not None and fmt is not kernel.format:
            raise ValueError(f"format {kernel.format.name!r} is registered already")
        _FORMATS[kernel.format.name] = kernel.format
    _REGISTRY[kernel.name] = kernel
    return kernel


def unregister(name: str) -> None:
    """Remove kernel ``name`` (and its format when no other kernel reads it)."""
    kernel = _REGISTRY.pop(name)
    if kernel.format is not None and all(k.format is not kernel.format
                                         for k in _REGISTRY.values()):
        _FORMATS.pop(kernel.format.name, None)


def _load() -> None:
    if not _loaded:
        _loaded.append(True)
        for family in FAMILIES:
            importlib.import_module(f"{__name__}.{family}")


def get(name: str) -> Kernel:
    """The registered kernel ``name``; ValueError naming the registered ones."""
    _load()
    if name not in _REGISTRY:
        raise ValueError(f"no kernel {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def get_format(name: str) -> Format:
    """The registered format ``name``; ValueError naming the registered ones."""
    _load()
    if name not in _FORMATS:
        raise ValueError(f"no weight format {name!r}; registered: {sorted(_FORMATS)}")
    return _FORMATS[name]


def kernels(layer: Any = None, lo: int = 1, hi: int = UNBOUNDED, kind: str = "linear",
            usable: bool = True) -> list[Kernel]:
    """The registered kernels, in order; with ``layer``, those declared for it whose token
    range covers ``lo``..``hi`` and (``usable``) whose ``check`` passes."""
    _load()
    out = list(_REGISTRY.values())
    if layer is None:
        return out
    return [k for k in out if k.serves(layer, kind) and k.covers(lo, hi)
            and (not usable or k.check(layer) is None)]


def choices(layer: Any, lo: int, hi: int) -> list[Kernel]:
    """The kernels a layer may run for ``lo``..``hi`` tokens (:func:`kernels`), up to and
    including the first one it prefers: the first is what it runs untimed when it prefers
    it, the others are alternatives the planner times (an empty list: none)."""
    out = []
    for k in kernels(layer, lo, hi):
        out.append(k)
        if k.prefer(layer):
            break
    return out


def default(layer: Any, lo: int, hi: int) -> Kernel | None:
    """The kernel ``layer`` runs for ``lo``..``hi`` tokens untimed: the first it prefers
    among :func:`choices` (None: none)."""
    preferred = [k for k in choices(layer, lo, hi) if k.prefer(layer)]
    return preferred[0] if preferred else None
