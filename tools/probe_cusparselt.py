"""Exploratory H200 probe: what cuSPARSELt (through torch) gives beyond what sparsekit uses.

    python tools/probe_cusparselt.py --out-dir out     # CUDA only; writes probe.json

Two questions, on the Llama-7B/70B MLP shapes at M in {1024, 4096, 16384}:
1. split-k: does ``split_k`` / ``split_k_mode`` on top of the best alg_id make bf16 2:4 faster?
2. static fp8: with a per-tensor weight scale and a calibrated (static) activation scale, the
   whole dequantization is one scalar; torch passes a one-element ``alpha`` to cuSPARSELt as a
   host scalar. Does that work from a CPU tensor under CUDA-graph capture, and how fast is
   "one cast pass + GEMM (alpha and bias fused)" against the dynamic path (per-token scales,
   Triton epilogue)?
(Its first run also measured ViT-B's precision floors; tools/bench_gpu.py now does that, as
its ``bf16_dense`` and ``fp8_dense`` rows.)
Every time is a CUDA-graph replay median; ratios are to cuBLAS bf16 dense in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsekit.accel import kernels
from sparsekit.quant.formats import FP8 as FP8_FORMAT
from sparsekit.nn.timing import graph_time_us
from sparsekit.prune.patterns import nm_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import geomean, rel_err  # noqa: E402

SHAPES = [("Llama-7B up", 4096, 11008), ("Llama-7B down", 11008, 4096),
          ("Llama-70B up", 8192, 28672), ("Llama-70B down", 28672, 8192)]
FP8 = torch.float8_e4m3fn


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _quant_static_kernel(x_ptr, q_ptr, n, inv, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32) * inv
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        tl.store(q_ptr + offs, v.to(tl.float8e4nv), mask=offs < n)
except ImportError:  # the probe needs CUDA (and so triton) anyway
    triton = None


def quant_static(x: torch.Tensor, inv_scale: float) -> torch.Tensor:
    """fp8 with a calibrated scale: saturate(x * inv_scale), one Triton pass."""
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    _quant_static_kernel[(triton.cdiv(x.numel(), 4096),)](x, q, x.numel(), float(inv_scale),
                                                          BLOCK=4096)
    return q


def t_us(fn) -> float:
    return graph_time_us(fn, replays=5)


def scan(fn_for_alg, max_alg: int = 64, **kw) -> dict[int, float]:
    out = {}
    for a in range(max_alg):
        try:
            fn_for_alg(a, **kw)()
            torch.cuda.synchronize()
        except RuntimeError:
            break
        out[a] = t_us(fn_for_alg(a, **kw))
    return out


def gemm_probe(name: str, k: int, n: int, m: int) -> dict:
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda") * 0.02
    w = w * nm_mask(w.abs(), 2, 4)  # magnitude 2:4
    bias = torch.randn(n, device="cuda") * 0.1
    x = torch.randn(m, k, device="cuda")
    wb, xb, bb = w.bfloat16(), x.bfloat16(), bias.bfloat16()
    row = {"layer": name, "N": n, "K": k, "M": m}
    row["dense_us"] = t_us(lambda: F.linear(xb, wb, bb))

    packed = torch._cslt_compress(wb)

    def bf16(a, split_k=1, mode=-1):
        return lambda: torch._cslt_sparse_mm(packed, xb.t(), bb, transpose_result=True, alg_id=a,
                                             split_k=split_k, split_k_mode=mode)
    algs = scan(bf16)
    best = min(algs, key=algs.get)
    row["bf16_best_alg"], row["bf16_best_us"] = best, algs[best]
    splits = {}
    for a in sorted(algs, key=algs.get)[:3]:
        for sk in (2, 3, 4, 6, 8):
            for mode in (0, 1):
                try:
                    bf16(a, sk, mode)()
                    torch.cuda.synchronize()
                except RuntimeError:
                    continue
                splits[f"{a}/{sk}/{mode}"] = t_us(bf16(a, sk, mode))
    if splits:
        bs = min(splits, key=splits.get)
        row["bf16_split_best"], row["bf16_split_best_us"] = bs, splits[bs]
    row["bf16_ratio"] = row["dense_us"] / algs[best]
    row["bf16_split_ratio"] = row["dense_us"] / min([algs[best], *splits.values()])

    # static fp8: per-tensor weight scale, calibrated activation scale, one scalar alpha
    sw = float(w.abs().amax()) / FP8_FORMAT.qmax
    sa = float(x.abs().amax()) / FP8_FORMAT.qmax
    wq = (w / sw).clamp(-448, 448).to(FP8)
    p8 = torch._cslt_compress(wq)
    alpha = torch.tensor([sa * sw], dtype=torch.float32)  # CPU: read on the host, no sync

    def fp8_static(a, with_quant=True):
        q0 = quant_static(xb, 1.0 / sa)

        def f():
            q = quant_static(xb, 1.0 / sa) if with_quant else q0
            return torch._cslt_sparse_mm(p8, q.t(), bb, alpha, out_dtype=torch.bfloat16,
                                         transpose_result=True, alg_id=a)
        return f
    try:
        y = fp8_static(0)()
        q = quant_static(xb, 1.0 / sa)
        ref = (q.float() @ wq.float().t()) * (sa * sw) + bb.float()
        row["fp8_static_vs_ref"] = rel_err(y, ref)
        row["fp8_static_vs_fp32"] = rel_err(y, x @ w.t() + bias)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fp8_static(0)()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            yg = fp8_static(0)()
        g.replay()
        torch.cuda.synchronize()
        row["fp8_static_graph_vs_eager"] = rel_err(yg, y)
        algs8 = scan(fp8_static)
        b8 = min(algs8, key=algs8.get)
        row["fp8_static_alg"], row["fp8_static_us"] = b8, algs8[b8]
        row["fp8_static_gemm_only_us"] = t_us(fp8_static(b8, with_quant=False))
        row["fp8_static_ratio"] = row["dense_us"] / algs8[b8]
    except RuntimeError as e:
        row["fp8_static_error"] = str(e)[:300]
    # the current dynamic fp8 2:4 module, best alg
    lin = torch.nn.Linear(k, n, device="cuda")
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(bias)
    mod = kernels.FP8Sparse24(lin)

    def dyn(a):
        mod.alg_id = a
        return lambda: mod(xb)
    algsd = scan(dyn)
    bd = min(algsd, key=algsd.get)
    row["fp8_dynamic_us"] = algsd[bd]
    row["fp8_dynamic_ratio"] = row["dense_us"] / algsd[bd]
    mod.alg_id = bd
    row["fp8_dynamic_vs_fp32"] = rel_err(mod(xb), x @ w.t() + bias)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--tokens", default="1024,4096,16384")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_cusparselt: needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows, res = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "cusparselt": torch.backends.cusparselt.version()}
    for m in [int(t) for t in args.tokens.split(",")]:
        for name, k, n in SHAPES:
            rows.append(gemm_probe(name, k, n, m))
            print(json.dumps(rows[-1]), flush=True)
            res["rows"] = rows
            (args.out_dir / "probe.json").write_text(json.dumps(res, indent=1))
    for key in ("bf16_ratio", "bf16_split_ratio", "fp8_static_ratio", "fp8_dynamic_ratio"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            res[f"geomean_{key}"] = geomean(vals)
    (args.out_dir / "probe.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
