"""The table of current GPU figures in docs/gpu.md, rendered from the bench JSON in docs/bench/.

    python tools/gpu_table.py            # print the table
    python tools/gpu_table.py --write    # put it into docs/gpu.md, between the two markers
    python tools/gpu_table.py --check    # exit 1 if docs/gpu.md holds another table

``ROWS`` says which measurement is current for each workload and variant: a JSON file that
``tools/bench_models.py`` or ``tools/bench_gpu.py`` wrote (kept in docs/bench/), and the row of
it to show. When a new run replaces a figure, copy its JSON into docs/bench/, point the row at
it and run ``--write``; tests/tools/test_gpu_table.py fails while docs/gpu.md disagrees.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
DOC = ROOT / "docs" / "gpu.md"
BEGIN = "<!-- gpu_table.py: begin (generated; python tools/gpu_table.py --write) -->"
END = "<!-- gpu_table.py: end -->"

AUTO_TARGET = 0.98  # "auto" is never slower than dense by more than timing noise


@dataclass(frozen=True)
class Row:
    """One variant of one model in a ``bench_models.py`` JSON file."""

    file: str
    model: str
    variant: str


@dataclass(frozen=True)
class Gemm:
    """One variant's geometric mean over the GEMM shapes of a ``bench_gpu.py`` JSON file."""

    file: str
    variant: str
    target: float | None = None


WORKLOADS = {
    "llama_causal": "Llama-3-8B 32L prefill 2x2048",
    "llama_decode": "Llama-3-8B 32L decode step b16, KV 2048",
    "bert": "BERT-large 8x512",
    "vit": "ViT-B/16 b256",
}

ROWS: list[Row | Gemm] = [
    Row("bench_models_run35_llama32_capture.json", "llama_causal", "sk_bf16_2:4"),
    Row("bench_models_run35_llama32_capture.json", "llama_causal", "sk_fp8st_2:4"),
    Row("bench_models_run37_llama32_int8.json", "llama_causal", "sk_int8_2:4"),
    Row("bench_models_run37_llama32_int8.json", "llama_causal", "sk_int8_auto"),
    Row("bench_models_run35_llama32_capture.json", "llama_causal", "torchao_fp8_dense"),
    Row("bench_models_run26_decode_auto_paired.json", "llama_decode", "sk_bf16_auto"),
    Row("bench_models_run26_decode_auto_paired.json", "llama_decode", "sk_fp8_auto"),
    Row("bench_models_run36_decode_int8.json", "llama_decode", "sk_int8_2:4"),
    Row("bench_models_run36_decode_int8.json", "llama_decode", "sk_int8_auto"),
    Row("bench_models_run39_bert_final.json", "bert", "sk_bf16_2:4"),
    Row("bench_models_run39_bert_final.json", "bert", "sk_fp8st_2:4"),
    Row("bench_models_run33_bert_auto_capture.json", "bert", "sk_bf16_auto"),
    Row("bench_models_run33_bert_auto_capture.json", "bert", "sk_fp8s_auto"),
    Row("bench_models_run38_bert_int8.json", "bert", "sk_int8_auto"),
    Row("bench_models_run34_vit_capture.json", "vit", "sk_bf16_2:4"),
    Row("bench_models_run34_vit_capture.json", "vit", "sk_fp8st_2:4"),
    Row("bench_models_run28_bert_vit_paired.json", "vit", "sk_bf16_auto"),
    Row("bench_models_run28_bert_vit_paired.json", "vit", "sk_fp8st_auto"),
    Gemm("bench_gpu_2026-12-04b_llama_fp8st.json", "bf16_2:4", 1.6),
    Gemm("bench_gpu_2026-12-04b_llama_fp8st.json", "fp8st_2:4", 2.5),
    Gemm("bench_gpu_2026-12-04b_llama_fp8st.json", "fp8s_2:4", 2.5),
    Gemm("bench_gpu_2026-12-04b_llama_fp8st.json", "fp8_2:4", 2.5),
    Gemm("bench_gpu_2026-12-04b_llama_fp8st.json", "int8_2:4"),
    Gemm("bench_gpu_2026-12-04b_llama_fp8st.json", "fp8_dense"),
]

