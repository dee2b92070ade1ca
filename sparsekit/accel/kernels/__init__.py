"""The kernel registry: every kernel the accelerated layers run, with what it supports.

One folder per family: ``dense`` (cuBLAS: bf16, fp8 and int8 dense, fp8 weights widened),
``cusparselt`` (2:4 for bf16, fp8 and int8 at any M), ``triton24`` (sparsekit's 2:4 format and
its small-M Triton kernel), ``mma_sp`` (the small-M 2:4 CUDA library on the sparse tensor
cores: bf16, fp8 and int4 weights), ``int4`` (the W4A16 Triton kernels, dense and 2:4) and
``attention`` (decode attention over a static KV cache). A folder holds the source, the weight
format, the custom ops (``op.py``: a CUDA implementation, a plain-torch CPU reference and a
fake each) and, in its ``__init__``, the registration: a :class:`Format` per way it keeps a
weight and a :class:`Kernel` per way it multiplies.

Layers and the planner go through :func:`kernels`, :func:`choices` and :func:`get`, and name
no kernel: a layer's plan (:class:`sparsekit.accel.layers.LayerPlan`) holds kernel names as
data. A new kernel is one folder here plus its name in :data:`FAMILIES` (or a :func:`register`
call, as the tests do with a toy kernel): docs/architecture.md walks through one.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

M_MULTIPLE = 16  # rows the 8-bit and 2:4 CUDA GEMMs take as they are; fewer are padded
UNBOUNDED = 1 << 30  # the top of a kernel's token range when it takes any M
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


@dataclass(frozen=True)
class Format:
    """One way a layer keeps its weight.

    - ``pack(layer, source)``: the tensors (name -> tensor; other values become plain
      attributes) of the layer's weight ``source``: (N, K) in the layer's values dtype (bf16,
      fp8 e4m3, int8), or an int4 layer's (values (N, K) int8 in [-8, 7], scales (N, K / g));
    - ``unpack(layer, tensors)``: that source back, exactly, or None where the format cannot
      give it (cuSPARSELt's opaque buffer): a layer moved to another format is re-encoded
      from one that can;
    - ``bytes_per_weight(dtype)``: bytes per dense weight for a weight of ``dtype``.
    """

    name: str
    pack: Callable[[Any, Any], dict[str, Any]]
    bytes_per_weight: Callable[[torch.dtype], float]
    unpack: Callable[[Any, dict[str, Any]], Any] = lambda layer, tensors: None


def _takes(layer: Any, source: Any) -> str | None:
    return None


@dataclass(frozen=True)
class Kernel:
    """One kernel a layer may run for some token counts M.

    - ``kind``: the layers it serves ("linear"; "attention" for decode attention);
    - ``precisions``: the layer precisions whose numerics it computes ("bf16", "fp8" (W8A8),
      "fp8w" (fp8 weight-only), "int8", "int4"); ``sparse``: True for 2:4 weights, False for
      dense ones, None for either;
    - ``tokens``: (lo, hi), the M it is meant for (``hi`` :data:`UNBOUNDED`: any M; a bounded
      kernel is a small-M one, offered for the token counts up to ``hi``);
    - ``check(layer, source)``: None when it runs this layer here, else why not (shape,
      device, library); ``prefer(layer, source)``: whether the layer takes it untimed over
      the kernels after it (False: an alternative the planner may time against the default);
    - ``format``: the :class:`Format` it reads; ``run(layer, x2d, weights, config)``: y (M, N)
      bf16 for x2d (M, K), ``weights`` the format's tensors as attributes of a module,
      ``config`` one configuration per bucket of ``buckets`` (or None: the kernel's default);
    - ``configs(layer, weights)``: the configurations the planner may time (per bucket of
      ``buckets``, token counts; empty: nothing to choose), ``config_text`` for reports;
    - ``ops``: its custom ops (``sparsekit::<op>``, each with a CPU reference and a fake);
      ``note(layers)``: a line for the report about the layers routed to it, or None;
    - ``order``: where it stands among the kernels (lower first: offered before).
    """

    name: str
    family: str
    kind: str
    precisions: tuple[str, ...]
    sparse: bool | None
    tokens: tuple[int, int]
    format: Format | None
    run: Callable[..., torch.Tensor]
    check: Callable[[Any, Any], str | None] = _takes
    prefer: Callable[[Any, Any], bool] = lambda layer, source: True
    configs: Callable[[Any, Any], list] = lambda layer, weights: []
    buckets: tuple[int, ...] = ()
    config_text: Callable[[Any], str] = str
    ops: tuple[str, ...] = field(default=())
    note: Callable[[list], str | None] = lambda layers: None
    order: int = 100

    @property
    def small_m(self) -> bool:
        """Whether it is meant for small token counts only (decode)."""
        return self.tokens[1] < UNBOUNDED

    def serves(self, layer: Any, kind: str = "linear") -> bool:
        """Whether it is declared for ``layer``'s kind, precision and pattern (its ``check``
        not asked)."""
        return (self.kind == kind and layer.precision in self.precisions
                and self.sparse in (None, layer.sparse))


_REGISTRY: dict[str, tuple[int, Kernel]] = {}  # name -> (registration number, kernel)
_count = itertools.count()
_loaded: list[bool] = []


def register(kernel: Kernel) -> Kernel:
    """Add ``kernel`` to the registry (returned, so a module registers with one statement);
    ValueError when its name or its format's name is another kernel's or format's."""
    old = _REGISTRY.get(kernel.name)
    if old is not None and old[1] is not kernel:
        raise ValueError(f"kernel {kernel.name!r} is registered already (family "
                         f"{old[1].family})")
    if kernel.format is not None:
        for _, k in _REGISTRY.values():
            if k.format is not None and k.format.name == kernel.format.name \
                    and k.format is not kernel.format:
                raise ValueError(f"weight format {kernel.format.name!r} is registered already "
                                 f"(kernel {k.name})")
    _REGISTRY[kernel.name] = (next(_count), kernel)
    return kernel


def unregister(name: str) -> None:
    """Remove kernel ``name`` (a test's toy kernel)."""
    _REGISTRY.pop(name)


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
    return _REGISTRY[name][1]


def kernels(layer: Any = None, source: Any = None, *, small_m: bool | None = None,
            kind: str = "linear") -> list[Kernel]:
    """The registered kernels, lowest ``order`` first (then in registration order). With
    ``layer``: those declared for it (``small_m``: only the small-M ones, or only the others)
    whose ``check(layer, source)`` passes."""
    _load()
    out = [k for _, k in sorted(_REGISTRY.values(), key=lambda e: (e[1].order, e[0]))]
    if layer is None:
        return out
    return [k for k in out if k.serves(layer, kind)
            and (small_m is None or k.small_m == small_m) and k.check(layer, source) is None]


def choices(layer: Any, source: Any, small_m: bool) -> list[str]:
    """The kernels ``layer`` may run (small-M ones or the others), as names: up to and
    including the first it prefers, which is last (what it runs untimed); those before it are
    alternatives the planner may time against it. Empty: none it prefers."""
    out = []
    for k in kernels(layer, source, small_m=small_m):
        out.append(k.name)
        if k.prefer(layer, source):
            return out
    return []


def refused(layer: Any, source: Any, small_m: bool) -> dict[str, str]:
    """{kernel: why not} for the kernels declared for ``layer`` whose check fails (for the
    report: e.g. the mma.sp library not built on this machine)."""
    _load()
    return {k.name: why for k in kernels() if k.serves(layer) and k.small_m == small_m
            for why in [k.check(layer, source)] if why is not None}


__all__ = ["FAMILIES", "M_MULTIPLE", "UNBOUNDED", "Format", "Kernel", "choices", "get",
           "kernels", "pad_rows", "refused", "register", "unregister"]
