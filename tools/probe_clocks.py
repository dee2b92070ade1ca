"""How much a dense and a 2:4 GEMM slow down as the GPU's SM clock falls at its power cap.

On the H200 (2026-12-04, run 29) the dense Llama prefill ran 91.8 ms at the boost clock, 99.4 ms
at 1581 MHz and 106.5 ms at 1506 MHz; the bf16 2:4 model ran 79.4-80.8 ms at all three. This
probe isolates that on one GEMM shape: after ``--idle-s`` seconds of idle (the clock back at
boost), it alternates blocks of the dense and the 2:4 GEMM (each block a CUDA graph of
``--calls`` GEMMs replayed for about ``--block-s`` seconds) for ``--seconds``, with the GPU clock
log of :mod:`gpu_log` beside it. Per variant it fits ln(ms) against ln(SM MHz) over the blocks:
the slope (the elasticity) is about -1 for a kernel bound by the SM clock (tensor-core math),
about 0 for one bound by something the SM clock does not set (memory bandwidth, for one).

    python tools/probe_clocks.py --out probe_clocks.json           # H200: Llama-3-8B up_proj
    python tools/probe_clocks.py --smoke --out /tmp/probe.json     # CPU, no clocks (CI)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import gpu_log  # noqa: E402
from sparsekit.accel import algsearch, kernels  # noqa: E402
from sparsekit.nn import timing  # noqa: E402
from sparsekit.prune.patterns import nm_mask  # noqa: E402


def elasticity(ms: list[float], mhz: list[float]) -> float | None:
    """Least-squares slope of ln(ms) on ln(MHz): -1 when the time scales as 1 / clock, 0 when
    the clock does not matter; None with fewer than 3 points or one clock only."""
    if len(ms) < 3 or len(set(mhz)) < 2:
        return None
    xs, ys = [math.log(f) for f in mhz], [math.log(t) for t in ms]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def build(n: int, k: int, m: int, device: torch.device) -> dict[str, nn.Module]:
    """Dense bf16 and bf16 2:4 (best cuSPARSELt algorithm at ``m`` tokens) layers of one random
    2:4 weight."""
    lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(nm_mask(lin.weight.abs(), 2, 4))
    if device.type == "cuda":
        sparse = algsearch.search("bf16_2:4", lin, m, use_cache=False)[0]
    else:
        sparse = kernels.VARIANTS["bf16_2:4"](lin)
    return {"dense": lin, "bf16_2:4": sparse}


def block_runner(fn, device: torch.device, calls: int):
    """A callable running ``calls`` of ``fn`` once (one CUDA-graph replay on CUDA) and returning
    ms per call of that run, by sparsekit's one timing loop (:func:`timing.time_ms`)."""
    if device.type != "cuda":
        def many() -> None:
            for _ in range(calls):
                fn()
        return lambda: timing.time_ms(many, device, warmup=0, repeats=1) / calls
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return lambda: timing.time_ms(graph.replay, device, warmup=0, repeats=1) / calls


def probe(n: int, k: int, m: int, seconds: float, block_s: float, idle_s: float,
          calls: int, device: torch.device, log_path: Path | None) -> dict:
    layers = build(n, k, m, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    runners = {name: block_runner(lambda mod=mod: mod(x), device, calls)
               for name, mod in layers.items()}
    log = gpu_log.GpuLog(log_path).start() if log_path is not None else None
    blocks = []
    try:
        time.sleep(idle_s)
        t_end = time.time() + seconds
        order = list(runners)
        while time.time() < t_end:
            for name in order:
                t0, times = time.time(), []
                while time.time() - t0 < block_s or not times:
                    times.append(runners[name]())
                blocks.append([name, round(t0, 3), round(time.time(), 3),
                               round(statistics.median(times), 5)])
            order.reverse()  # ABBA
    finally:
        if log is not None:
            log.stop()
    samples = gpu_log.read_log(log_path) if log_path is not None else []
    out = {"shape": {"N": n, "K": k, "M": m}, "calls_per_replay": calls, "blocks": blocks,
           "variants": {}}
    for name in runners:
        mine = [b for b in blocks if b[0] == name]
        clocked = [(b[3], gpu_log.span_stats(samples, b[1], b[2])) for b in mine]
        clocked = [(t, c) for t, c in clocked if c]
        out["variants"][name] = {
            "blocks": len(mine), "ms_median": statistics.median(b[3] for b in mine),
            "ms_min": min(b[3] for b in mine), "ms_max": max(b[3] for b in mine),
            "sm_mhz_range": [min(c["sm_mhz"] for _, c in clocked),
                             max(c["sm_mhz"] for _, c in clocked)] if clocked else None,
            "elasticity": elasticity([t for t, _ in clocked], [c["sm_mhz"] for _, c in clocked]),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe_clocks.json")
    ap.add_argument("--shape", default="14336,4096,4096", help="N,K,M (default: Llama-3-8B "
                    "up_proj at a 2x2048 prefill)")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--block-s", type=float, default=0.5)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--calls", type=int, default=10, help="GEMMs per graph replay")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU, no clock log")
    args = ap.parse_args(argv)
    try:
        n, k, m = (int(v) for v in args.shape.split(","))
    except ValueError:
        raise SystemExit(f"--shape: expected N,K,M as three integers, got {args.shape!r}") \
            from None
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        res = probe(64, 128, 32, 0.3, 0.05, 0.0, 2, torch.device("cpu"), None)
    else:
        if not torch.cuda.is_available() or not gpu_log.GpuLog.available():
            raise SystemExit("probe_clocks needs a CUDA GPU and nvidia-smi (or --smoke)")
        res = probe(n, k, m, args.seconds, args.block_s, args.idle_s, args.calls,
                    torch.device("cuda"), out_path.with_suffix(".clocks.csv"))
        res["device"] = torch.cuda.get_device_name()
    res["torch"] = torch.__version__
    out_path.write_text(json.dumps(res, indent=1))
    for name, v in res["variants"].items():
        print(f"{name}: {v['ms_median']:.4f} ms (min {v['ms_min']:.4f}, max {v['ms_max']:.4f}), "
              f"SM MHz {v['sm_mhz_range']}, elasticity {v['elasticity']}")
    return res


if __name__ == "__main__":
    main()
