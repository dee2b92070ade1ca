"""Does the output layout change cuSPARSELt's 2:4 speed? A probe for the GEMM-level targets.

    python tools/probe_layout.py --out probe_layout.json     # CUDA only

sparsekit's 2:4 layers call ``torch._cslt_sparse_mm(packed, x.t(), transpose_result=True)``:
the product is written (M, N) row-major, as the next op reads it. With
``transpose_result=False`` cuSPARSELt writes (N, M) row-major instead (the transposed problem,
for which it may pick other kernels); a consumer would then read it transposed (an elementwise
consumer for free, inductor tiles it; a GEMM consumer after a copy). For each Llama-7B/70B MLP
shape at M in {1024, 4096, 16384} (the GEMM bench's geo-mean set) and each input dtype (bf16;
fp8 e4m3 with a bf16 product), every cuSPARSELt algorithm is timed under CUDA-graph replay in
both layouts, and the fastest of each is given as a ratio to cuBLAS bf16 dense timed in the
same run, with and without the copy back to (M, N). ``--cutlass`` adds torch's other 2:4
backend for bf16 (``SparseSemiStructuredTensorCUTLASS``, its CUTLASS kernels, through
``F.linear``), timed the same way (torch 2.11 refuses it on the H200: its kernels run on
compute capability 8.x only; the refusal is recorded). JSON to --out; the geo-means are
printed.

    python tools/probe_layout.py --dtypes bf16 --cutlass --out probe_cutlass.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from sparsekit.nn.timing import graph_time_us
from sparsekit.prune.patterns import nm_mask

SHAPES = {"Llama-7B up": (4096, 11008), "Llama-7B down": (11008, 4096),
          "Llama-70B up": (8192, 28672), "Llama-70B down": (28672, 8192)}  # name: (K, N)
TOKENS = (1024, 4096, 16384)
MAX_ALG = 64


def best_alg(fn_of_alg) -> tuple[float, int]:
    """(fastest microseconds, its alg_id) over every algorithm the shape accepts."""
    best = (math.inf, -1)
    for alg in range(MAX_ALG):
        try:
            fn_of_alg(alg)
            torch.cuda.synchronize()
        except RuntimeError:
            break
        t = graph_time_us(lambda alg=alg: fn_of_alg(alg), replays=7)
        best = min(best, (t, alg))
    return best


def probe_shape(k: int, n: int, m: int, dtype: torch.dtype, cutlass: bool = False) -> dict:
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda")
    w = (w * nm_mask(w.abs(), 2, 4)).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dense_us = graph_time_us(lambda: F.linear(x, w))
    if dtype == torch.bfloat16:
        xin, win, out = x, w, None
    else:
        xin, win, out = x.to(dtype), w.to(dtype), torch.bfloat16
    packed = torch._cslt_compress(win)
    row = {"K": k, "N": n, "M": m, "dtype": str(dtype), "dense_us": dense_us}
    for name, tr in (("row_major_MN", True), ("row_major_NM", False)):
        us, alg = best_alg(lambda a, tr=tr: torch._cslt_sparse_mm(
            packed, xin.t(), None, transpose_result=tr, alg_id=a, out_dtype=out))
        row[name] = {"us": us, "alg_id": alg, "ratio": dense_us / us}
        if not tr:  # what a consumer needing (M, N) contiguous would add
            copy_us = graph_time_us(lambda a=alg: torch._cslt_sparse_mm(
                packed, xin.t(), None, transpose_result=False, alg_id=a,
                out_dtype=out).t().contiguous())
            row[name]["with_copy_ratio"] = dense_us / copy_us
    # both layouts agree with a float32 reference (the layouts must be the same product)
    ref = xin.float() @ win.float().t()
    if cutlass and dtype == torch.bfloat16:
        from torch.sparse import SparseSemiStructuredTensorCUTLASS

        try:  # torch 2.11 refuses it on the H200 (compute capability 8.x only), 2026-12-04
            wc = SparseSemiStructuredTensorCUTLASS.from_dense(w)
            y = F.linear(x, wc)
            us = graph_time_us(lambda: F.linear(x, wc))
            row["cutlass"] = {"us": us, "ratio": dense_us / us,
                              "rel_err": ((y.float() - ref).norm() / ref.norm()).item()}
        except RuntimeError as e:
            row["cutlass_refused"] = str(e).strip().splitlines()[0][:200]
    for tr in (True, False):
        y = torch._cslt_sparse_mm(packed, xin.t(), None, transpose_result=tr,
                                  alg_id=row["row_major_MN" if tr else "row_major_NM"]["alg_id"],
                                  out_dtype=out)
        y = y if tr else y.t()
        row["rel_err_" + ("MN" if tr else "NM")] = ((y.float() - ref).norm() / ref.norm()).item()
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe_layout.json")
    ap.add_argument("--dtypes", default="bf16,fp8", help="comma list of bf16, fp8")
    ap.add_argument("--cutlass", action="store_true",
                    help="also time torch's CUTLASS 2:4 backend (bf16)")
    args = ap.parse_args(argv)
    names = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    bad = set(args.dtypes.split(",")) - set(names)
    if bad:
        raise SystemExit(f"--dtypes: unknown {sorted(bad)}; allowed: bf16, fp8")
    dtypes = [names[d] for d in args.dtypes.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("probe_layout.py: needs a CUDA GPU (it calls cuSPARSELt)")
    rows = []
    for dtype in dtypes:
        for name, (k, n) in SHAPES.items():
            for m in TOKENS:
                r = {"shape": name, **probe_shape(k, n, m, dtype, args.cutlass)}
                rows.append(r)
                print(f"{name} {dtype} M={m}: MN {r['row_major_MN']['ratio']:.3f} "
                      f"NM {r['row_major_NM']['ratio']:.3f} "
                      f"(+copy {r['row_major_NM']['with_copy_ratio']:.3f})"
                      + (f" cutlass {r['cutlass']['ratio']:.3f}" if "cutlass" in r else "")
                      + (f" cutlass refused: {r['cutlass_refused']}"
                         if "cutlass_refused" in r else ""),
                      flush=True)
                with open(args.out, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "cusparselt": torch.backends.cusparselt.version(), "rows": rows},
                              f, indent=1)
    summary = {}

    def geo(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs))

    for dtype in map(str, dtypes):
        mine = [r for r in rows if r["dtype"] == dtype]
        for lay in ("row_major_MN", "row_major_NM"):
            summary[f"{dtype}|{lay}"] = geo([r[lay]["ratio"] for r in mine])
        summary[f"{dtype}|best_of_both"] = geo(
            [max(r["row_major_MN"]["ratio"], r["row_major_NM"]["ratio"]) for r in mine])
        if any("cutlass" in r for r in mine):
            summary[f"{dtype}|cutlass"] = geo([r["cutlass"]["ratio"] for r in mine])
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "cusparselt": torch.backends.cusparselt.version(), "rows": rows,
                   "summary": summary}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
