"""What torch's cuSPARSELt binding (``torch._cslt_sparse_mm``) accepts on this GPU, and what it
costs: a scalar alpha (a one-element CPU tensor, read on the host, so CUDA graphs can capture
it) and a bias inside the fp8 2:4 GEMM's epilogue, against the scale and bias applied by a
separate kernel; split-K at decode sizes. One short run on the device; JSON to --out.

    python tools/probe_cslt.py --out probe_cslt.json

Each case records whether it ran, its error against a float32 reference of the same 8-bit
values, and (timed cases) microseconds per call under CUDA-graph replay.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")
from sparsekit.nn.timing import graph_time_us  # noqa: E402


def two_four(n: int, k: int, device: str) -> torch.Tensor:
    w = torch.randn(n, k, device=device)
    g = w.reshape(n, -1, 4)
    keep = g.abs().topk(2, dim=-1).indices
    return (g * torch.zeros_like(g).scatter_(-1, keep, 1.0)).reshape(n, k)


def fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = t.abs().amax().float() / 448.0
    return (t / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def run_case(out: dict, name: str, fn, ref: torch.Tensor, time_it: bool = False) -> None:
    try:
        y = fn()
        torch.cuda.synchronize()
        row = {"ok": True, "rel_err": ((y.float() - ref).norm() / ref.norm()).item()}
        if time_it:
            row["us"] = graph_time_us(fn)
    except Exception as e:  # noqa: BLE001  (recording what the binding refuses is the point)
        row = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    out[name] = row
    print(name, json.dumps(row), flush=True)


def epilogue_cases(out: dict, m: int, n: int, k: int) -> None:
    w = two_four(n, k, "cuda")
    wq, sw = fp8(w)
    xq, sx = fp8(torch.randn(m, k, device="cuda"))
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    acc = xq.float() @ wq.float().t()
    ref = acc * (sx * sw) + bias.float()
    packed = torch._cslt_compress(wq)
    alpha_cpu = torch.tensor([(sx * sw).item()])
    scale = (sx * sw).reshape(1)
    tag = f"M{m}_N{n}_K{k}"
    mm = torch._cslt_sparse_mm
    run_case(out, f"{tag}_alpha_cpu_bias_in_gemm",
             lambda: mm(packed, xq.t(), bias, alpha_cpu, torch.bfloat16, True), ref, True)
    run_case(out, f"{tag}_alpha_cpu_bias_after",
             lambda: mm(packed, xq.t(), None, alpha_cpu, torch.bfloat16, True) + bias, ref, True)
    run_case(out, f"{tag}_scale_and_bias_after",  # what FP8Sparse24 does today (eager here)
             lambda: (mm(packed, xq.t(), None, None, torch.bfloat16, True).float() * scale
                      + bias.float()).to(torch.bfloat16), ref, True)
    run_case(out, f"{tag}_bias_in_gemm_no_alpha",
             lambda: mm(packed, xq.t(), bias, None, torch.bfloat16, True),
             acc + bias.float())
    # does a graph capture of the scalar-alpha call replay the right numbers?
    try:
        static_out = mm(packed, xq.t(), bias, alpha_cpu, torch.bfloat16, True)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            mm(packed, xq.t(), bias, alpha_cpu, torch.bfloat16, True)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            static_out = mm(packed, xq.t(), bias, alpha_cpu, torch.bfloat16, True)
        graph.replay()
        torch.cuda.synchronize()
        out[f"{tag}_alpha_cpu_graph_replay"] = {
            "ok": True, "rel_err": ((static_out.float() - ref).norm() / ref.norm()).item()}
    except Exception as e:  # noqa: BLE001
        out[f"{tag}_alpha_cpu_graph_replay"] = {
            "ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    print(f"{tag}_alpha_cpu_graph_replay", json.dumps(out[f"{tag}_alpha_cpu_graph_replay"]))


def split_k_cases(out: dict, m: int, n: int, k: int) -> None:
    w = two_four(n, k, "cuda").bfloat16()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ w.float().t()
    packed = torch._cslt_compress(w)
    tag = f"bf16_M{m}_N{n}_K{k}"
    run_case(out, f"{tag}_dense", lambda: torch.nn.functional.linear(x, w), ref, True)
    for split_k in (1, 2, 4, 8):
        for mode in ((-1,) if split_k == 1 else (0, 1)):
            run_case(out, f"{tag}_split_k{split_k}_mode{mode}",
                     lambda s=split_k, md=mode: torch._cslt_sparse_mm(
                         packed, x.t(), None, None, None, True, 0, s, md), ref, True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe_cslt.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_cslt.py: needs a CUDA GPU (it calls cuSPARSELt)")
    out: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                 "cusparselt": torch.backends.cusparselt.version(),
                 "schema": torch._C._jit_get_schemas_for_operator("aten::_cslt_sparse_mm")[0]
                 .__str__()}
    print(json.dumps(out), flush=True)
    torch.manual_seed(0)
    for m, n, k in ((4096, 1024, 1024), (4096, 4096, 1024), (4096, 4096, 4096)):
        epilogue_cases(out, m, n, k)
    for m, n, k in ((16, 11008, 4096), (16, 4096, 11008), (64, 14336, 4096)):
        split_k_cases(out, m, n, k)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