LEGEND = (
    "Variants: `sk_<precision>_<sparsity>` is `sk.accelerate(model, x, precision=..., "
    "sparsity=...)`; `fp8s` is a model quantized first with `sk.quantize_(model, "
    "\"fp8_static\", calibration=...)` (static activation scale), `fp8st` with "
    "`\"fp8_static_tensor\"` (also one weight scale per tensor: the scale runs inside the 2:4 "
    "GEMM); `fp8` and `int8` alone quantize activations per token at run time. "
    "`torchao_fp8_dense`: torchao's fp8 dense (per-row) compiled. Ratios are to the fastest "
    "dense bf16 way to run the same model in the same run (`dense ms`: eager, compiled or "
    "compiled with CUDA graphs); *paired*: timed alternating with a fresh build of that dense "
    "way, which cancels the GPU's clock drift: targets are judged on it. GEMM rows: the "
    "geometric mean over the Llama-7B/70B MLP shapes at M = 1024-16384, against cuBLAS bf16 "
    "(min-max in brackets). Error: relative L2 error of the output against the fp32 model "
    "with the same masks; in brackets the fastest dense bf16 way's (the random 32-layer Llama "
    "is chaotic: its bf16 floor is near 1). `accelerate s`: planning + compile seconds of the "
    "first call."
)


def _load(name: str, cache: dict[str, dict]) -> dict:
    if name not in cache:
        cache[name] = json.loads((BENCH / name).read_text())
    return cache[name]


def _day(data: dict) -> str:
    return str(data.get("date", "")).split(" ")[0]


def _source(name: str, data: dict) -> str:
    return f"{Path(name).stem.removeprefix('bench_models_')}, {_day(data)}"


def _met(value: float | None, target: float | None) -> str:
    if target is None:
        return ""
    if value is None:
        return f">= {target}"
    return f">= {target}: {'met' if value >= target else 'NOT met'}"


def _model_row(row: Row, data: dict) -> list[str]:
    model = data["models"][row.model]
    r = model["variants"][row.variant]
    dense = model["variants"][model["fastest_dense"]]
    paired = r.get("paired_ratio")
    target = r.get("target", AUTO_TARGET if row.variant.endswith("_auto") else None)
    seconds = r.get("plan_s", 0.0) + r.get("compile_s", 0.0)
    return [WORKLOADS.get(row.model, row.model), f"`{row.variant}`", f"{r['ms']:.2f}",
            f"{dense['ms']:.2f}", f"{r['ratio']:.2f}x", "" if paired is None else f"{paired:.2f}x",
            _met(paired if paired is not None else r["ratio"], target),
            f"{r['rel_err']:.3g} ({dense['rel_err']:.3g})", f"{seconds:.0f}",
            _source(row.file, data)]


def _gemm_row(row: Gemm, data: dict) -> list[str]:
    s = data["summary"]
    key = f"gemm_llama_{row.variant}"
    mean, lo, hi = s[f"{key}_geomean"], s[f"{key}_min"], s[f"{key}_max"]
    return ["GEMM, Llama-7B/70B MLP shapes", f"`{row.variant}`", "", "",
            f"{mean:.2f}x ({lo:.2f}-{hi:.2f})", "", _met(mean, row.target), "", "",
            _source(row.file, data)]


def render(rows: list[Row | Gemm] = ROWS) -> str:
    """The markdown table (with its legend) of ``rows``."""
    cache: dict[str, dict] = {}
    head = ["workload", "variant", "ms", "dense ms", "ratio", "paired", "target",
            "error (dense)", "accelerate s", "data (docs/bench/)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        data = _load(row.file, cache)
        cells = _gemm_row(row, data) if isinstance(row, Gemm) else _model_row(row, data)
        lines.append("| " + " | ".join(cells) + " |")
    devices = sorted({f"{d.get('device', '?')}, torch {d.get('torch', '?')}"
                      for d in cache.values()})
    return "\n".join([*lines, "", f"Device: {'; '.join(devices)}. {LEGEND}"])


def with_table(doc: str, table: str) -> str:
    """``doc`` with the text between its markers replaced by ``table``."""
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"the document has no table markers ({BEGIN} ... {END})")
    before, rest = doc.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    return f"{before}{BEGIN}\n{table}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update the table in docs/gpu.md")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when docs/gpu.md's table is not this one")
    parser.add_argument("--doc", type=Path, default=DOC, help="the document holding the table")
    args = parser.parse_args(argv)
    table = render()
    if not (args.write or args.check):
        print(table)
        return 0
    doc = args.doc.read_text()
    updated = with_table(doc, table)
    if args.write:
        args.doc.write_text(updated)
        return 0
    if updated != doc:
        print(f"{args.doc}: the GPU table is out of date; run python tools/gpu_table.py --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
