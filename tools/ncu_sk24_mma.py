"""Nsight Compute counters of the mma.sp small-M 2:4 kernel's decode GEMMs: why a configuration
reaches the share of the bandwidth bound it does (DRAM throughput, achieved occupancy, waves,
registers, where its warps stall), for the weight kinds and configurations that
tools/bench_sk24_mma.py times.

Cases: per Llama-3-8B shape (``--shapes``), M (``--ms``) and kind (``--kinds``: bf16, fp8h,
int4), the configurations ``--configs`` names ("default", "best": the fastest per row of a
``--sweep`` JSON of bench_sk24_mma.py, or explicit ``WxSxTxX`` strings). Each case's kernel
runs once inside an NVTX range "sk" after warm-up outside it; ``ncu`` (``--clock-control
none``, caches flushed between passes as a decode step's weights come from memory, counters in
base units) profiles
those launches only, with the sections SpeedOfLight, Occupancy, LaunchStats, WarpStateStats
and MemoryWorkloadAnalysis. The tool runs itself under ncu (``--child``), reads ncu's CSV and
writes one row per case: its key counters (``summary``) and every raw metric (``raw``).

    python tools/ncu_sk24_mma.py --sweep docs/bench/bench_sk24_mma_2026-12-07d_m1_16_h100.json \\
        --out ncu.json                                     # on the GPU (sm_90), ncu on PATH

The library is built ahead of time: ``python -m sparsekit.accel.build`` (once per checkout).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import SHAPES, masked_weight  # noqa: E402  (tools/bench_generate.py)
from bench_sk24_mma import fp8_weight  # noqa: E402  (tools/bench_sk24_mma.py)

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats",
            "MemoryWorkloadAnalysis")
KINDS = ("bf16", "fp8h", "int4")
SWEEP_KEY = {"bf16": "bf16_2:4", "fp8h": "fp8h_2:4", "int4": "int4_2:4"}
# the counters each row's summary keeps (any the run did not collect are left out); the
# stall reasons are warps stalled per issued instruction, by reason
SUMMARY = {
    "us": ("gpu__time_duration.sum", 1e-3),
    "dram_read_bytes": ("dram__bytes_read.sum", 1),
    "dram_pct_of_peak": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    "sm_pct_of_peak": ("sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    "achieved_occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    "theoretical_occupancy_pct": ("sm__maximum_warps_per_active_cycle_pct", 1),
    "registers": ("launch__registers_per_thread", 1),
    "grid": ("launch__grid_size", 1),
    "waves": ("launch__waves_per_multiprocessor", 1),
    "issue_active_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def parse_config(text: str) -> tuple[int, int, int, int]:
    """``"8x4x2x7"`` -> (8, 4, 2, 7); a clear error otherwise."""
    parts = text.split("x")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ValueError(f"--configs: {text!r} is not WxSxTxX (e.g. 8x4x1x1), 'default' or "
                         f"'best'")
    return tuple(int(p) for p in parts)


def case_list(shapes, ms, kinds, configs, sweep: dict | None) -> list[dict]:
    """The cases to profile: one per shape, M, kind and configuration named (``"best"``: the
    sweep row's fastest for that kind; ``"default"``: resolved later, on the GPU). Duplicates
    are dropped, order kept."""
    rows = {(r["shape"], r["M"]): r for r in (sweep or {}).get("time", [])}
    out, seen = [], set()
    for name, n, k in shapes:
        for m in ms:
            for kind in kinds:
                for c in configs:
                    if c == "best":
                        cell = rows.get((name, m), {}).get(SWEEP_KEY[kind])
                        if cell is None:
                            continue
                        cfg = tuple(cell["config"])
                    elif c == "default":
                        cfg = "default"
                    else:
                        cfg = parse_config(c)
                    key = (name, m, kind, cfg)
                    if key not in seen:
                        seen.add(key)
                        out.append({"shape": name, "N": n, "K": k, "M": m, "kind": kind,
                                    "config": cfg})
    return out


def parse_ncu_csv(text: str) -> list[dict[str, str]]:
    """Rows of ``ncu --csv --page raw`` (a header of metric names, a row of units, one row per
    profiled kernel), ncu's own log lines before the header skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    table = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = table[0], table[2:]  # table[1]: units
    return [dict(zip(header, row)) for row in body if len(row) == len(header)]


def number(text: str | None) -> float | None:
    """A counter's value as ncu prints it ("1,234.5", "n/a"): float, or None."""
    if text is None:
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(raw: dict[str, str]) -> dict:
    """The key counters of one kernel's raw metrics (:data:`SUMMARY`) and its stall reasons
    (warps stalled per issued instruction, largest first)."""
    out = {}
    for key, (metric, scale) in SUMMARY.items():
        v = number(raw.get(metric))
        if v is not None:
            out[key] = v * scale
    stalls = {name[len(STALL_PREFIX):-len(STALL_SUFFIX)]: number(v)
              for name, v in raw.items()
              if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX)
              and "_not_issued" not in name}
    out["stalls"] = dict(sorted(((k, v) for k, v in stalls.items() if v), key=lambda kv: -kv[1]))
    return out


def join(cases: list[dict], rows: list[dict[str, str]]) -> list[dict]:
    """Each case with its kernel's counters, in launch order (one sk24_mma kernel a case; where
    ncu's NVTX filter let the two warm-up launches through too, three a case: the last)."""
    if cases and len(rows) == 3 * len(cases):
        rows = rows[2::3]
    if len(rows) != len(cases):
        raise RuntimeError(f"ncu profiled {len(rows)} kernels for {len(cases)} cases: the "
                           f"filter or the launches are off")
    return [{**case, "kernel": row.get("Kernel Name", ""), "summary": summarize(row),
             "raw": row} for case, row in zip(cases, rows)]


def operands(kind: str, n: int, k: int, device) -> tuple:
    """(launch function, weight arguments) of one kind on a random 2:4 weight of (n, k)."""
    from sparsekit.accel.kernels.mma_sp import launch as sk24_mma
    from sparsekit.accel.layers_int4 import rtn_int4

    w = masked_weight(n, k, "cpu", torch.Generator().manual_seed(0)).to(device)
    if kind == "int4":
        q, s = rtn_int4(w.float(), 128)
        v, mt, gs = (t.to(device) for t in sk24_mma.compress_int4(q, s))
        return sk24_mma.launch_int4, (v, mt, gs, None)
    if kind == "fp8h":
        w8, scale = fp8_weight(w)
        v, mt = sk24_mma.compress(w8)
        return sk24_mma.launch, (v, mt, None, scale, None)
    v, mt = sk24_mma.compress(w)
    return sk24_mma.launch, (v, mt, None, None, None)


