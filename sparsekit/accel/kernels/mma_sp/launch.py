"""sparsekit's small-M 2:4 GEMM on the sparse tensor cores (``mma.sp``), in CUDA.

Triton has no sparse matrix instruction: its small-M kernel
(:mod:`sparsekit.accel.kernels.triton24.format`)
expands the 2:4 weight in registers, which costs instructions per byte and loses to dense
cuBLAS from M = 4. This kernel (``csrc/sk24_mma.cu``) feeds the compressed values and their
2-bit indices to ``mma.sp.m16n8k32`` as they are, the way Sparse-Marlin does for 4-bit
weights: per weight byte it spends one load and no selects, at any M up to 32.

The format (W (N, K), 2:4 along K, N a multiple of 16, K of 64) is fragment-ordered: per tile
of 16 rows by 32 columns (a "step"), the 16 x 16 kept values in the order in which the warp's
32 lanes hold them as mma.sp's A operand, so that each lane loads its four registers with one
16-byte load (fp8 e4m3 weights: 8 bytes, widened to bf16 in registers, exactly):

- ``values`` (N/16, K/32, 32, 8), W's dtype: lane ``l = 4 q + t`` holds, in order, the
  compressed columns (2t, 2t+1) of rows q and q + 8, then (2t + 8, 2t + 9) of rows q and q + 8;
  compressed column ``c`` of a step is the ``c % 2``-th kept entry (in column order) of the
  step's group ``c // 2`` of 4 columns;
- ``meta`` int32: the kept entries' 2-bit positions in their group, 16 bits per row and half
  step (compressed columns 8h .. 8h + 7, the first in the low bits); lane ``4 q + p`` (p = 0, 1)
  of a step holds half p of row q in its low 16 bits and of row q + 8 in its high 16 bits.
  "paired" (the default, (N/16, K/64, 32)): lanes 4q, 4q+1 carry the even step of a pair and
  lanes 4q + 2, 4q + 3 the odd one (mma.sp's sparsity selector 0 and 1); "single"
  ((N/16, K/32, 32)): every step its own word per lane (lanes 4q + 2, 4q + 3 repeat 4q, 4q + 1).

Bytes per dense weight: bf16 1.125 (paired; 1.25 single), fp8 0.625, int4 0.39 (below).

int4 weights (W4A16, :mod:`sparsekit.accel.kernels.int4.format`'s values ``q`` in [-8, 7]
with float32
scales per group of input columns; group a multiple of 128, or the whole row) have their own
format (:func:`compress_int4`): each lane's 8 values of a step (the bf16 layout's order) as
nibbles ``q + 8`` of one 32-bit word, element 2j in nibble j and element 2j + 1 in nibble
j + 4 (so that one shift and one bitwise op put a register's two values in place), the words
of 4 steps (one
group of 128 columns) together, ``values`` (N/16, K/128, 32, 4) int32, so that a lane loads
4 steps with one 16-byte load; the "paired" metadata; and ``scales`` (N/16, K/128, 16) float32,
each 128 columns' scale per row of a tile. The kernel widens the nibbles to bf16 ``q`` exactly,
sums each group's products in float32 and multiplies them by the group's scales there:
``x @ (q * scale).T + bias`` with the scale applied in float32, as the reference.

fp8 weights have a third layout, "e4m3", for the library's fp8 x fp8 kernel
(``mma.sp.m16n8k64`` e4m3 on the fp8 sparse tensor cores: 64 columns a step, x as the fp8
layer quantized it, no widening; :func:`compress`), self-checked on its first use and taken by
fp8 layers that run on this kernel (below) where it passed that self-check.

The kernel computes ``(x @ W.T) * x_scale * w_scale + bias`` in float32 with x (M, K) bf16 and
returns bf16 (M, N); an fp8 layer passes its quantized activations widened to float16 (exact;
the kernel then converts the e4m3 weight to f16 with one hardware conversion per two values and
runs the f16 sparse tensor cores) where that passed the self-check (:func:`fp8_f16_ok`), else
widened to bf16 (the weight widened in registers by bit moves), so that the products and sums
are those of an fp8 x fp8 GEMM with float32 accumulation.

The kernel is a plain shared library (no torch headers), built ahead of time into the package
(``python -m sparsekit.accel.build``, or ``pip install`` on a machine with a GPU and the CUDA
toolkit: :mod:`sparsekit.accel.build`), opened only after :mod:`sparsekit.accel.libload` checked
the file (owner, permissions, the sha256 its manifest records, the functions it exports), and
called through ctypes on torch's current stream (CUDA graphs capture it). Where there is no
CUDA device, the library is not built or fails a check, or it fails its self-check (once per
process: every configuration against the reference on a small weight), :func:`load` returns
None and :func:`reason` says why; the layers then keep the Triton kernel.
``PlanOptions(mma_sp="off")`` turns it off. bf16 layers always take it; an fp8 layer starts on
the Triton kernel and, where the library runs fp8 weights with f16 x (:func:`choosable`), the
decode plan times both kernels on the layer's shape and keeps the faster
(:func:`sparsekit.accel.planner.decode.time_decode_choices`); ``PlanOptions(mma_sp="all")``
puts every fp8 layer on this kernel untimed (:func:`dtypes`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from sparsekit.accel import build, libload
from sparsekit.accel.kernels import switches
from sparsekit.accel.kernels.triton24 import format as sk24

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "sk24_mma.cu"
DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
META_LAYOUTS = ("paired", "single")
LAYOUTS = (*META_LAYOUTS, "e4m3")  # "e4m3": fp8 weights for the fp8 x fp8 kernel (below)
# (warps, steps ahead) of the fp8 x fp8 kernel
E4M3_CONFIGS = ((4, 4), (4, 8), (8, 4), (8, 8))
MAX_M = 32
INT4_COLUMNS = 128  # the columns one int4 scale covers in the format (a group or part of one)
# (warps a block, steps a warp loads ahead, tiles of 16 rows a block, x): the configurations
# the library is built with. x loaded straight into the B fragments (0) costs the L1 about
# eight wavefronts per 16 bytes of a fragment once M > 1; staged (1), each warp loads its steps
# of x with coalesced 16-byte loads and reads the fragments with ldmatrix; staged and
# prefetched (3), each warp also issues the loads of its next round (weight and x) before the
# products of this one, so that twice the bytes are in flight (a decode GEMM of the narrow
# formats, fp8 and int4, waits on few bytes a round otherwise); 7, as 3 and launched as a
# programmatic dependent of the kernel before it (Hopper's PDL, kept by CUDA graphs): its blocks
# start while that kernel ends and issue their first round's weight loads before they wait for
# it, so that a decode step's many short kernels overlap their ends and starts. Plus 8 (with
# 1): each warp brings its weights through a ring of three rounds in shared memory, copied
# (cp.async) two rounds ahead, so that more weight bytes are in flight without the registers
# that prefetching into registers costs (bit 1 then prefetches x alone). Plus 16 (with 3 or 7):
# the lean rounds, the same products with each load addressed by a per-lane 32-bit offset
# advanced by a constant each round and two sets of round registers taken in turn (the other
# modes spend about as many instructions on 64-bit addresses and register copies as on the
# int4 products at M = 1).
# :func:`default_config` picks among the staged ones; the planner times them all per shape and
# M bucket (:data:`BUCKETS`)
CONFIGS = ((4, 4, 1, 0), (4, 8, 1, 0), (8, 4, 1, 0), (8, 8, 1, 0), (2, 8, 1, 0), (4, 4, 2, 0),
           (8, 4, 2, 0), (4, 4, 4, 0), (4, 4, 1, 1), (8, 4, 1, 1), (8, 2, 1, 1), (4, 4, 2, 1),
           (8, 4, 2, 1), (4, 4, 4, 1), (4, 4, 1, 3), (8, 4, 1, 3), (8, 2, 1, 3), (8, 8, 1, 3),
           (8, 4, 2, 3), (4, 4, 4, 3), (4, 4, 1, 7), (8, 4, 1, 7), (8, 2, 1, 7), (8, 4, 2, 7),
           (8, 4, 1, 9), (8, 4, 1, 11), (8, 4, 1, 15), (8, 4, 2, 15), (8, 4, 1, 19),
           (8, 4, 2, 19), (8, 4, 1, 23), (8, 4, 2, 23), (4, 4, 1, 23), (8, 2, 1, 23))
LEAN_CONFIGS = tuple(c for c in CONFIGS if c[3] & 16)  # checked on several rounds a warp too
PDL_CONFIGS = tuple(c for c in CONFIGS if c[3] & 4)  # launched as programmatic dependents
# the token counts a layer may choose its own configuration for: M = 1, 2..8, 9..16, 17..32
# (the kernel's M tiles, with M = 1 apart: there the direct loads fetch one row only)
BUCKETS = (1, 8, 16, 32)
VERSION = 11  # sk24_mma_version() of the library this module calls
# what the loader checks the built library against before it opens it (sparsekit.accel.libload)
SPEC = libload.Spec(build.SK24_MMA, VERSION, build.SK24_MMA_SOURCES, build.SK24_MMA_SYMBOLS)
# the ways the kernel runs: "bf16" (bf16 x: bf16 weights, fp8 weights widened to bf16), "f16"
# (fp8 weights with f16 x: the f16 sparse tensor cores), "int4"
WAYS = ("bf16", "f16", "int4")
# per way, the configurations that failed the self-check (never launched that way)
_failed: dict[str, set] = {way: set() for way in WAYS}
_e4m3: list[bool] = []  # [whether the fp8 x fp8 kernel passed its self-check], on first use
_why: list[str] = []


def check_shape(out_features: int, in_features: int) -> str | None:
    """None when a weight (out_features, in_features) takes the format, else why not."""
    if out_features % 16 or out_features < 16:
        return f"out_features {out_features} is not a multiple of 16"
    if in_features % 64 or in_features < 64:
        return f"in_features {in_features} is not a multiple of 64"
    return None


def _kept(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (N, K/2), 2-bit positions (N, K/2) int64): :func:`sk24.kept`, flattened."""
    vals, idx = sk24.kept(weight, "2:4 mma format")
    n, k = weight.shape
    return vals.reshape(n, k // 2), idx.reshape(n, k // 2).to(torch.int64)


def _lanes(c: torch.Tensor) -> torch.Tensor:
    """A compressed matrix (N, K/2) per step in lane order: (N/16, K/32, 32, 8)."""
    n, half = c.shape
    t = c.reshape(n // 16, 2, 8, half // 16, 2, 4, 2)  # (rt, rh, q, ks, ch, t, e)
    return t.permute(0, 3, 2, 5, 4, 1, 6).reshape(n // 16, half // 16, 32, 8)


def _unlanes(v: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_lanes`."""
    rt, ks = v.shape[:2]
    t = v.reshape(rt, ks, 8, 4, 2, 2, 2).permute(0, 5, 2, 1, 4, 3, 6)
    return t.reshape(rt * 16, ks * 16)


def _lanes_e4m3(c: torch.Tensor) -> torch.Tensor:
    """A compressed fp8 matrix (N, K/2) per 64-column step in lane order: (N/16, K/64, 32,
    16); lane 4q + t holds compressed columns 4t..4t+3 of rows q, q+8, then 16+4t.. of both."""
    n, half = c.shape
    t = c.reshape(n // 16, 2, 8, half // 32, 2, 4, 4)  # (rt, rh, q, ks, ch, t, e)
    return t.permute(0, 3, 2, 5, 4, 1, 6).reshape(n // 16, half // 32, 32, 16)


def _unlanes_e4m3(v: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_lanes_e4m3`."""
    rt, ks = v.shape[:2]
    t = v.reshape(rt, ks, 8, 4, 2, 2, 4).permute(0, 5, 2, 1, 4, 3, 6)
    return t.reshape(rt * 16, ks * 32)


def compress(weight: torch.Tensor, meta_layout: str = "paired"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, meta) of a 2:4 weight (N, K) in the fragment-ordered format (module
    docstring); ValueError for a shape, dtype or pattern the format does not take.
    ``meta_layout`` "e4m3" (fp8 weights only): the layout of the fp8 x fp8 kernel
    (``mma.sp.m16n8k64`` e4m3: 64 columns a step, values (N/16, K/64, 32, 16), meta (N/16,
    K/64, 32): lane 4q + p holds the positions of row q + 8 (p & 1), compressed columns
    16 (p >> 1) .. 16 (p >> 1) + 15, column c at bits 2c of the 32)."""
    if meta_layout not in LAYOUTS:
        raise ValueError(f"2:4 mma format: meta_layout must be one of {LAYOUTS}, got "
                         f"{meta_layout!r}")
    if meta_layout == "e4m3" and weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"2:4 mma format: the e4m3 layout takes float8_e4m3fn weights, got "
                         f"{weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"2:4 mma format: the weight must be 2-D, got {tuple(weight.shape)}")
    reason = check_shape(*weight.shape)
    if reason:
        raise ValueError(f"2:4 mma format: {reason}")
    if weight.dtype not in DTYPES:
        raise ValueError(f"2:4 mma format: weight dtype must be one of {DTYPES}, got "
                         f"{weight.dtype}")
    vals, idx = _kept(weight)
    n, half = idx.shape
    shifts = 2 * torch.arange(8, device=idx.device, dtype=torch.int64)
    h16 = (idx.reshape(n, half // 8, 8) << shifts).sum(-1)  # (N, K/16): 8 positions a word
    if meta_layout == "e4m3":
        # lane 4q + p: row q + 8 (p & 1), compressed columns 16 (p >> 1) .. + 15 (32 bits)
        q16 = h16.reshape(n // 16, 2, 8, half // 32, 2, 2)  # (rt, rh, q, ks, h, w)
        word = q16[..., 0] | (q16[..., 1] << 16)  # (rt, rh, q, ks, h)
        word = word.permute(0, 3, 2, 4, 1)  # (rt, ks, q, h, rh): lane 4q + 2h + rh
        meta = word.reshape(n // 16, half // 32, 32)
        meta = torch.where(meta >= 2**31, meta - 2**32, meta).to(torch.int32).contiguous()
        return _lanes_e4m3(vals).contiguous(), meta
    values = _lanes(vals).contiguous()
    # per row and half step: 8 positions of 2 bits, compressed column 8h + j at bits 2j
    h16 = h16.reshape(n // 16, 2, 8, half // 16, 2)  # (rt, rh, q, ks, h)
    word = h16[:, 0] | (h16[:, 1] << 16)  # (rt, q, ks, h)
    word = word.permute(0, 2, 1, 3)  # (rt, ks, q, p)
    if meta_layout == "single":
        lanes = torch.cat([word, word], -1)  # p = 0, 1, then again for lanes 4q+2, 4q+3
        meta = lanes.reshape(n // 16, half // 16, 32)
    else:
        ks = half // 16
        pairs = word.reshape(n // 16, ks // 2, 2, 8, 2).permute(0, 1, 3, 2, 4)  # (rt,s,q,par,p)
        meta = pairs.reshape(n // 16, ks // 2, 32)
    meta = torch.where(meta >= 2**31, meta - 2**32, meta).to(torch.int32).contiguous()
    return values, meta


def decompress(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """The dense weight (N, K) in ``values``' dtype: the inverse of :func:`compress` (either
    metadata layout)."""
    rt, ks = values.shape[:2]
    m = meta.to(torch.int64) & 0xFFFFFFFF
    shifts = 2 * torch.arange(8, device=meta.device, dtype=torch.int64)
    if values.shape[-1] == 16:  # e4m3: 64 columns a step
        n, k = rt * 16, ks * 64
        vals = _unlanes_e4m3(values).float()
        word = m.reshape(rt, ks, 8, 2, 2)  # (rt, ks, q, h, rh)
        q16 = torch.stack([word & 0xFFFF, word >> 16], -1)  # (rt, ks, q, h, rh, w)
        q16 = q16.permute(0, 4, 2, 1, 3, 5).reshape(n, 4 * ks)  # (rt, rh, q, ks, h, w)
        idx = ((q16[..., None] >> shifts) & 3).reshape(n, k // 4, 2)
        dense = torch.zeros(n, k // 4, 4, dtype=torch.float32, device=values.device)
        dense.scatter_(-1, idx, vals.reshape(n, k // 4, 2))
        return dense.reshape(n, k).to(values.dtype)
    n, k = rt * 16, ks * 32
    vals = _unlanes(values).float()  # (N, K/2)
    if meta.shape[1] == ks:  # single
        word = m.reshape(rt, ks, 8, 2, 2)[:, :, :, 0]  # (rt, ks, q, p)
    else:  # paired: (rt, ks/2, q, parity, p)
        word = m.reshape(rt, ks // 2, 8, 2, 2).permute(0, 1, 3, 2, 4).reshape(rt, ks, 8, 2)
    h16 = torch.stack([word & 0xFFFF, word >> 16], 1)  # (rt, rh, ks, q, p)
    h16 = h16.permute(0, 1, 3, 2, 4).reshape(n, 2 * ks)  # (row, step*2 + h)
    idx = ((h16[..., None] >> shifts) & 3).reshape(n, k // 4, 2)
    dense = torch.zeros(n, k // 4, 4, dtype=torch.float32, device=values.device)
    dense.scatter_(-1, idx, vals.reshape(n, k // 4, 2))
    return dense.reshape(n, k).to(values.dtype)


_NIBBLE = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # the int4 word's nibble of each element


def check_int4(out_features: int, in_features: int, group_size: int) -> str | None:
    """None when an int4 weight (out_features, in_features) with ``group_size`` takes the int4
    format, else why not."""
    reason = check_shape(out_features, in_features)
    if reason:
        return reason
    if in_features % INT4_COLUMNS:
        return f"in_features {in_features} is not a multiple of {INT4_COLUMNS}"
    if group_size % INT4_COLUMNS or in_features % group_size:
        return (f"group_size {group_size} is not a multiple of {INT4_COLUMNS} dividing "
                f"in_features {in_features}")
    return None


def compress_int4(q: torch.Tensor, scales: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, meta, scales) of a 2:4 int4 weight in the kernel's int4 format (module
    docstring): ``q`` (N, K) int8 in [-8, 7], at most 2 nonzeros in every group of 4 along K;
    ``scales`` (N, K / group_size) float32. ValueError naming what does not fit."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"2:4 mma int4 format: q must be 2-D int8, got {q.dtype} "
                         f"{tuple(q.shape)}")
    n, k = q.shape
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] < 1 or k % scales.shape[1]:
        raise ValueError(f"2:4 mma int4 format: scales must be (N={n}, K / group_size), got "
                         f"{tuple(scales.shape)}")
    reason = check_int4(n, k, k // scales.shape[1])
    if reason:
        raise ValueError(f"2:4 mma int4 format: {reason}")
    if int(q.min()) < -8 or int(q.max()) > 7:
        raise ValueError("2:4 mma int4 format: q must lie in [-8, 7]")
    vals, _ = _kept(q)
    nib = (_lanes(vals).to(torch.int64) + 8)  # (N/16, K/32, 32, 8)
    word = (nib << (4 * _NIBBLE.to(q.device))).sum(-1)
    word = word.reshape(n // 16, k // 128, 4, 32).transpose(2, 3)  # (rt, group, lane, step)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()
    # the pattern's metadata, from the nonzeros as compress() takes them (exact in bf16)
    _, meta = compress(q.to(torch.bfloat16), "paired")
    per = scales.float().repeat_interleave(k // scales.shape[1] // INT4_COLUMNS, 1)
    gs = per.reshape(n // 16, 16, k // 128).permute(0, 2, 1).contiguous()
    return word, meta, gs


def decompress_int4(values: torch.Tensor, meta: torch.Tensor, scales: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (N, K) int8, per-128-column scales (N, K / 128) float32): the inverse of
    :func:`compress_int4`."""
    rt, groups = values.shape[:2]
    w = values.to(torch.int64) & 0xFFFFFFFF
    w = w.transpose(2, 3).reshape(rt, groups * 4, 32)  # (rt, step, lane)
    nib = (w[..., None] >> (4 * _NIBBLE.to(values.device))) & 15
    kept = (nib - 8).to(torch.bfloat16)  # (rt, ks, 32, 8): the bf16 layout's values
    q = decompress(kept, meta).to(torch.int8)
    return q, scales.permute(0, 2, 1).reshape(rt * 16, groups)


def reference_int4(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
                   scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the int4 kernel computes, in plain torch: ``x @ (q * scale).T + bias`` in float32,
    returned in bf16."""
    q, per = decompress_int4(values, meta, scales)
    w = q.float() * per.repeat_interleave(INT4_COLUMNS, 1)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


def reference(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
              x_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in plain torch (float32 products of the dense weight)."""
    y = x.float() @ decompress(values, meta).float().t()
    if x_scale is not None:
        y = y * x_scale.float().reshape(-1, 1)
    if w_scale is not None:
        y = y * w_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16)


def enabled() -> bool:
    """False under ``PlanOptions(mma_sp="off")``."""
    return switches.current().mma_sp != "off"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built library (``sk24_mma_launch``), or None (:func:`reason` says why)."""
    if not torch.cuda.is_available():
        _why.append("no CUDA device")
        return None
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        _why.append(f"compute capability {major}.x: the kernel is built for sm_90")
        return None
    try:
        lib = libload.load(SPEC)
        lib.sk24_mma_launch.restype = ctypes.c_int
        lib.sk24_mma_launch.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        if lib.sk24_mma_version() != VERSION:
            raise RuntimeError(f"the library is version {lib.sk24_mma_version()}, not "
                               f"{VERSION}: rebuild it ({build.COMMAND})")
        lib.sk24_mma_e4m3_launch.restype = ctypes.c_int
        lib.sk24_mma_e4m3_launch.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        _self_check(lib)
        return lib
    except (OSError, RuntimeError, AttributeError) as e:
        _why.append(str(e)[:300])
        log.warning("sparsekit: the mma.sp 2:4 kernel is not available (%s); the Triton "
                    "kernel runs instead", _why[-1])
        return None


def _failing(lib: ctypes.CDLL, way: str, configs, x_of, values: torch.Tensor,
             meta: torch.Tensor, ws: torch.Tensor | None = None,
             gs: torch.Tensor | None = None) -> set:
    """The configurations of ``configs`` whose output on x = ``x_of(m)`` (one M per M tile) is
    not within 1e-2 of the reference (relative, whole output) or that raise, for the weight
    ``values``, ``meta`` (per-row scales ``ws``; int4: group scales ``gs``); each one logged
    with ``way``."""
    failed = set()
    for m in (1, 9, 17):
        x = x_of(m)
        ref = (reference(x, values, meta, None, ws, None) if gs is None else
               reference_int4(x, values, meta, gs, None)).float()
        for cfg in configs:
            try:
                got = _launch(lib, x, values, meta, None, ws, None, cfg, gs).float()
                err = ((got - ref).norm() / ref.norm()).item()
                why = f"relative error {err:.3g}"
            except RuntimeError as e:
                err, why = float("inf"), str(e)
            if not err < 1e-2 and cfg not in failed:
                failed.add(cfg)
                log.warning("sparsekit: mma.sp config %s failed its self-check (%s, M=%d: %s); "
                            "not used that way", cfg, way, m, why)
    return failed


def _graph_failing(lib: ctypes.CDLL, values: torch.Tensor, meta: torch.Tensor, k: int,
                   gs: torch.Tensor | None = None) -> set:
    """The configurations of :data:`PDL_CONFIGS` (int4, with group scales ``gs``: those of
    :func:`int4_configs`) that fail in a CUDA graph (as a decode step runs them): each captured
    right after a kernel that writes its x (K = ``k`` columns), replayed, against the
    reference; those whose capture or launch raises fail too."""
    failed = set()
    configs = [c for c in PDL_CONFIGS if gs is None or c in int4_configs()]
    for m in (1, 9):
        x = torch.randn(m, k, device=values.device).to(torch.bfloat16)
        ref = (reference(x * 2, values, meta, None, None, None) if gs is None else
               reference_int4(x * 2, values, meta, gs, None)).float()
        for cfg in configs:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = _launch(lib, x * 2, values, meta, None, None, None, cfg, gs)
                for _ in range(3):
                    graph.replay()
                torch.cuda.synchronize()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                why = f"relative error {err:.3g}"
                del graph
            except RuntimeError as e:
                err, why = float("inf"), str(e)
            if not err < 1e-2 and cfg not in failed:
                failed.add(cfg)
                log.warning("sparsekit: mma.sp config %s failed its CUDA-graph self-check "
                            "(%s, M=%d: %s); not used", cfg, "bf16" if gs is None else "int4",
                            m, why)
    return failed


def _self_check(lib: ctypes.CDLL) -> None:
    """Run the kernel once per weight kind, configuration and M tile against the reference
    on a small weight (and :data:`LEAN_CONFIGS` again on one that gives each warp several
    rounds), and the programmatic-launch configurations in a CUDA graph: a configuration that
    computes wrong is never launched that way (:func:`launch` refuses it); RuntimeError when
    one that :func:`default_config` picks does for bf16 or bf16-widened fp8 (the library is
    then not used). fp8 with f16 x and int4 that fail only lose that way
    (:func:`fp8_f16_ok`, :func:`int4_ok`)."""
    g = torch.Generator().manual_seed(0)
    bad = _ways_failing(lib, g, 256, CONFIGS)
    if bad["bf16"] & set(DEFAULTS):
        raise RuntimeError(f"self-check failed (bf16 or fp8, default configurations "
                           f"{sorted(bad['bf16'] & set(DEFAULTS))})")
    # 64 rows, K = 3200: 100 steps of 32 columns, warps with 3 and 4 rounds at 8 warps of 4
    rounds = _ways_failing(lib, g, 3200, LEAN_CONFIGS)
    w = _masked_24(64, 256, g)
    values, meta = compress(w.to(torch.bfloat16), "paired")
    in_graph = _graph_failing(lib, values, meta, 256)  # programmatic launches: every way
    iv, im, gs = _int4_weight(w, g)
    in_graph_int4 = _graph_failing(lib, iv, im, 256, gs)  # the plan times these
    for way in WAYS:
        _failed[way].update(bad[way], rounds[way], in_graph)
    _failed["int4"].update(in_graph_int4)


def _masked_24(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """A random float32 (rows, cols) weight on CUDA, the two largest of every four kept."""
    w4 = torch.randn(rows, cols // 4, 4, generator=g)
    keep = torch.zeros_like(w4).scatter_(-1, w4.abs().topk(2, -1).indices, 1.0)
    return (w4 * keep).view(rows, cols).cuda()


def _int4_weight(w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The int4 format (:func:`compress_int4`, on CUDA) of random int4 values at ``w``'s kept
    positions, random group scales."""
    rows, cols = w.shape
    q = torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8) * (w != 0).cpu().to(
        torch.int8)
    scales = torch.rand(rows, cols // INT4_COLUMNS, generator=g) + 0.5
    return tuple(t.cuda() for t in compress_int4(q, scales))


def _ways_failing(lib: ctypes.CDLL, g: torch.Generator, cols: int, configs) -> dict[str, set]:
    """Per way (:data:`WAYS`), the configurations of ``configs`` that compute wrong or raise
    (:func:`_failing`) on random 2:4 weights of 64 rows and ``cols`` columns: bf16 and fp8
    widened to bf16 ("bf16"), fp8 with f16 x ("f16"), int4 (its configurations)."""
    def x_of(dtype, wide=None):
        def make(m):
            x = torch.randn(m, cols, generator=g).to("cuda", dtype)
            return x if wide is None else x.to(wide)
        return make

    w = _masked_24(64, cols, g)
    scale = (w.abs().amax(1) / 448).clamp_min(1e-12)
    fp8 = (w / scale[:, None]).to(torch.float8_e4m3fn)
    bad = {way: set() for way in WAYS}
    for weight, ws in ((w.to(torch.bfloat16), None), (fp8, scale)):
        values, meta = compress(weight, "paired")  # the layers' layout
        bad["bf16"] |= _failing(lib, f"{weight.dtype}, K = {cols}", configs,
                                x_of(torch.bfloat16), values, meta, ws)
    bad["f16"] = _failing(lib, f"fp8 with f16 x, K = {cols}", configs,
                          x_of(torch.float8_e4m3fn, torch.float16), values, meta, scale)
    iv, im, gs = _int4_weight(w, g)
    bad["int4"] = _failing(lib, f"int4, K = {cols}", [c for c in configs if c in int4_configs()],
                           x_of(torch.bfloat16), iv, im, gs=gs)
    return bad


def _self_check_e4m3(lib: ctypes.CDLL, w: torch.Tensor, g: torch.Generator) -> bool:
    """The fp8 x fp8 kernel against :func:`reference` per configuration and M tile: False (and
    it is never launched) on any mismatch."""
    scale = (w.abs().amax(1) / 448).clamp_min(1e-12)
    values, meta = compress((w / scale[:, None]).to(torch.float8_e4m3fn), "e4m3")
    for m in (1, 9, 17):
        x = torch.randn(m, w.shape[1], generator=g).to("cuda", torch.float8_e4m3fn)
        ref = reference(x, values, meta, None, scale, None).float()
        for cfg in E4M3_CONFIGS:
            try:
                got = _launch_e4m3(lib, x, values, meta, None, scale, None, cfg).float()
                err = ((got - ref).norm() / ref.norm()).item()
            except RuntimeError as e:
                err, cfg = float("inf"), (cfg, str(e))
            if not err < 1e-2:
                log.warning("sparsekit: the fp8 x fp8 mma.sp kernel failed its self-check "
                            "(M=%d, config %s: relative error %.3g); fp8 layers do not use it",
                            m, cfg, err)
                return False
    return True


def e4m3_ok() -> bool:
    """Whether the fp8 x fp8 kernel is built and passed its self-check (run on the first
    call, not when the library loads: bf16 layers never wait for it)."""
    lib = load()
    if lib is None:
        return False
    if not _e4m3:
        g = torch.Generator().manual_seed(1)
        _e4m3.append(_self_check_e4m3(lib, _masked_24(64, 256, g), g))
    return _e4m3[0]


def reason() -> str | None:
    """Why :func:`load` returned None (after it was called), else None."""
    return _why[-1] if _why else None


def dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes the layers put in this format untimed: bf16; fp8 too with
    ``PlanOptions(mma_sp="all")`` (on the fp8 x fp8 kernel where it passed its self-check, else
    with f16 or bf16 x). Otherwise an fp8 layer goes there only where its decode plan timed
    it faster than the Triton kernel (:func:`choosable`)."""
    return DTYPES if switches.current().mma_sp == "all" else (torch.bfloat16,)


def layout_for(weight: torch.Tensor) -> str:
    """The layout the layers store ``weight`` in: "e4m3" for fp8 where the fp8 x fp8 kernel
    passed its self-check, else "paired"."""
    return "e4m3" if weight.dtype == torch.float8_e4m3fn and e4m3_ok() else "paired"


def choosable(weight: torch.Tensor, wide: torch.dtype = torch.float16) -> bool:
    """True when an fp8 layer on the Triton kernel may move to this one (the decode plan
    times both): ``weight`` (N, K) float8_e4m3fn on CUDA of a shape the kernel takes, the
    kernel not turned off and the library loaded with the way x would reach it self-checked:
    ``wide`` float16 (a W8A8 layer's quantized x widened to f16: :func:`fp8_f16_ok`; the bf16
    widening is slower than the Triton kernel, so not a candidate) or bfloat16 (a weight-only
    layer's x: the bf16 way, which the library checks before it loads)."""
    if not (weight.is_cuda and weight.dtype == torch.float8_e4m3fn and enabled()
            and check_shape(*weight.shape) is None):
        return False
    return fp8_f16_ok() if wide == torch.float16 else load() is not None


def usable(weight: torch.Tensor) -> bool:
    """True when the layers should put ``weight`` (N, K) in this format: a CUDA tensor of a
    shape the kernel takes and a dtype of :func:`dtypes`, with the library built and loaded
    (:func:`load`)."""
    return (weight.is_cuda and weight.dtype in dtypes() and enabled()
            and check_shape(*weight.shape) is None and load() is not None)


def default_config(m: int, n: int, k: int, int4: bool = False) -> tuple[int, int, int, int]:
    """(warps, steps ahead, row tiles, x mode) for a shape: x staged through shared memory,
    8 warps, 4 steps ahead up to M = 8 and 2 beyond (int4, which loads 4 steps at once: two
    row tiles a block beyond M = 8 where N allows), one tile of 16 rows a block; 4 warps where
    K has fewer than 8 x 4 steps of 32 columns. On an H100 (Llama-3-8B shapes, M = 1..32,
    journal/data/bench_sk24_mma_2026-12-06b_h100.json) this rule ran within 0.3% of the best
    configuration per row in bf16 on geo-mean at M <= 16 (fp8 7%, int4 4%)."""
    if k // 32 < 8 * 4:
        return (4, 4, 1, 1)
    if m <= 8:
        return (8, 4, 1, 1)
    if int4:
        return (8, 4, 2, 1) if (n // 16) % 2 == 0 else (8, 4, 1, 1)
    return (8, 2, 1, 1)


DEFAULTS = ((4, 4, 1, 1), (8, 4, 1, 1), (8, 2, 1, 1))  # what default_config returns (bf16)
DEFAULTS_INT4 = ((4, 4, 1, 1), (8, 4, 1, 1), (8, 4, 2, 1))


def candidates(values: torch.Tensor, wide: torch.dtype | None = None
               ) -> list[tuple[int, ...]]:
    """The configurations the planner times for a weight in this format (its layout's, those
    that passed the self-check and fit its row tiles and, the lean ones, its K); ``wide``: the
    dtype x reaches the kernel in (an fp8 weight: float16 or bfloat16; None: float16 where
    that way works, as W8A8 fp8 layers pass it)."""
    if values.shape[-1] == 16:
        return list(E4M3_CONFIGS)
    tiles, steps = values.shape[0], values.shape[1] * (4 if values.dtype == torch.int32 else 1)
    if values.dtype == torch.int32:
        way = "int4"
    elif values.dtype == torch.float8_e4m3fn:
        f16 = fp8_f16_ok() if wide is None else wide == torch.float16
        way = "f16" if f16 else "bf16"
    else:
        way = "bf16"
    return [c for c in working(way) if tiles % c[2] == 0 and whole_rounds(c, steps)]


def whole_rounds(cfg: tuple[int, ...], steps: int) -> bool:
    """Whether a weight of ``steps`` steps of 32 columns suits ``cfg``: the lean rounds (x mode
    bit 16) run whole rounds only, ``cfg[1]`` steps each; the other configurations take any."""
    return not (cfg[3] & 16 and steps % cfg[1])


def int4_configs() -> list[tuple[int, int, int, int]]:
    """The configurations int4 weights run with: those loading whole groups of 4 steps."""
    return [c for c in CONFIGS if c[1] % 4 == 0]


def working(way: str) -> list[tuple[int, int, int, int]]:
    """The configurations of ``way`` (one of :data:`WAYS`) built and not failed in the
    self-check."""
    return [c for c in (int4_configs() if way == "int4" else CONFIGS) if c not in _failed[way]]


def fp8_f16_ok() -> bool:
    """Whether the library loads and runs fp8 weights with float16 x (e4m3 converted to f16
    by the hardware, the f16 sparse tensor cores) in its default configurations: the fp8
    layers' way onto it then, else bf16 widening."""
    return load() is not None and not set(DEFAULTS) & _failed["f16"]


def int4_ok() -> bool:
    """Whether the library loads and its default int4 configurations passed the self-check."""
    return load() is not None and not set(DEFAULTS_INT4) & _failed["int4"]


def usable_int4(q: torch.Tensor, group_size: int) -> bool:
    """True when an int4 2:4 layer should decode on this kernel: ``q`` (N, K) on CUDA of a
    shape and group the int4 format takes, the library loaded (:func:`int4_ok`)."""
    return (q.is_cuda and enabled() and check_int4(*q.shape, group_size) is None
            and int4_ok())


def config_for(config, m: int) -> tuple[int, ...] | None:
    """The configuration for M rows out of ``config``: None, one configuration, or one per
    bucket of :data:`BUCKETS` (flattened, as the op takes it)."""
    if config is None:
        return None
    config = tuple(config)
    width = len(config) // len(BUCKETS)
    if width and len(config) == width * len(BUCKETS) and width in (2, 4):
        i = next(i for i, top in enumerate(BUCKETS) if m <= top or top == BUCKETS[-1])
        return config[i * width:(i + 1) * width]
    return config


def config_text(config) -> str:
    """A configuration per bucket (a layer plan route's config) for reports: "/"-separated."""
    return "/".join("x".join(map(str, c)) for c in config)


def launch(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
           x_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
           bias: torch.Tensor | None, config: tuple[int, ...] | None = None
           ) -> torch.Tensor:
    """Run the kernel on CUDA tensors: x (M, K) bf16 with M <= 32; ``config`` (warps, steps
    ahead, row tiles, x mode) from :data:`CONFIGS`, or one such per bucket of
    :data:`BUCKETS` in a row (:func:`config_for`), else :func:`default_config`."""
    config = config_for(config, x.shape[0])
    lib = load()
    if lib is None:
        raise RuntimeError(f"the mma.sp 2:4 kernel is not available: {reason()}")
    if values.shape[-1] == 16:  # the e4m3 layout: x quantized to fp8 by the layer
        if not e4m3_ok():
            raise RuntimeError("the fp8 x fp8 mma.sp kernel failed its self-check")
        return _launch_e4m3(lib, x, values, meta, x_scale, w_scale, bias, config)
    return _launch(lib, x, values, meta, x_scale, w_scale, bias, config)


def launch_int4(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
                scales: torch.Tensor, bias: torch.Tensor | None,
                config: tuple[int, ...] | None = None) -> torch.Tensor:
    """Run the kernel on an int4 weight in the int4 format (:func:`compress_int4`): x (M, K)
    bf16 with M <= 32; ``config`` as :func:`launch`'s, from :func:`int4_configs`."""
    config = config_for(config, x.shape[0])
    lib = load()
    if lib is None:
        raise RuntimeError(f"the mma.sp 2:4 kernel is not available: {reason()}")
    return _launch(lib, x, values, meta, None, None, bias, config, scales)


def _launch_e4m3(lib: ctypes.CDLL, x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
                 x_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
                 bias: torch.Tensor | None, config) -> torch.Tensor:
    m, k = x.shape
    rt, ks = values.shape[:2]
    n = rt * 16
    values, meta = values.contiguous(), meta.contiguous()
    if x.dtype != torch.float8_e4m3fn or k != ks * 64 or not 1 <= m <= MAX_M:
        raise ValueError(f"sk24 mma kernel (e4m3): x must be float8_e4m3fn (M <= {MAX_M}, "
                         f"{ks * 64}), got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1 or x.stride(0) % 4 or x.data_ptr() % 4:
        x = x.contiguous()  # the kernel loads x in 4-byte words: aligned rows
    cfg = config or ((8, 8) if m <= 16 else (8, 4))
    if cfg not in E4M3_CONFIGS:
        raise ValueError(f"sk24 mma kernel (e4m3): config {cfg} is not one of {E4M3_CONFIGS}")
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    xs = None if x_scale is None else x_scale.reshape(-1).float().contiguous()
    ws = None if w_scale is None else w_scale.reshape(-1).float().contiguous()
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    rc = lib.sk24_mma_e4m3_launch(
        x.data_ptr(), x.stride(0), values.data_ptr(), meta.data_ptr(),
        None if xs is None else xs.data_ptr(), 0 if xs is None or xs.numel() == 1 else 1,
        None if ws is None else ws.data_ptr(), None if b is None else b.data_ptr(),
        y.data_ptr(), m, n, k, cfg[0], cfg[1], torch.cuda.current_stream(x.device).cuda_stream)
    if rc:
        raise RuntimeError(f"sk24 mma kernel (e4m3): launch failed (code {rc})")
    return y


def _launch(lib: ctypes.CDLL, x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
            x_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
            bias: torch.Tensor | None, config: tuple[int, ...] | None,
            scales: torch.Tensor | None = None) -> torch.Tensor:
    m, k = x.shape
    int4 = values.dtype == torch.int32
    rt, ks = values.shape[0], values.shape[1] * (4 if int4 else 1)
    n = rt * 16
    values, meta = values.contiguous(), meta.contiguous()  # no-ops for compress()'s output
    f16 = x.dtype == torch.float16 and values.dtype == torch.float8_e4m3fn
    if (x.dtype != torch.bfloat16 and not f16) or k != ks * 32 or not 1 <= m <= MAX_M:
        raise ValueError(f"sk24 mma kernel: x must be bf16 (or float16 for an fp8 weight; M <= "
                         f"{MAX_M}, {ks * 32}), got {x.dtype} {tuple(x.shape)}")
    cfg = config or default_config(m, n, k, int4)
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.contiguous()  # the kernel loads x in 4-byte words: aligned rows
    if len(cfg) > 3 and cfg[3] & 1 and (x.stride(0) % 8 or x.data_ptr() % 16):
        x = x.clone(memory_format=torch.contiguous_format)  # staged: 16-byte loads
    paired = meta.shape[1] != ks
    allowed = working("int4" if int4 else "f16" if f16 else "bf16")
    if cfg not in allowed:
        raise ValueError(f"sk24 mma kernel: config {cfg} is not one of {allowed}")
    if int4 and (scales is None or not paired or scales.shape != (rt, ks // 4, 16)):
        raise ValueError(f"sk24 mma kernel (int4): needs paired metadata and scales "
                         f"({rt}, {ks // 4}, 16), got "
                         f"{None if scales is None else tuple(scales.shape)}")
    if (n // 16) % cfg[2]:
        raise ValueError(f"sk24 mma kernel: config {cfg} takes {cfg[2]} tiles of 16 rows a "
                         f"block; N = {n} has {n // 16}")
    if not whole_rounds(cfg, ks):
        raise ValueError(f"sk24 mma kernel: config {cfg} takes K a multiple of "
                         f"{32 * cfg[1]}; K = {k}")
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    xs = None if x_scale is None else x_scale.reshape(-1).float().contiguous()
    ws = None if w_scale is None else w_scale.reshape(-1).float().contiguous()
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    gs = None if scales is None else scales.float().contiguous()
    rc = lib.sk24_mma_launch(
        x.data_ptr(), x.stride(0), values.data_ptr(), meta.data_ptr(),
        None if xs is None else xs.data_ptr(), 0 if xs is None or xs.numel() == 1 else 1,
        None if ws is None else ws.data_ptr(),
        None if gs is None else gs.data_ptr(),
        None if b is None else b.data_ptr(), y.data_ptr(), m, n, k,
        2 if int4 else (3 if f16 else int(values.dtype == torch.float8_e4m3fn)), int(paired),
        *cfg, torch.cuda.current_stream(x.device).cuda_stream)
    if rc:
        raise RuntimeError(f"sk24 mma kernel: launch failed (code {rc})")
    return y


def bound_bytes(m: int, n: int, k: int, dtype: torch.dtype) -> int:
    """Bytes the kernel must move at least: values, paired metadata, x in (bf16), y out."""
    item = torch.empty((), dtype=dtype).element_size()
    return n * (k // 2) * item + n * (k // 64) * 4 * 2 + m * k * 2 + m * n * 2


__all__ = ["BUCKETS", "CONFIGS", "DEFAULTS", "DEFAULTS_INT4", "DTYPES", "E4M3_CONFIGS",
           "INT4_COLUMNS", "LAYOUTS", "LEAN_CONFIGS", "MAX_M", "PDL_CONFIGS", "VERSION", "WAYS",
           "SPEC", "bound_bytes", "candidates", "check_int4", "choosable", "check_shape",
           "compress", "compress_int4", "config_for", "config_text", "decompress",
           "decompress_int4", "default_config", "dtypes", "e4m3_ok", "fp8_f16_ok",
           "int4_configs", "int4_ok", "launch", "launch_int4", "layout_for",
           "load", "reason", "reference", "reference_int4", "usable", "usable_int4",
           "whole_rounds", "working"]
