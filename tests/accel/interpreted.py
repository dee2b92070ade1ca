"""Triton kernels checked without a GPU. Run a snippet under Triton's CPU interpreter:
``TRITON_INTERPRET=1`` is read when ``triton.jit`` decorates (triton's own functions too, at
``import triton``), so the snippet runs in a fresh process started with it set, from the
project root; or compile a kernel for an sm_90 target (:func:`compile_sm90`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str, timeout: int = 300,
                    args: tuple[str, ...] | list[str] = ()) -> subprocess.CompletedProcess:
    """``python -c code *args`` with ``TRITON_INTERPRET=1``, the project and this folder (the
    tests' own imports) on the path."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def compile_sm90(kernel, signature: dict, constants: dict, num_warps: int = 4):
    """``kernel`` compiled by Triton for an sm_90 GPU (no GPU needed; constants' signature
    entries are added as "constexpr"); the test is skipped without triton or its ptxas."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **dict.fromkeys(constants, "constexpr")}
    try:
        return triton.compile(ASTSource(kernel, sig, constants),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except RuntimeError as e:  # a Triton without its CUDA toolchain (ptxas)
        if "ptxas" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise
