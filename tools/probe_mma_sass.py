"""Instructions per weight byte in the main loop of the mma.sp small-M kernel
(sparsekit/accel/kernels/mma_sp/csrc/sk24_mma.cu), per weight kind and configuration, from its
sm_90 machine code: no GPU needed (nvcc compiles a copy of the source reduced to the
configurations asked for, M <= 8 unless ``--mt`` says; ``nvdisasm`` disassembles).

    python tools/probe_mma_sass.py --out /tmp/mma_sass.json            # the default rows
    python tools/probe_mma_sass.py --kinds int4 --configs 8x4x2x3,8x4x2x19 --out x.json

A decode GEMM at M = 1 is meant to be bound by memory, but every byte costs instructions: at
3.35 TB/s (H100) an SM receives about 12.8 bytes a cycle and issues at most 128
thread-instructions, so a loop can spend about 10 thread-instructions per byte of weight
(7 at the H200's 4.8 TB/s) before instruction issue, not memory, limits it. Each row counts the
warp-instructions of the innermost loop holding the sparse MMAs (the lean configurations, x
mode 16, take two rounds an iteration), per round, against the round's weight bytes read
from memory (values, metadata, int4 group scales) for one warp.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "sparsekit" / "accel" / "kernels" / "mma_sp" / "csrc" / "sk24_mma.cu"
# the kernel's weight kinds: its constant's name and value (WT)
KINDS = {"bf16": ("BF16", 0), "fp8": ("FP8", 1), "int4": ("INT4", 2), "fp8h": ("FP8H", 3)}
# DRAM bytes a warp reads per step (32 columns) and row tile (16 rows): values, metadata
# (paired: one word a lane per two steps), int4 scales (16 floats a group of 4 steps)
STEP_BYTES = {"bf16": 512 + 64, "fp8": 256 + 64, "fp8h": 256 + 64, "int4": 128 + 64 + 16}
BUDGET = {"h100": 128 / (3.35e12 / (132 * 1.98e9)), "h200": 128 / (4.8e12 / (132 * 1.98e9))}
MT_M = {1: "1-8", 2: "9-16", 4: "17-32"}  # the kernel's x tiles of 8 rows, per M
CONFIGS = ("8x4x1x3", "8x4x1x19", "8x4x2x3", "8x4x2x19", "8x4x1x7", "8x4x1x23")


def reduced_source(text: str, kinds: list[str], configs: list[tuple[int, ...]],
                   all_m: bool = False) -> str:
    """``text`` (the library's source) with only ``configs`` (SK24_GO lines) and the paired
    layout of ``kinds`` (SK24_WT lines) compiled, for M <= 8 only unless ``all_m``."""
    want_go = {f"SK24_GO({', '.join(map(str, c))})" for c in configs}
    want_wt = {f"SK24_WT({KINDS[k][0]}, true)" for k in kinds}
    lines = []
    for line in text.split("\n"):
        body = line.strip()
        if body.startswith("SK24_GO(") and body not in want_go:
            continue
        if body.startswith("SK24_WT(") and body not in want_wt:
            continue
        lines.append(line)
    out = "\n".join(lines)
    if all_m:
        return out
    tail = re.search(r"\n  else if \(M <= 16\)\n    rc = launch_mt<2>\(.*?\);\n  else\n"
                     r"    rc = launch_mt<4>\(.*?\);", out, re.S)
    if tail is None:
        raise RuntimeError("probe_mma_sass: the launch's M dispatch is not where expected")
    return out[:tail.start()] + out[tail.end():]


def disassemble(source: str) -> str:
    """nvcc -cubin for sm_90 of ``source``, disassembled by nvdisasm (-c: code only)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("probe_mma_sass: needs the CUDA toolkit's nvcc on PATH")
    nvdisasm = shutil.which("nvdisasm")
    if nvdisasm is None:
        import triton
        nvdisasm = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        cu.write_text(source)
        subprocess.run([nvcc, "-O3", "-arch=sm_90", "-DSK24_ORDERED", "-cubin", "-o",
                        str(cubin), str(cu)], check=True, capture_output=True, text=True)
        return subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True,
                              text=True).stdout


