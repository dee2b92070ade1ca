"""Builds sparsekit's own cuSPARSELt binding (:mod:`sparsekit.accel.cslt_ext`: a 2:4 matmul
whose epilogue takes a host scalar alpha, a bias and GELU) and measures it against torch's
``_cslt_sparse_mm`` followed by the scale/bias/GELU epilogue compiled by inductor (the
per-channel fp8 2:4 layers' path). Correctness
against a float64 reference of the same 8-bit values, CUDA-graph capture, and microseconds
under graph replay, each path at its fastest cuSPARSELt algorithm. JSON to --out.

    python tools/probe_cslt_epilogue.py --out probe_cslt_epilogue.json

Shapes: BERT-large's at 8x512 tokens (q/k/v 1024x1024, fc1 4096x1024, fc2 1024x4096) and a
Llama-3-8B MLP (14336x4096) at 4096 tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sparsekit.accel import cslt_ext  # noqa: E402
from sparsekit.nn.timing import graph_time_us  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
from probe_cslt import fp8, two_four  # noqa: E402

SHAPES = (("bert_qkv", 4096, 1024, 1024), ("bert_fc1", 4096, 4096, 1024),
          ("bert_fc2", 4096, 1024, 4096), ("llama_up", 4096, 14336, 4096))
MAX_ALG = 16


def build():
    ext = cslt_ext.load()
    if ext is None:
        raise SystemExit(f"probe_cslt_epilogue.py: sparsekit's binding did not build: "
                         f"{cslt_ext.reason()}")
    return ext


def gelu_erf(t: torch.Tensor) -> torch.Tensor:
    return 0.5 * t * (1.0 + torch.erf(t / math.sqrt(2.0)))


def gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    return 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t ** 3)))


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def fastest(make, algs=range(MAX_ALG)) -> dict:
    """{'alg_id', 'us', 'fn'} of the fastest algorithm that runs (make(alg) -> callable)."""
    best = None
    tried = {}
    for alg in algs:
        fn = make(alg)
        try:
            fn()
            torch.cuda.synchronize()
        except RuntimeError:
            break
        us = graph_time_us(fn)
        tried[alg] = us
        if best is None or us < best["us"]:
            best = {"alg_id": alg, "us": us, "fn": fn}
    if best is None:
        raise RuntimeError("no algorithm ran")
    best["tried"] = tried
    return best


def failure(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def compare(ours, today, ref: torch.Tensor, ours_also: dict | None = None) -> dict:
    """Each path at its fastest algorithm: microseconds and error against ``ref`` (and, for
    ours, against each of ``ours_also``), plus today's time over ours."""
    row: dict = {}
    for label, make in (("ours", ours), ("today", today)):
        try:
            best = fastest(make)
            y = best["fn"]().float()
            row[label] = {"us": best["us"], "alg_id": best["alg_id"], "rel_err": rel(y, ref),
                          "algs_tried": len(best["tried"])}
            if label == "ours":
                row[label].update({k: rel(y, r) for k, r in (ours_also or {}).items()})
        except Exception as e:  # noqa: BLE001  (what fails is the finding)
            row[label] = {"error": failure(e)}
    if "us" in row["ours"] and "us" in row["today"]:
        row["speedup"] = row["today"]["us"] / row["ours"]["us"]
    return row


def case(ext, out: dict, name: str, m: int, n: int, k: int) -> None:
    """One shape, static per-tensor activation scale, per-tensor weight scale (alpha = one
    scalar); rows: bias only (q/k/v-like) and bias + GELU (fc1-like), bf16 out."""
    w = two_four(n, k, "cuda")
    wq, sw = fp8(w)
    x = torch.randn(m, k, device="cuda")
    xq, sx = fp8(x)
    bias = (torch.randn(n, device="cuda") * 0.1).to(torch.bfloat16)
    packed = torch._cslt_compress(wq)
    alpha = (sx * sw).item()
    acc = xq.double() @ wq.double().t()
    lin = acc * alpha + bias.double()
    scale_t = (sx * sw).reshape(1)
    res: dict = {}
    for act in ("none", "gelu"):
        ref = lin if act == "none" else gelu_erf(lin)
        gelu = act == "gelu"

        def ours(alg, gelu=gelu):
            return lambda: ext.sparse24_mm_alpha(packed, xq, n, bias, alpha, gelu, alg)

        def today_fn(acc_bf16, gelu=gelu):
            y = acc_bf16.float() * scale_t + bias.float()
            return torch.nn.functional.gelu(y).to(torch.bfloat16) if gelu else \
                y.to(torch.bfloat16)

        epi = torch.compile(today_fn, dynamic=False)

        def today(alg, epi=epi):
            return lambda: epi(torch._cslt_sparse_mm(packed, xq.t(), None, None, torch.bfloat16,
                                                     True, alg))

        row = compare(ours, today, ref,
                      {"rel_err_vs_tanh_gelu": gelu_tanh(lin)} if gelu else None)
        res[act] = row
    # captured once, replayed: the same numbers
    try:
        static_x = xq.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ext.sparse24_mm_alpha(packed, static_x, n, bias, alpha, False, 0)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            y = ext.sparse24_mm_alpha(packed, static_x, n, bias, alpha, False, 0)
        graph.replay()
        torch.cuda.synchronize()
        res["graph_replay_rel_err"] = rel(y, lin)
    except Exception as e:  # noqa: BLE001
        res["graph_replay_error"] = failure(e)
    out[name] = res
    print(name, json.dumps(res), flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe_cslt_epilogue.json")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_cslt_epilogue.py: needs a CUDA GPU (it builds a cuSPARSELt "
                         "extension)")
    out: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                 "cusparselt": torch.backends.cusparselt.version()}
    t0 = time.perf_counter()
    ext = build()
    out["build_s"] = time.perf_counter() - t0
    print(json.dumps(out), flush=True)
    torch.manual_seed(0)
    wanted = set(args.shapes.split(","))
    for name, m, n, k in SHAPES:
        if name in wanted:
            case(ext, out, name, m, n, k)
            Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
