"""Decode GEMMs with int4 weights (W4A16): sparsekit's int4 2:4 and int4 dense Triton kernels
against cuBLAS bf16 ``F.linear``, at decode token counts on Llama shapes.

    python tools/bench_decode_gemm_int4.py --out /tmp/int4_decode.json         # CUDA GPU
    python tools/bench_decode_gemm_int4.py --smoke --out /tmp/int4_smoke.json  # CPU, seconds

For each weight shape (N x K: Llama-3-8B's fused q/k/v, o, fused gate/up and down; Llama-70B's
fused gate/up and down) and token count M it times ``bf16_dense`` (``F.linear``, cuBLAS),
``int4_dense`` (``sparsekit::int4_mm``) and ``int4_2:4`` (``sparsekit::int4_24_mm``) on one
random 2:4 weight, quantized to int4 by round to nearest (group ``--group-size``, float32
scales). Each call reads its weight from HBM: the timed CUDA graph cycles through enough copies
of the weight to exceed twice the L2 cache. Reported per variant: microseconds per call, the
bytes it must move (packed weight with metadata and scales, x and y), the TB/s that gives, its
percentage of ``--bound-tbps`` (the H200's 4.8 TB/s), the speedup over bf16, and the relative
error of its output against a float32 product with the dequantized weight (bf16's against the
bf16 weight). ``--smoke`` runs tiny shapes on CPU, where the ops are the plain-torch
references: it checks the pipeline, not speed.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsekit.accel.kernels.int4 import op as int4_op
from sparsekit.accel import layers_int4
from sparsekit.accel.kernels.int4 import format as w4a16
from sparsekit.nn.timing import graph_time_us, l2_copies, time_ms

SHAPES = {  # name: (N, K) of a weight (out x in)
    "llama3-8b.qkv": (6144, 4096),
    "llama3-8b.o": (4096, 4096),
    "llama3-8b.gate_up": (28672, 4096),
    "llama3-8b.down": (4096, 14336),
    "llama-70b.gate_up": (57344, 8192),
    "llama-70b.down": (8192, 28672),
}
SMOKE_SHAPES = {"tiny.a": (96, 128), "tiny.b": (64, 256)}
VARIANTS = ("bf16_dense", "int4_dense", "int4_2:4")


def weight_24(n: int, k: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """A random bf16 (N, K) weight with the two largest of every four along K kept."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k // 4, 4, device=device, generator=g)
    keep = w.abs().topk(2, dim=-1).indices
    return (w * torch.zeros_like(w).scatter_(-1, keep, 1.0)).reshape(n, k).bfloat16()


def time_us(calls: list, device: torch.device) -> float:
    """Microseconds per call: a CUDA graph replaying every call in ``calls`` (each on its own
    weight copy) on CUDA; the median of ``perf_counter`` over repeats of the first on CPU."""
    if device.type != "cuda":
        return time_ms(calls[0], device, warmup=1, repeats=3) * 1e3
    it = iter(range(1 << 62))
    return graph_time_us(lambda: calls[next(it) % len(calls)](), calls=len(calls))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    return ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bench_shape(name: str, n: int, k: int, ms: tuple, group: int, device: torch.device,
                bound_tbps: float, log) -> list[dict]:
    w = weight_24(n, k, device)
    q, scales = layers_int4.rtn_int4(w, group)
    v24, meta, _ = w4a16.pack_24(q, scales)
    vd, _ = w4a16.pack(q, scales)
    wdq = w4a16.dequantize(q, scales)  # float32, for the reference
    weights = {  # variant: (packed tensors, op)
        "bf16_dense": ((w,), lambda x, t: F.linear(x, t[0])),
        "int4_dense": ((vd, scales), lambda x, t: int4_op.int4_mm(x, t[0], t[1], None)),
        "int4_2:4": ((v24, meta, scales), lambda x, t: int4_op.int4_24_mm(x, *t, None)),
    }
    wbytes = {v: sum(t.numel() * t.element_size() for t in weights[v][0]) for v in VARIANTS}
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=device).bfloat16()
        row = {"shape": name, "N": n, "K": k, "M": m, "variants": {}}
        for v in VARIANTS:
            tensors, op = weights[v]
            copies = [tensors] + [tuple(t.clone() for t in tensors)
                                  for _ in range(l2_copies(wbytes[v], device) - 1)]
            y = op(x, tensors)  # first call: Triton compiles and autotunes here
            ref = x.float() @ (w.float() if v == "bf16_dense" else wdq).t()
            us = time_us([functools.partial(op, x, t) for t in copies], device)
            nbytes = wbytes[v] + m * k * 2 + m * n * 2
            tbps = nbytes / us / 1e6
            row["variants"][v] = {"us": round(us, 3), "bytes": nbytes, "tbps": round(tbps, 4),
                                  "pct_bound": round(100 * tbps / bound_tbps, 2),
                                  "rel_err": rel_err(y, ref), "weight_copies": len(copies)}
            del copies
        base = row["variants"]["bf16_dense"]["us"]
        for v in VARIANTS:
            row["variants"][v]["speedup"] = round(base / row["variants"][v]["us"], 4)
        log(f"{name} {n}x{k} M={m}: " + ", ".join(
            f"{v} {r['us']:.1f} us {r['tbps']:.2f} TB/s ({r['pct_bound']:.0f}%) x{r['speedup']:.2f}"
            for v, r in row["variants"].items()))
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Geometric-mean speedup over bf16 and mean % of the bound, per variant and M."""
    out: dict = {}
    for m in sorted({r["M"] for r in rows}):
        sel = [r for r in rows if r["M"] == m]
        for v in VARIANTS[1:]:
            sp = [r["variants"][v]["speedup"] for r in sel]
            out[f"M{m}.{v}.speedup_geomean"] = round(math.exp(sum(map(math.log, sp)) / len(sp)), 4)
            out[f"M{m}.{v}.pct_bound_mean"] = round(
                sum(r["variants"][v]["pct_bound"] for r in sel) / len(sel), 2)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI)")
    ap.add_argument("--tokens", default="1,4,16,32", help="comma-separated M values")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"from {', '.join(SHAPES)}")
    ap.add_argument("--group-size", type=int, default=w4a16.GROUP_SIZE)
    ap.add_argument("--bound-tbps", type=float, default=4.8, help="HBM bandwidth bound, TB/s")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_decode_gemm_int4 needs a CUDA GPU; use --smoke on CPU")
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        shapes, ms = SMOKE_SHAPES, (1, 4)
    else:
        unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
        if unknown:
            raise SystemExit(f"--shapes: unknown {unknown}; allowed: {', '.join(SHAPES)}")
        shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
        ms = tuple(int(t) for t in args.tokens.split(","))
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
           platform.processor() or "cpu",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "group_size": args.group_size,
           "bound_tbps": args.bound_tbps, "smoke": args.smoke, "rows": []}
    with torch.no_grad():
        for name, (n, k) in shapes.items():
            res["rows"] += bench_shape(name, n, k, ms, args.group_size, device, args.bound_tbps,
                                       print)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    res["summary"] = summarize(res["rows"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res["summary"], indent=1))
    return res


if __name__ == "__main__":
    main()