def kernels(sass: str) -> dict[str, list[tuple[str | None, str]]]:
    """Per kernel (its template arguments, "MT,WT,PAIRED,W,U,R,X"), its instructions as
    (label before it or None, text)."""
    out: dict[str, list] = {}
    cur, label = None, None
    for line in sass.splitlines():
        head = re.match(r"^\s*\.text\.(\S+):", line) or re.match(r"^\s*(_Z\S+):\s*$", line)
        if head:
            m = re.search(r"sk24_mma_kernelILi(\d+)ELi(\d+)ELb(\d)"
                          r"ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)E", head.group(1))
            cur = ",".join(m.groups()) if m else None
            if cur:
                out.setdefault(cur, [])
            continue
        lab = re.match(r"^\s*(\.L_x_\d+):", line)
        if lab:
            label = lab.group(1)
            continue
        ins = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if ins and cur:
            out[cur].append((label, ins.group(1)))
            label = None
    return out


def mma_loop(instrs: list[tuple[str | None, str]]) -> list[str]:
    """The innermost loop (backward branch) holding sparse MMAs."""
    at = {lab: i for i, (lab, _) in enumerate(instrs) if lab}
    best: list[str] | None = None
    for i, (_, ins) in enumerate(instrs):
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ins)
        if target and at.get(target.group(1), i + 1) <= i:
            body = [t for _, t in instrs[at[target.group(1)]:i + 1]]
            if any("HMMA" in t for t in body) and (best is None or len(body) < len(best)):
                best = body
    return best or []


def opcode(ins: str) -> str:
    return (ins.split()[1] if ins.startswith("@") else ins.split()[0]).split(".")[0]


def row(kind: str, cfg: tuple[int, ...], body: list[str], mt: int = 1) -> dict:
    warps, unroll, tiles, xmode = cfg
    ops = collections.Counter(opcode(t) for t in body)
    # MMAs a round: a step's MMA per row tile and x tile of 8 rows (int4 lean: two)
    per_round = unroll * tiles * mt * (2 if kind == "int4" and xmode & 16 else 1)
    rounds = ops["HMMA"] / per_round
    per_round_ins = len(body) / rounds
    nbytes = unroll * tiles * STEP_BYTES[kind]
    per_byte = 32 * per_round_ins / nbytes
    return {"kind": kind, "config": "x".join(map(str, cfg)), "M": MT_M[mt],
            "warp_instructions_per_round": round(per_round_ins, 1),
            "weight_bytes_per_round": nbytes,
            "thread_instructions_per_byte": round(per_byte, 2),
            **{f"issue_budget_pct_{gpu}": round(100 * per_byte / b, 1)
               for gpu, b in BUDGET.items()},
            "top_opcodes": dict(ops.most_common(10))}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="bf16,fp8h,int4", help=", ".join(KINDS))
    ap.add_argument("--configs", default=",".join(CONFIGS), help="WxUxRxX, comma-separated")
    ap.add_argument("--mt", default="1", help="x tiles of 8 rows: 1 (M <= 8), 2 (9-16), 4")
    ap.add_argument("--out", required=True, help="JSON output path")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    mts = [int(v) for v in args.mt.split(",") if v in ("1", "2", "4")]
    if len(mts) != len(args.mt.split(",")):
        ap.error("--mt takes 1, 2 and 4 (comma-separated)")
    try:
        configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    except ValueError:
        configs = []
    if set(kinds) - set(KINDS) or not configs or any(len(c) != 4 for c in configs):
        ap.error(f"--kinds takes {', '.join(KINDS)}; --configs takes WxUxRxX (e.g. 8x4x1x3)")
    text = SOURCE.read_text()
    missing = [c for c in configs if f"SK24_GO({', '.join(map(str, c))})" not in text]
    if missing:
        ap.error(f"--configs: {missing} are not built by the library")
    found = kernels(disassemble(reduced_source(text, kinds, configs, all_m=mts != [1])))
    out = []
    for mt in mts:
        for kind in kinds:
            for cfg in configs:
                key = f"{mt},{KINDS[kind][1]},1,{','.join(map(str, cfg))}"
                if key in found and not (kind == "int4" and cfg[1] % 4):
                    out.append(row(kind, cfg, mma_loop(found[key]), mt))
    for r in out:
        print(f"{r['kind']} {r['config']} M {r['M']}: {r['warp_instructions_per_round']} "
              f"instructions a round, {r['thread_instructions_per_byte']} per weight byte "
              f"({r['issue_budget_pct_h100']}% of the H100's issue budget, "
              f"{r['issue_budget_pct_h200']}% of the H200's)")
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
