"""sparsekit's own cuSPARSELt binding (``csrc/cslt_epilogue.cpp``), built ahead of time.

torch's ``_cslt_sparse_mm`` takes a scalar alpha only as a one-element CUDA tensor, which it
reads on the host (``.item()``, no CUDA graphs), and has no activation. The binding here puts
``alpha * acc + bias`` and optionally cuSPARSELt's GELU in the 8-bit 2:4 GEMM's epilogue: for an
fp8 layer with a static activation scale and one weight scale per tensor (the
``fp8_static_tensor`` scheme), the whole scale/bias/GELU epilogue runs inside the GEMM instead
of as separate kernels (measured in docs/gpu.md).

It is a torch C++ extension built against the installed torch and the cuSPARSELt it loads (the
``nvidia-cusparselt`` wheel) by ``python -m sparsekit.accel.build`` (:mod:`sparsekit.accel.build`;
about 25 s) into the package, never at run time, and imported only after
:mod:`sparsekit.accel.libload` checked the file (owner, permissions, the sha256 its manifest
records, the torch it was built for, its ``PyInit`` symbol). Where it is not built or fails a
check, :func:`load` returns None and :func:`reason` says why: the layers then run torch's
binding with the epilogue as plain torch ops. ``PlanOptions(cslt_epilogue=False)`` chooses
that too.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

from sparsekit.accel import build, libload
from sparsekit.accel.kernels import switches

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "cslt_epilogue.cpp"
_why: list[str] = []


def spec() -> libload.Spec:
    """What the loader checks the built binding against: built from this source, for this
    torch."""
    return libload.Spec(build.CSLT, build.CSLT_VERSION, build.CSLT_SOURCES, build.CSLT_SYMBOLS,
                        require=(("torch", str(torch.__version__)),
                                 ("torch_cuda", str(torch.version.cuda))))


def enabled() -> bool:
    """False under ``PlanOptions(cslt_epilogue=False)`` (torch's binding and plain-torch
    epilogues only)."""
    return switches.current().cslt_epilogue


@functools.cache
def load() -> ModuleType | None:
    """The built binding (``sparse24_mm_alpha``), or None where there is no CUDA or it is not
    built or fails a check (:func:`reason` says which)."""
    if not torch.cuda.is_available():
        _why.append("no CUDA device")
        return None
    try:
        return libload.load_module(spec(), build.CSLT_MODULE)
    except (OSError, RuntimeError) as e:
        _why.append(str(e)[:300])
        log.warning("sparsekit: own cuSPARSELt binding not used (%s); fp8 2:4 layers apply "
                    "their scales after torch's binding", _why[-1])
        return None


def reason() -> str | None:
    """Why :func:`load` returned None (after it was called), else None."""
    return _why[-1] if _why else None


__all__ = ["SOURCE", "enabled", "load", "reason", "spec"]
