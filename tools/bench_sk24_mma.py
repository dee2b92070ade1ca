"""The mma.sp small-M 2:4 kernel (sparsekit/accel/kernels/mma_sp/launch.py) on the GPU: correctness
of every configuration and metadata layout against the float32 reference, then one decode GEMM
per shape and M against cuBLAS bf16 and the bandwidth bound.

Sections:
- ``check``: per weight dtype (bf16, fp8 e4m3 with per-row scales, tiny values included so
  that fp8 subnormals are exercised), metadata layout ("paired", "single"), configuration
  (warps, steps ahead, row tiles) and M in 1..32 (every M on a small shape, a few on a Llama
  shape): the kernel's output against :func:`sk24_mma.reference` (relative error of the whole
  output, and whether it is within bf16 rounding: 1e-2).
- ``time``: Llama-3-8B and 70B shapes (tools/bench_generate.py's), M = 1, 2, 4, 8, 16, 32:
  cuBLAS bf16 (``F.linear``) and the kernel in bf16 and fp8 per configuration, each call in a
  CUDA graph with the weights cycled past the L2 (a decode step reads them from HBM). Per
  row: microseconds, bytes moved at least, TB/s and share of the bound, the ratio to cuBLAS
  for the best configuration; ``fp8x8_2:4``: the fp8 x fp8 kernel (x quantized to fp8, the
  "e4m3" layout) where it passed its self-check; the summary gives the geo-mean over cuBLAS
  at M <= 16 against the targets (bf16 2:4 >= 1.6x, fp8 2:4 >= 2.8x) and the geo-mean per M;
  ``fp8h_2:4``: fp8 weights with x in f16 (the e4m3 weight converted to f16 by the hardware,
  the f16 sparse tensor cores; the fp8 layers' way where it passed the self-check);
  ``int4_2:4``: int4 2:4 weights (RTN, group 128) on the kernel's int4 path, with the Triton
  int4 2:4 kernel's time beside it (``triton_us``).

    python tools/bench_sk24_mma.py --out mma.json          # on the GPU (sm_90)

- ``widen``: per shape, the prefill's weight widening of the weight-only formats: fp8w 2:4
  (``sparsekit::sk24_widen``, one Triton kernel) and int4 2:4 (``sparsekit::int4_24_widen``)
  against the same elementwise ops fused by ``torch.compile`` (how the layers widened before),
  weights cycled past the L2: microseconds, GB/s (values and metadata read, bf16 written),
  and whether the two give the same weight bitwise.

The library is built ahead of time: ``python -m sparsekit.accel.build`` (once per checkout).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsekit.accel import libload
from sparsekit.accel.kernels.int4 import op as int4_op
from sparsekit.accel.kernels.mma_sp import op as mma_op
from sparsekit.accel.kernels.triton24 import op as sk24_op
from sparsekit.accel.kernels.mma_sp import launch as sk24_mma
from sparsekit.accel.kernels.int4 import format as w4a16
from sparsekit.accel.layers_int4 import rtn_int4

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import (  # noqa: E402  (tools/bench_generate.py, beside this script)
    SHAPES, TARGETS, bound_tbs, copies_for, masked_weight, time_rotating)

MS = (1, 2, 4, 8, 16, 32)


def fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 weight, per-row float32 scales) of a bf16 weight: absmax / 448 per row."""
    scale = (w.float().abs().amax(1) / 448).clamp_min(1e-12)
    return (w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale.contiguous()


def checked(row: dict, ref: torch.Tensor, run) -> dict:
    """``row`` with ``run()``'s relative error against ``ref`` (whole output) and whether it
    is within bf16 rounding (1e-2), or the error it raised."""
    try:
        got = run().float()
        if got.is_cuda:
            torch.cuda.synchronize()
        row["rel_err"] = ((got - ref).norm() / ref.norm()).item()
        row["ok"] = row["rel_err"] < 1e-2
    except Exception as e:  # noqa: BLE001  (recorded: the check's point)
        row.update(error=f"{type(e).__name__}: {e}"[:300], ok=False)
    return row


def check_rows(device) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    cases = [(64, 256, list(range(1, 33))), (6144, 4096, [1, 5, 8, 16, 24, 32])]
    for n, k, ms in cases:
        w = masked_weight(n, k, "cpu", gen)
        w[: n // 4] *= 1e-3  # small rows: fp8 values near and below e4m3's normal range
        w = w.to(device)
        w8, ws = fp8_weight(w)
        w8[0, :4] = torch.tensor([0, 0x01, 0x00, 0x83], dtype=torch.uint8).view(
            torch.float8_e4m3fn)  # two subnormals, one group (pattern still 2:4)
        for dtype, weight, scale in (("bf16", w, None), ("fp8", w8, ws), ("fp8h", w8, ws)):
            for layout in sk24_mma.META_LAYOUTS:
                values, meta = sk24_mma.compress(weight, layout)
                for m in ms:
                    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=None)
                    bias = torch.randn(n, device=device).to(torch.bfloat16)
                    xs = torch.rand(m, 1, device=device) + 0.5
                    if dtype == "fp8h":  # fp8 weights with f16 x (the f16 tensor cores)
                        x = x.to(torch.float8_e4m3fn).to(torch.float16)
                    ref = sk24_mma.reference(x, values, meta, xs, scale, bias).float()
                    for cfg in sk24_mma.CONFIGS:
                        rows.append(checked(
                            {"N": n, "K": k, "M": m, "dtype": dtype, "layout": layout,
                             "config": list(cfg)}, ref,
                            functools.partial(sk24_mma.launch, x, values, meta, xs, scale,
                                              bias, cfg)))
        values, meta = sk24_mma.compress(w8, "e4m3")
        for m in ms:
            x = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
            xs = torch.rand(m, 1, device=device) + 0.5
            ref = sk24_mma.reference(x, values, meta, xs, ws, None).float()
            for cfg in sk24_mma.E4M3_CONFIGS:
                # the kernel itself, whether or not it passed the library's self-check
                rows.append(checked(
                    {"N": n, "K": k, "M": m, "dtype": "fp8", "layout": "e4m3",
                     "config": list(cfg)}, ref,
                    functools.partial(sk24_mma._launch_e4m3, sk24_mma.load(), x, values, meta,
                                      xs, ws, None, cfg)))
        q, scales = rtn_int4(w.float().cpu(), 128)
        values, meta, gs = (t.to(device) for t in sk24_mma.compress_int4(q, scales))
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            bias = torch.randn(n, device=device).to(torch.bfloat16)
            ref = sk24_mma.reference_int4(x, values, meta, gs, bias).float()
            for cfg in sk24_mma.int4_configs():
                rows.append(checked(
                    {"N": n, "K": k, "M": m, "dtype": "int4", "layout": "paired",
                     "config": list(cfg)}, ref,
                    functools.partial(sk24_mma._launch, sk24_mma.load(), x, values, meta, None,
                                      None, bias, cfg, gs)))
        bad = [r for r in rows if not r["ok"] and r["N"] == n]
        print(json.dumps({"check": f"{n}x{k}", "cases": len(rows), "bad": len(bad),
                          "first_bad": bad[:2]}), flush=True)
    return rows


def time_rows(device, shapes, ms, layout: str, sweep: bool = True) -> list[dict]:
    """Timing rows; ``sweep``: every working configuration, else the default one alone."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for name, n, k in shapes:
        w = masked_weight(n, k, "cpu", gen).to(device)
        w8, ws = fp8_weight(w)
        v16, m16 = sk24_mma.compress(w, layout)
        v8, m8 = sk24_mma.compress(w8, layout)
        copies = copies_for(n * k * 2)
        dense = [w] + [w.clone() for _ in range(copies - 1)]
        c16 = [(v16, m16)] + [(v16.clone(), m16.clone()) for _ in range(copies_for(
            n * k * 9 // 8) - 1)]
        c8 = [(v8, m8)] + [(v8.clone(), m8.clone()) for _ in range(copies_for(n * k * 5 // 8)
                                                                   - 1)]
        v8n, m8n = sk24_mma.compress(w8, "e4m3")
        c8n = [(v8n, m8n)] + [(v8n.clone(), m8n.clone()) for _ in range(
            copies_for(n * k * 5 // 8) - 1)]
        q4, s4 = rtn_int4(w.float(), 128)
        f4 = tuple(t.to(device) for t in sk24_mma.compress_int4(q4, s4))
        c4 = [f4] + [tuple(t.clone() for t in f4) for _ in range(copies_for(n * k * 2 // 5) - 1)]
        t4 = w4a16.pack_24(q4, s4)
        c4t = [t4] + [tuple(t.clone() for t in t4) for _ in range(copies_for(n * k * 2 // 5) - 1)]
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            row = {"shape": name, "N": n, "K": k, "M": m}
            dense_bytes = 2 * n * k + 2 * m * k + 2 * m * n
            us = time_rotating([functools.partial(F.linear, x, d) for d in dense])
            row["bf16_dense"] = {"us": us, "tb_s": dense_bytes / us / 1e6}
            x16 = x.to(torch.float8_e4m3fn).to(torch.float16)
            for dtype, sets, scale in (("bf16_2:4", c16, None), ("fp8_2:4", c8, ws),
                                       ("fp8h_2:4", c8, ws)):
                xw = x16 if dtype == "fp8h_2:4" else x
                nbytes = sk24_mma.bound_bytes(m, n, k, sets[0][0].dtype)
                best = None
                per = {}
                for cfg in (sk24_mma.CONFIGS if sweep else [sk24_mma.default_config(m, n, k)]):
                    way = "f16" if dtype == "fp8h_2:4" else "bf16"
                    if (n // 16) % cfg[2] or cfg not in sk24_mma.working(way):
                        continue
                    fns = [functools.partial(sk24_mma.launch, xw, v, mt, None, scale, None, cfg)
                           for v, mt in sets]
                    t = time_rotating(fns)
                    per["x".join(map(str, cfg))] = t
                    if best is None or t < best[1]:
                        best = (cfg, t)
                if best is None:  # every configuration failed its self-check this way
                    continue
                op_t = time_rotating([functools.partial(mma_op.sk24_mma_mm, xw, v, mt, None,
                                                        scale, None) for v, mt in sets])
                row[dtype] = {"us": best[1], "config": list(best[0]), "default_us": op_t,
                              "default_config": list(sk24_mma.default_config(m, n, k)),
                              "bytes": nbytes, "tb_s": nbytes / best[1] / 1e6,
                              "bound_share": nbytes / best[1] / 1e6 / bound_tbs(),
                              "over_dense": us / best[1], "default_over_dense": us / op_t,
                              "configs_us": per}
            if sk24_mma.e4m3_ok():  # fp8 x fp8: x quantized as an fp8 layer does
                x8 = x.to(torch.float8_e4m3fn)
                xs8 = torch.ones(m, 1, device=device)
                nbytes = n * k // 2 + n * k // 8 + m * k + 2 * m * n
                per, best = {}, None
                for cfg in sk24_mma.E4M3_CONFIGS:
                    t = time_rotating([functools.partial(sk24_mma.launch, x8, v, mt, xs8, ws,
                                                         None, cfg) for v, mt in c8n])
                    per["x".join(map(str, cfg))] = t
                    if best is None or t < best[1]:
                        best = (cfg, t)
                row["fp8x8_2:4"] = {"us": best[1], "config": list(best[0]), "bytes": nbytes,
                                    "tb_s": nbytes / best[1] / 1e6,
                                    "bound_share": nbytes / best[1] / 1e6 / bound_tbs(),
                                    "over_dense": us / best[1], "configs_us": per}
            if sk24_mma.int4_ok():  # W4A16 2:4, group 128, against the Triton kernel too
                nbytes = n * k // 4 + n * k // 8 + n * (k // 128) * 4 + 2 * m * k + 2 * m * n
                per, best = {}, None
                for cfg in (sk24_mma.candidates(c4[0][0]) if sweep else
                            [sk24_mma.default_config(m, n, k, int4=True)]):
                    t = time_rotating([functools.partial(sk24_mma.launch_int4, x, v, mt, gs,
                                                         None, cfg) for v, mt, gs in c4])
                    per["x".join(map(str, cfg))] = t
                    if best is None or t < best[1]:
                        best = (cfg, t)
                tri = time_rotating([functools.partial(int4_op.int4_24_mm, x, v, mt, sc, None)
                                     for v, mt, sc in c4t])
                row["int4_2:4"] = {"us": best[1], "config": list(best[0]), "bytes": nbytes,
                                   "tb_s": nbytes / best[1] / 1e6,
                                   "bound_share": nbytes / best[1] / 1e6 / bound_tbs(),
                                   "over_dense": us / best[1], "triton_us": tri,
                                   "triton_over_dense": us / tri, "configs_us": per}
            rows.append(row)
            print(json.dumps({"shape": name, "M": m, "dense_us": round(us, 2),
                              **{d: {kk: (round(v, 3) if isinstance(v, float) else v)
                                     for kk, v in row[d].items() if kk != "configs_us"}
                                 for d in ("bf16_2:4", "fp8_2:4", "fp8h_2:4", "fp8x8_2:4",
                                           "int4_2:4") if d in row}}),
                  flush=True)
        del dense, c16, c8, c8n, c4, c4t
        torch.cuda.empty_cache()
    return rows


def widen_rows(device, shapes) -> list[dict]:
    """The ``widen`` section's rows (see the module docstring)."""
    from sparsekit.accel.kernels.triton24 import format as sk24

    gen = torch.Generator().manual_seed(2)
    fused_fp8 = torch.compile(functools.partial(sk24.decompress, dtype=torch.bfloat16))
    fused_int4 = torch.compile(functools.partial(w4a16.dequantize_packed_24,
                                                 dtype=torch.bfloat16))
    rows = []
    for name, n, k in shapes:
        w = masked_weight(n, k, "cpu", gen)
        w8, _ = fp8_weight(w)
        q4, s4 = rtn_int4(w.float(), 128)
        fp8 = sk24.compress(w8.to(device))
        int4 = tuple(t.to(device) for t in w4a16.pack_24(q4, s4))
        row = {"shape": name, "N": n, "K": k}
        for way, args, new, old, nbytes in (
                ("fp8w", fp8, sk24_op.sk24_widen, fused_fp8, n * k // 2 + n * k // 8),
                ("int4", int4, int4_op.int4_24_widen, fused_int4, n * k // 4 + n * k // 8)):
            moved = nbytes + 2 * n * k  # values and metadata read, bf16 written (int4's scales
            # left out: 1/64 byte a weight)
            sets = [args] + [tuple(t.clone() for t in args) for _ in range(copies_for(moved) - 1)]
            entry = {"equal": bool(torch.equal(new(*args), old(*args)))}
            for key, fn in (("op", new), ("fused", old)):
                us = time_rotating([functools.partial(fn, *a) for a in sets])
                entry[key] = {"us": us, "gb_s": moved / us / 1e3}
            entry["op_over_fused"] = entry["fused"]["us"] / entry["op"]["us"]
            row[way] = entry
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for d in ("bf16_2:4", "fp8_2:4", "fp8h_2:4", "fp8x8_2:4", "int4_2:4"):
        if not any(d in r for r in rows):
            continue
        rows_d = [r for r in rows if d in r]
        for key in ("over_dense", "default_over_dense"):
            small = [r[d][key] for r in rows_d if r["M"] <= 16 and key in r[d]]
            if small:
                out[f"{d}_{key}_geo_m_le_16"] = math.exp(sum(map(math.log, small)) / len(small))
        out[f"{d}_target"] = TARGETS.get("fp8_2:4" if d.startswith("fp8") else d)
        out[f"{d}_rows_under_80pct"] = sum(r[d]["bound_share"] < 0.8 for r in rows_d)
        by_m = {}
        for r in rows_d:
            by_m.setdefault(r["M"], []).append(r[d]["over_dense"])
        out[f"{d}_geo_by_m"] = {m: math.exp(sum(map(math.log, v)) / len(v))
                                for m, v in sorted(by_m.items())}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="check,time")
    ap.add_argument("--shapes", default="all", help="comma-separated shape names, or all")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--layout", default="paired", choices=sk24_mma.META_LAYOUTS,
                    help="time: the metadata layout")
    ap.add_argument("--configs", default="all", choices=("all", "default"),
                    help="time: every working configuration, or the default one alone")
    ap.add_argument("--out", default="bench_sk24_mma.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.exit(2, "bench_sk24_mma: needs a CUDA GPU (sm_90)\n")
    device = torch.device("cuda")
    t0 = time.perf_counter()
    lib = sk24_mma.load()
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "load_s": time.perf_counter() - t0, "library": str(libload.LIB_DIR),
                 "available": lib is not None, "reason": sk24_mma.reason()}
    print(json.dumps(out), flush=True)
    if lib is None:
        Path(args.out).write_text(json.dumps(out, indent=1))
        return out
    sections = args.sections.split(",")
    if "check" in sections:
        out["check"] = check_rows(device)
        ways = dict.fromkeys((r["dtype"], r["layout"]) for r in out["check"])
        out["check_ok"] = {f"{d}_{lay}": all(r["ok"] for r in out["check"]
                                             if r["dtype"] == d and r["layout"] == lay)
                           for d, lay in ways}
        print(json.dumps({"check_ok": out["check_ok"]}), flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    if "time" in sections:
        shapes = SHAPES if args.shapes == "all" else [s for s in SHAPES
                                                      if s[0] in args.shapes.split(",")]
        rows: list = []
        out["time"] = rows
        ms = [int(m) for m in args.ms.split(",")]
        for shape in shapes:
            rows += time_rows(device, [shape], ms, args.layout, args.configs == "all")
            out["summary"] = summary(rows)
            Path(args.out).write_text(json.dumps(out, indent=1))
        print(json.dumps({"summary": out["summary"]}), flush=True)
    if "widen" in sections:
        shapes = SHAPES if args.shapes == "all" else [s for s in SHAPES
                                                      if s[0] in args.shapes.split(",")]
        out["widen"] = widen_rows(device, shapes)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
