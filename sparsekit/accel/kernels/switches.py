"""The kernel choices of :class:`~sparsekit.accel.options.PlanOptions` that the kernels read.

``accelerate`` (while it plans and builds the layers) and an accelerated model's ``generate``
(while it runs) make their plan's choices current with :func:`using`; the kernel modules read
them with :func:`current` (outside both, the defaults). They replace the environment variables
that chose GPU paths before: ``SPARSEKIT_SK24_MMA`` (``mma_sp``), ``SPARSEKIT_CSLT_EXT``
(``cslt_epilogue``), ``SPARSEKIT_DECODE_ATTENTION`` (``decode_attention``) and
``SPARSEKIT_LAGGED_STOP`` (``lagged_stop``).

A context variable, not a global: each thread and each nested call sees its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

MMA_SP = ("auto", "all", "off")


@dataclass(frozen=True)
class Switches:
    """``mma_sp``: "auto" (bf16 and int4 2:4 layers decode on the mma.sp library where it
    loads; an fp8 layer where its decode plan timed it faster than the Triton kernel), "all"
    (every fp8 layer too, untimed) or "off" (the Triton kernels only). ``cslt_epilogue``:
    sparsekit's cuSPARSELt binding (scales, bias, GELU in the GEMM). ``decode_attention``:
    generate's decode attention kernel. ``lagged_stop``: generate's stop flag read two steps
    late (False: read after every token)."""

    mma_sp: str = "auto"
    cslt_epilogue: bool = True
    decode_attention: bool = True
    lagged_stop: bool = True


# a frozen dataclass: the shared default cannot change
_CURRENT: ContextVar[Switches] = ContextVar("sparsekit_kernel_switches",
                                            default=Switches())  # noqa: B039


def current() -> Switches:
    """The switches of the ``accelerate`` or ``generate`` call in progress (else defaults)."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(switches: Switches) -> Iterator[Switches]:
    """Make ``switches`` current within the block (restored after, also on error)."""
    token = _CURRENT.set(switches)
    try:
        yield switches
    finally:
        _CURRENT.reset(token)


__all__ = ["MMA_SP", "Switches", "current", "using"]
