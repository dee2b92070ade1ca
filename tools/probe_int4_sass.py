"""Instructions per weight byte in the K loop of sparsekit's int4 kernels, from their sm_90
machine code (no GPU needed: Triton compiles for a named target, ``nvdisasm`` disassembles).

    python tools/probe_int4_sass.py --out /tmp/int4_sass.json           # the table's rows
    python tools/probe_int4_sass.py --smoke --out /tmp/int4_sass.json   # one row (CI)

At M = 1 the H200 can spend about 7 thread-instructions per weight byte before instruction
issue rather than HBM limits a kernel (4.8 TB/s over 132 SMs at about 1.98 GHz is 18 bytes per
SM per cycle; an SM issues 128 thread-instructions per cycle): the ratio printed here bounds
the bandwidth a kernel can reach (docs/int4-kernels.md). Each row compiles one kernel with
one tile (BLOCK_M rows on CUDA cores or tensor cores) and counts the instructions of its
longest loop (the K loop) against the packed weight bytes one thread reads per iteration.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path

ISSUE_BUDGET = 128 / (4.8e12 / (132 * 1.98e9))  # thread-instructions per byte at 4.8 TB/s
# (kernel, BLOCK_M, path, BLOCK_N, BLOCK_K, warps): path "rows" is the word-tile kernel of
# M <= 4 (its BLOCK_K: the columns of one iteration, U vectors of 64 (2:4) or 32 (dense)
# columns), "cuda" and "dot" the tile kernel on CUDA cores (M <= 4 with groups below one
# vector) and on tensor cores (M > 4)
ROWS = [("2:4", 1, "rows", 32, 256, 1), ("2:4", 2, "rows", 32, 128, 1),
        ("2:4", 4, "rows", 32, 128, 1), ("2:4", 1, "cuda", 32, 256, 4),
        ("2:4", 4, "cuda", 16, 256, 4), ("2:4", 16, "dot", 64, 128, 4),
        ("dense", 1, "rows", 128, 128, 1), ("dense", 2, "rows", 64, 128, 1),
        ("dense", 4, "rows", 64, 64, 1), ("dense", 1, "cuda", 32, 256, 4),
        ("dense", 16, "dot", 64, 128, 4)]
_POINTERS = ("x_ptr", "v_ptr", "m_ptr", "s_ptr", "b_ptr", "y_ptr", "part_ptr", "cnt_ptr")


def compile_sass(sparse: bool, block_m: int, path: str, block_n: int, block_k: int,
                 warps: int, group: int = 128) -> str:
    """The sm_90 disassembly of one kernel specialization (strides divisible by 16, as the
    packed formats' are for K a multiple of 512)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sparsekit.accel.kernels.int4 import kernel as src

    if path == "rows":
        fn = src.int4_24_rows_kernel if sparse else src.int4_rows_kernel
        sig = {"x_ptr": "*fp32", "v_ptr": "*i64" if sparse else "*i32", "m_ptr": "*i32",
               "s_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
               "cnt_ptr": "*i32"}
        sig |= {k: "i32" for k in ("M", "N", "K", "stride_s", "M_BUCKET", "MAGIC")}
        span = (src.SW_24 * 32) if sparse else (src.SW_DENSE * 8)
        consts = {"GROUP": group, "HAS_BIAS": False, "BLOCK_M": block_m, "SPARSE": sparse,
                  "BLOCK_N": block_n, "U": block_k // span, "SPLIT_K": 2}
    else:
        fn = src.int4_24_kernel if sparse else src.int4_kernel
        sig = {"x_ptr": "*bf16", "v_ptr": "*u8"} | ({"m_ptr": "*i32"} if sparse else {})
        sig |= {"s_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"}
        sig |= {k: "i32" for k in ("M", "N", "K", "stride_xm", "stride_v", "stride_m",
                                   "stride_s", "M_BUCKET")}
        consts = {"GROUP": group, "HAS_BIAS": False, "BLOCK_M": block_m,
                  "USE_DOT": path == "dot", "DOT_F32": False, "BLOCK_N": block_n,
                  "BLOCK_K": block_k}
    sig |= {k: "constexpr" for k in consts}
    aligned = set(_POINTERS) | {"N", "K", "stride_xm", "stride_v", "stride_m"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if k in aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": 3})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest backward branch's loop (the kernel's K loop)."""
    labels, instrs = {}, []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instrs)
            continue
        ins = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if ins:
            instrs.append(ins.group(1))
    best: list[str] = []
    for i, ins in enumerate(instrs):
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ins)
        if target and labels.get(target.group(1), i + 1) <= i:
            body = instrs[labels[target.group(1)]:i + 1]
            best = body if len(body) > len(best) else best
    return best


def probe(kind: str, block_m: int, path: str, block_n: int, block_k: int, warps: int) -> dict:
    sparse = kind == "2:4"
    body = loop_body(compile_sass(sparse, block_m, path, block_n, block_k, warps))
    opcodes = collections.Counter(ins.split()[1] if ins.startswith("@") else ins.split()[0]
                                  for ins in body)
    bytes_per_thread = block_n * block_k * (0.375 if sparse else 0.5) / (32 * warps)
    per_byte = len(body) / bytes_per_thread
    return {"kernel": f"int4_{kind}", "BLOCK_M": block_m, "path": path,
            "BLOCK_N": block_n, "BLOCK_K": block_k, "warps": warps,
            "loop_instructions": len(body), "weight_bytes_per_thread": bytes_per_thread,
            "instructions_per_byte": round(per_byte, 2),
            "issue_bound_pct": round(100 * min(1.0, ISSUE_BUDGET / per_byte), 1),
            "loads": dict(sorted((op, n) for op, n in opcodes.items() if op.startswith("LD"))),
            "top_opcodes": dict(opcodes.most_common(8))}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--smoke", action="store_true", help="one small row (CI)")
    args = ap.parse_args(argv)
    rows = [("dense", 1, "rows", 64, 32, 2)] if args.smoke else ROWS
    out = []
    for row in rows:
        r = probe(*row)
        print(f"{r['kernel']} M<={r['BLOCK_M']} {r['path']} {r['BLOCK_N']}x{r['BLOCK_K']}: "
              f"{r['instructions_per_byte']} instructions per weight byte (issue bound "
              f"~{r['issue_bound_pct']}% of 4.8 TB/s), loads {r['loads']}")
        out.append(r)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