def child(cases: list[dict], manifest: Path) -> None:
    """Run each case's kernel: twice outside the NVTX range (warm-up, the library's load),
    once inside it; write the cases as run (defaults resolved) to ``manifest``."""
    from sparsekit.accel.kernels.mma_sp import launch as sk24_mma

    device = torch.device("cuda")
    ran = []
    for case in cases:
        fn, args = operands(case["kind"], case["N"], case["K"], device)
        x = torch.randn(case["M"], case["K"], device=device, dtype=torch.bfloat16)
        if case["kind"] == "fp8h":
            x = x.to(torch.float8_e4m3fn).to(torch.float16)
        cfg = case["config"]
        if cfg == "default":
            cfg = sk24_mma.default_config(case["M"], case["N"], case["K"], case["kind"] == "int4")
        way = {"bf16": "bf16", "fp8h": "f16", "int4": "int4"}[case["kind"]]
        if tuple(cfg) not in sk24_mma.working(way) or (case["N"] // 16) % cfg[2]:
            continue  # failed the self-check or does not fit the row tiles: not launched
        for _ in range(2):
            fn(x, *args, tuple(cfg))
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("sk")
        fn(x, *args, tuple(cfg))
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        ran.append({**case, "config": list(cfg)})
        del args
        torch.cuda.empty_cache()
    manifest.write_text(json.dumps(ran))


def ncu_command(ncu: str, log: Path, argv: list[str]) -> list[str]:
    """The ncu command line that profiles this tool's ``--child`` run of ``argv``."""
    cmd = [ncu, "--clock-control", "none", "--cache-control", "all", "--nvtx",
           "--nvtx-include", "sk/", "--kernel-name", "regex:sk24_mma", "--csv", "--page", "raw",
           "--print-units", "base",
           "--log-file", str(log)]
    for s in SECTIONS:
        cmd += ["--section", s]
    return cmd + [sys.executable, str(Path(__file__).resolve()), "--child", *argv]


def profile(ncu_name: str, argv: list[str]) -> list[dict]:
    """Run this tool's ``--child`` with ``argv`` under ncu and join its counters to the cases;
    one line and exit 2 without a GPU or ncu."""
    if not torch.cuda.is_available():
        print("ncu_sk24_mma: needs a CUDA GPU (sm_90) and Nsight Compute", file=sys.stderr)
        raise SystemExit(2)
    ncu = shutil.which(ncu_name)
    if ncu is None:
        print(f"ncu_sk24_mma: --ncu {ncu_name!r} is not on PATH", file=sys.stderr)
        raise SystemExit(2)
    with tempfile.TemporaryDirectory() as tmp:
        log, manifest = Path(tmp) / "ncu.csv", Path(tmp) / "cases.json"
        proc = subprocess.run(ncu_command(ncu, log, [*argv, "--manifest", str(manifest)]),
                              env=os.environ.copy(), capture_output=True, text=True)
        if proc.returncode != 0 or not manifest.exists():
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
            raise SystemExit(f"ncu_sk24_mma: ncu exited with {proc.returncode}")
        return join(json.loads(manifest.read_text()), parse_ncu_csv(log.read_text()))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8b_qkv,8b_o,8b_gate_up,8b_down")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--kinds", default="bf16,fp8h,int4")
    ap.add_argument("--configs", default=None,
                    help="comma-separated: best (needs --sweep), default, or WxSxTxX "
                         "(default: best,default with --sweep, else default)")
    ap.add_argument("--sweep", type=Path, help="a bench_sk24_mma.py JSON (its 'time' rows)")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--out", type=Path, default=Path("ncu_sk24_mma.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--manifest", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    by_name = {s[0]: s for s in SHAPES}
    names = args.shapes.split(",")
    bad = [s for s in names if s not in by_name]
    kinds = args.kinds.split(",")
    if bad or set(kinds) - set(KINDS):
        ap.error(f"--shapes takes {', '.join(by_name)}; --kinds takes {', '.join(KINDS)}")
    configs = (args.configs or ("best,default" if args.sweep else "default")).split(",")
    if "best" in configs and args.sweep is None:
        ap.error("--configs best needs --sweep (a bench_sk24_mma.py JSON)")
    try:
        for c in configs:
            if c not in ("best", "default"):
                parse_config(c)
    except ValueError as e:
        ap.error(str(e))
    sweep = json.loads(args.sweep.read_text()) if args.sweep else None
    cases = case_list([by_name[s] for s in names], [int(m) for m in args.ms.split(",")], kinds,
                      configs, sweep)
    if args.child:
        child(cases, args.manifest)
        return {}
    rows = profile(args.ncu, list(argv if argv is not None else sys.argv[1:]))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "sections": list(SECTIONS), "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    for r in rows:
        s = r["summary"]
        print(json.dumps({k: r[k] for k in ("shape", "M", "kind", "config")}
                         | {k: (round(v, 2) if isinstance(v, float) else v)
                            for k, v in s.items() if k != "stalls"}
                         | {"stalls": {k: round(v, 2) for k, v in list(s["stalls"].items())[:4]}}))
    return result


if __name__ == "__main__":
    main()
