"""Builds tools/cslt_ext (a cuSPARSELt 2:4 matmul whose epilogue takes a host scalar alpha, a
bias and GELU) on the GPU machine and measures it against what sparsekit runs today: torch's
``_cslt_sparse_mm`` followed by the scale/bias/GELU epilogue compiled by inductor. Correctness
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
from sparsekit.accel.timing import graph_time_us  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
from probe_cslt import fp8, two_four  # noqa: E402

SHAPES = (("bert_qkv", 4096, 1024, 1024), ("bert_fc1", 4096, 4096, 1024),
          ("bert_fc2", 4096, 1024, 4096), ("llama_up", 4096, 14336, 4096))
MAX_ALG = 16


def cusparselt_dirs() -> tuple[str, str]:
    """(include dir, lib dir) of the cuSPARSELt that torch loads (the nvidia-cusparselt wheel
    beside torch)."""
    for entry in map(Path, sys.path):
        for base in sorted(entry.glob("nvidia/cusparselt*")):
            if (base / "include" / "cusparseLt.h").exists():
                return str(base / "include"), str(base / "lib")
    raise SystemExit("probe_cslt_epilogue.py: no nvidia/cusparselt*/include/cusparseLt.h on "
                     "sys.path (the nvidia-cusparselt wheel torch uses)")


def build():
    from torch.utils.cpp_extension import load

    inc, lib = cusparselt_dirs()
    # CUDA headers from the nvidia wheels where the toolkit lacks them (cusparse.h, for ATen)
    wheels = Path(inc).parents[1]
    extra = [str(d) for d in sorted(wheels.glob("*/include")) if (d / "cusparse.h").exists()]
    return load(name="sk_cslt_epilogue", sources=[str(ROOT / "tools/cslt_ext/cslt_epilogue.cpp")],
                extra_include_paths=[inc, *extra], with_cuda=True, verbose=False,
                extra_ldflags=[f"-L{lib}", "-l:libcusparseLt.so.0", f"-Wl,-rpath,{lib}"])


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


def fp8_out_rows(ext, packed, xq, n, bias, alpha, scale_t, acc, lin) -> dict:
    """fp8 output for the next layer: (a) its static input scale folded into alpha (no
    activation); (b) bias + GELU, then the next layer's quantization by cuSPARSELt's D scale
    (fc1 -> fc2 in BERT/ViT), against what runs today: torch's binding, then one compiled
    kernel for scale + bias + GELU + quantize. Which way cuSPARSELt applies the D scale
    (times or divided by) is read off the errors."""
    rows: dict = {}
    s_lin = (lin.abs().amax() / 448.0).item()
    try:
        y8 = ext.sparse24_mm_epilogue(packed, xq, n, None, alpha / s_lin, False,
                                      torch.float8_e4m3fn, 0)
        rows["alpha_folded"] = {"rel_err": rel(y8.float(), (acc * alpha / s_lin).clamp(-448, 448))}
    except Exception as e:  # noqa: BLE001
        rows["alpha_folded"] = {"error": failure(e)}
    g = gelu_erf(lin)
    s_next = (g.abs().amax() / 448.0).item()
    inv = torch.tensor([1.0 / s_next], device="cuda")

    def ours(alg):
        return lambda: ext.sparse24_mm_epilogue(packed, xq, n, bias, alpha, True,
                                                torch.float8_e4m3fn, alg, inv)

    def today_fn(acc_bf16):
        y = torch.nn.functional.gelu(acc_bf16.float() * scale_t + bias.float())
        return (y / s_next).clamp(-448, 448).to(torch.float8_e4m3fn)

    epi = torch.compile(today_fn, dynamic=False)

    def today(alg):
        return lambda: epi(torch._cslt_sparse_mm(packed, xq.t(), None, None, torch.bfloat16,
                                                 True, alg))

    row = compare(ours, today, (g / s_next).clamp(-448, 448), {
        "rel_err_if_d_scale_divides": (g * s_next).clamp(-448, 448),
        "rel_err_vs_tanh_gelu": (gelu_tanh(lin) / s_next).clamp(-448, 448)})
    rows["bias_gelu_d_scale"] = row
    return rows


def case(ext, out: dict, name: str, m: int, n: int, k: int) -> None:
    """One shape, static per-tensor activation scale, per-tensor weight scale (alpha = one
    scalar); rows: bias only (q/k/v-like) and bias + GELU (fc1-like), bf16 out; fp8 out."""
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
            return lambda: ext.sparse24_mm_epilogue(packed, xq, n, bias, alpha, gelu,
                                                    torch.bfloat16, alg)

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
    res["fp8_out"] = fp8_out_rows(ext, packed, xq, n, bias, alpha, scale_t, acc, lin)
    # captured once, replayed: the same numbers
    try:
        static_x = xq.clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ext.sparse24_mm_epilogue(packed, static_x, n, bias, alpha, False, torch.bfloat16, 0)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            y = ext.sparse24_mm_epilogue(packed, static_x, n, bias, alpha, False,
                                         torch.bfloat16, 0)
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
