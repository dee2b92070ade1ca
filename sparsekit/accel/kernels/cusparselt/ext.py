"""sparsekit's own cuSPARSELt binding (``csrc/cslt_epilogue.cpp``), built on first use.

torch's ``_cslt_sparse_mm`` takes a scalar alpha only as a one-element CUDA tensor, which it
reads on the host (``.item()``, no CUDA graphs), and has no activation. The binding here puts
``alpha * acc + bias`` and optionally cuSPARSELt's GELU in the 8-bit 2:4 GEMM's epilogue: for an
fp8 layer with a static activation scale and one weight scale per tensor (the
``fp8_static_tensor`` scheme), the whole scale/bias/GELU epilogue runs inside the GEMM instead
of as separate kernels (measured in docs/gpu.md).

It is compiled with ``torch.utils.cpp_extension.load`` against the cuSPARSELt that torch loads
(the ``nvidia-cusparselt`` wheel), once per machine (about 25 s; cached in torch's extension
directory). Where it cannot be built (no CUDA toolkit headers, no compiler, no cuSPARSELt
headers), :func:`load` returns None and :func:`reason` says why: the layers then run torch's
binding with the epilogue as plain torch ops. ``SPARSEKIT_CSLT_EXT=0`` turns it off.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from types import ModuleType

import torch

from sparsekit.accel.kernels import switches

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "cslt_epilogue.cpp"
_why: list[str] = []


def cusparselt_dirs() -> tuple[str, str]:
    """(include dir, lib dir) of the cuSPARSELt wheel beside torch (``nvidia/cusparselt*``)."""
    for entry in map(Path, sys.path):
        for base in sorted(entry.glob("nvidia/cusparselt*")):
            if (base / "include" / "cusparseLt.h").exists():
                return str(base / "include"), str(base / "lib")
    raise FileNotFoundError("no nvidia/cusparselt*/include/cusparseLt.h on sys.path (the "
                            "nvidia-cusparselt wheel torch loads)")


def enabled() -> bool:
    """False under ``PlanOptions(cslt_epilogue=False)`` (torch's binding and plain-torch
    epilogues only)."""
    return switches.current().cslt_epilogue


@functools.cache
def load() -> ModuleType | None:
    """The compiled binding (``sparse24_mm_alpha``), or None when it is turned off, there is no
    CUDA, or the build fails (:func:`reason` says which)."""
    if not torch.cuda.is_available():
        _why.append("no CUDA device")
        return None
    try:
        from torch.utils.cpp_extension import load as build

        inc, lib = cusparselt_dirs()
        # CUDA headers from the nvidia wheels where the toolkit lacks one ATen includes
        wheels = Path(inc).parents[1]
        extra = [str(d) for d in sorted(wheels.glob("*/include")) if (d / "cusparse.h").exists()]
        return build(name="sparsekit_cslt_v2", sources=[str(SOURCE)],
                     extra_include_paths=[inc, *extra], with_cuda=True, verbose=False,
                     extra_ldflags=[f"-L{lib}", "-l:libcusparseLt.so.0", f"-Wl,-rpath,{lib}"])
    except Exception as e:  # noqa: BLE001  (any build failure: fall back to torch's binding)
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        _why.append(f"build failed: {first}")
        log.warning("sparsekit: own cuSPARSELt binding not built (%s); fp8 2:4 layers apply "
                    "their scales after torch's binding", first)
        return None


def reason() -> str | None:
    """Why :func:`load` returned None (after it was called), else None."""
    return _why[-1] if _why else None


__all__ = ["SOURCE", "cusparselt_dirs", "enabled", "load", "reason"]
