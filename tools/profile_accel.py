"""Where an accelerated model's GPU time goes, kernel by kernel (CUDA only).

    python tools/profile_accel.py --out-dir out [--tokens 4096]

Builds the Llama-7B-shaped decoder layer of tools/bench_gpu.py with magnitude 2:4 weights,
accelerates it per (precision, activation quantization fused by the compiler or as an opaque
op), compiled (inductor, no CUDA graphs of its own), and profiles a few forwards
(torch.profiler, CUDA kernel time summed by kernel name); also times the whole layer under a
CUDA graph. Writes profile.json and prints the top kernels of each variant.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # noqa: E402

import sparsekit as sk  # noqa: E402
from sparsekit.nn.timing import graph_time_us  # noqa: E402


def kernels_of(fn, reps: int = 5) -> dict[str, float]:
    """Per-kernel CUDA time (us per forward), largest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name[:90]] = totals.get(e.name[:90], 0.0) + e.device_time_total / reps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_accel: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    master = bench_gpu.magnitude_24_(bench_gpu.LlamaLayer().eval())
    x = torch.randn(1, args.tokens, 4096, device="cuda", dtype=torch.bfloat16)
    out = {}
    dense = copy.deepcopy(master).cuda().bfloat16()
    with torch.no_grad():
        out["bf16_dense"] = {"graph_us": graph_time_us(lambda: dense(x), calls=1),
                             "kernels": kernels_of(lambda: dense(x))}
    dense = None
    for precision in ("bf16", "fp8"):
        for fused in ((True,) if precision == "bf16" else (False, True)):
            fast = sk.accelerate(copy.deepcopy(master), x, precision=precision, sparsity="2:4",
                                 mode="default", fused_quant=fused, clone_outputs=False)
            with torch.no_grad():
                key = f"{precision}_2:4_{'fused' if fused else 'unfused'}_quant"
                out[key] = {"graph_us": graph_time_us(lambda: fast(x), calls=1),  # noqa: B023
                            "kernels": kernels_of(lambda: fast(x))}  # noqa: B023
            fast = None
            torch.cuda.empty_cache()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "profile.json").write_text(json.dumps(out, indent=1))
    for key, d in out.items():
        total = sum(d["kernels"].values())
        print(f"\n== {key}: graph {d['graph_us']:.0f} us, kernels {total:.0f} us")
        for name, us in list(d["kernels"].items())[:14]:
            print(f"{us:9.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
