"""The generated parts of the docs, so they cannot drift from what they describe:

- README.md's results table, from the JSON the measuring tools wrote into docs/ (each row
  names the command that reproduces it, the machine and the date);
- docs/cli.md's list of config groups, their options and the allowed values, from the config
  files, the recipes and the registries (what ``sparsekit --help`` prints);
- docs/gpu.md's table of ``fast.generate`` figures, from the bench JSON in docs/bench/.

    python tools/docs_tables.py            # print them
    python tools/docs_tables.py --write    # rewrite the blocks in README.md and docs/
    python tools/docs_tables.py --check    # exit 1 if a block differs (CI; the smoke mode)

A block sits between ``<!-- generated: NAME (python tools/docs_tables.py --write) -->`` and
``<!-- end generated: NAME -->``; tests/tools/test_docs_tables.py checks that each equals what
this tool gives now.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# The commands that wrote the JSON files which do not record their own command line.
SMALL_LLAMA_H200 = (
    "python tools/train_small_llama.py --device cuda --minutes 0.3 --hidden 384 --layers 6 "
    "--intermediate 1024 --heads 6 --vocab 4096 --seq-len 512 --batch-size 32 --lr 1.5e-3 "
    "--text-bytes 16000000 --finetune-steps 200 --eval-batches 48")
# (file under docs/bench, model, variant, what the row says)
SPEED_ROWS = (
    ("bench_models_run35_llama32_capture.json", "llama_causal", "sk_bf16_2:4",
     "Llama-3-8B shapes, 32 layers, prefill 2x2048: bf16 2:4"),
    ("bench_models_run35_llama32_capture.json", "llama_causal", "sk_fp8st_2:4",
     "same, fp8 2:4 (`fp8_static_tensor`)"),
    ("bench_models_run39_bert_final.json", "bert", "sk_bf16_2:4",
     "BERT-large shapes, 8x512: bf16 2:4"),
    ("bench_models_run34_vit_capture.json", "vit", "sk_fp8st_2:4",
     "ViT-B/16, batch 256: fp8 2:4 (`fp8_static_tensor`)"),
)
# (file under docs/bench, batch, way, what the row says): generate() rows
GEN_ROWS = (
    ("bench_generate_2026-12-07d_gen_core_b1_h100.json", "1", "sk_bf16_2:4",
     "Llama-3-8B shapes, 32 layers, `fast.generate` 512 + 256 tokens, batch 1: bf16 2:4"),
    ("bench_generate_2026-12-07d_gen_core_b1_h100.json", "1", "sk_fp8w_2:4",
     "same, fp8 weights 2:4 (`fp8w`)"),
    ("bench_generate_2026-12-07d_gen_int4_b1_h100.json", "1", "sk_int4_2:4",
     "same, int4 weights 2:4 (`int4`, RTN group 128)"),
    ("bench_generate_2026-12-07d_gen_int4_b16_h100.json", "16", "sk_int4_2:4",
     "same, int4 2:4, batch 16"),
)
# (file under docs/bench, batch, way, what the row says, target ratio or None): docs/gpu.md's
# generate() table; the targets are issue 30's, set for the H200
GEN_CORE_B1 = "bench_generate_2026-12-07d_gen_core_b1_h100.json"
GEN_INT4_B1 = "bench_generate_2026-12-07d_gen_int4_b1_h100.json"
GEN_INT4_B16 = "bench_generate_2026-12-07d_gen_int4_b16_h100.json"
GPU_GEN_ROWS = (
    (GEN_CORE_B1, "1", "dense_sk", "`dense_sk` (the reference)", None),
    (GEN_INT4_B1, "1", "dense_hf", "`dense_hf`", None),
    (GEN_CORE_B1, "1", "sk_bf16_2:4", "bf16 2:4", 1.5),
    (GEN_CORE_B1, "1", "sk_fp8w_2:4", "fp8w 2:4 (fp8 weights, bf16 x)", 2.5),
    (GEN_INT4_B1, "1", "sk_int4_2:4", "int4 2:4 (W4A16, RTN group 128)", 3.5),
    (GEN_INT4_B16, "16", "dense_sk", "`dense_sk` (the reference)", None),
    ("bench_generate_2026-12-07d_gen_bf16_b16_h100.json", "16", "sk_bf16_2:4", "bf16 2:4", 1.3),
    (GEN_INT4_B16, "16", "sk_int4_2:4", "int4 2:4", 2.5),
    ("bench_generate_2026-12-07c_gen_fp8w_b16_h100.json", "16", "sk_fp8w_2:4",
     "fp8w 2:4 (the mma.sp library before its lean configurations)", 2.0),
)
MNIST_ROWS = (
    ("mnist1d_cnn_24", "MNIST-1D CNN: 2:4 Wanda while fine-tuning (the default, `sparsekit`)"),
    ("mnist1d_24_int8_qat", "same, 2:4 + int8 QAT (`recipe=mnist1d_24_int8_qat`)"),
    ("mnist1d_channel30", "same, 30% of channels removed (`recipe=mnist1d_channel30`)"),
)
LLM_ROWS = (
    ("llm_sparsegpt_24", "Llama 13.8M on stdlib text: SparseGPT 2:4 (`recipe=llm_sparsegpt_24`)"),
    ("llm_sparsegpt_24_fp8", "same, 2:4 + fp8 (`recipe=llm_sparsegpt_24_fp8`)"),
)


def _spread(values: list[float], fmt: str, unit: str = "") -> str:
    """``mean (min-max)`` with ``unit`` after each number, or the one value when they agree
    at ``fmt``.

    >>> _spread([92.8, 93.6, 93.1], ".1f", "%"), _spread([19510, 19510], ",.0f", " B")
    ('93.2% (92.8-93.6%)', '19,510 B')
    """
    if len({format(v, fmt) for v in values}) == 1:
        return format(values[0], fmt) + unit
    return (f"{format(statistics.mean(values), fmt)}{unit} "
            f"({format(min(values), fmt)}-{format(max(values), fmt)}{unit})")


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _ms(blocks: list, side: str) -> list[float]:
    return [b[3] for b in blocks if b[0] == side]


def mnist_rows(path: Path) -> list[tuple[str, str]]:
    sweep = json.loads(path.read_text())
    seeds = "/".join(map(str, sweep["seeds"]))
    where = f"{sweep['machine']} (CPU), {sweep['date_utc'][:10]}, seeds {seeds}"
    rows = []
    for name, what in MNIST_ROWS:
        runs = list(sweep["runs"][name].values())
        dense = _spread([100 * r["dense"] for r in runs], ".1f", "%")
        comp = _spread([100 * r["compressed"] for r in runs], ".1f", "%")
        dsize = _spread([r["dense_size_bytes"] for r in runs], ",.0f", " B")
        csize = _spread([r["size_bytes"] for r in runs], ",.0f", " B")
        rows.append((f"| {what} | accuracy {dense}, {dsize} | accuracy {comp}, {csize} | "
                     f"{where} |", sweep["command"]))
    return rows


def llm_rows(path: Path, command: str) -> list[tuple[str, str]]:
    d = json.loads(path.read_text())
    where = f"{d['device']}, {d['date_utc'][:10]}"
    rows = []
    for name, what in LLM_ROWS:
        r = d["recipes"][name]
        rows.append((f"| {what} | perplexity {r['perplexity_before']:.2f}, "
                    f"{_mb(r['size_bytes_before'])} | perplexity {r['perplexity_after']:.2f}, "
                    f"{_mb(r['size_bytes_after'])} | {where} |", command))
    return rows


REAL_LLM = "eval_llm_real_2026-12-08_smollm2_h100.json"
# (row key in that file, what the README row says)
REAL_LLM_ROWS = (
    ("alps+recon@mix", "SmolLM2-135M-Instruct (GGUF), held-out man pages / info manuals: ALPS "
     "2:4 + block reconstruction, calibrated on code + teacher samples"),
    ("gptq4@code", "same model, GPTQ int4 group 64 (no 2:4)"),
)


def real_llm_rows(path: Path) -> list[tuple[str, str]]:
    """Perplexity on the two held-out domains, dense and compressed (ratio in bold)."""
    d = json.loads(path.read_text())
    where = f"{d['device']}, {d['date_utc'][:10]}"
    dense = " / ".join(f"{d['dense'][k]:.2f}" for k in d["eval_domains"])
    rows = []
    for key, what in REAL_LLM_ROWS:
        r = d["rows"][key]
        comp = " / ".join(f"{r['perplexity'][k]:.2f}" for k in d["eval_domains"])
        ratio = " / ".join(f"{r['ratio'][k]:.2f}x" for k in d["eval_domains"])
        rows.append((f"| {what} | perplexity {dense} | perplexity {comp}, **{ratio}** | "
                     f"{where} |", r["command"]))
    return rows


def speed_rows(bench_dir: Path) -> list[tuple[str, str]]:
    rows = []
    for file, model, variant, what in SPEED_ROWS:
        d = json.loads((bench_dir / file).read_text())
        v = d["models"][model]["variants"][variant]
        ref, var = _ms(v["paired_blocks"], "ref"), _ms(v["paired_blocks"], "var")

        def cell(times: list[float], median: float) -> str:
            return f"{median:.2f} ms ({min(times):.2f}-{max(times):.2f})"

        rows.append((f"| {what} | {cell(ref, v['paired_ref_ms'])} | "
                     f"{cell(var, v['paired_ms'])}, **{v['paired_ratio']:.2f}x** | "
                     f"{d['device']}, {d['date'][:10]} |", d["command"].split(" --out-dir")[0]))
    return rows


def generate_command(args: dict) -> str:
    """The ``tools/bench_generate.py`` command line of a run's recorded ``args`` (every option
    that shapes the model, the inputs or the ways timed)."""
    keys = ("sections", "layers", "prompt", "new", "batches", "precisions", "dense", "rounds",
            "calls")
    flags = [f"--{key} {args[key]}" for key in keys]
    flags.append(f"--per-step {args['per_step'] or chr(34) * 2}")
    flags.append("--peers" if args["peers"] else "--no-peers")
    flags += [] if args.get("siblings", True) else ["--no-siblings"]
    flags += [] if args.get("head", "bf16") == "bf16" else [f"--head {args['head']}"]
    flags += ["--profile"] if args.get("profile") else []
    flags += [f"--{key.replace('_', '-')}" for key, on in args.items()
              if key.startswith("inductor_") and on]
    return "python tools/bench_generate.py " + " ".join(flags)


def generate_rows(bench_dir: Path) -> list[tuple[str, str]]:
    """generate() against the fastest dense way of the same process: ms a token (tokens/s) of
    each side's paired rounds, the ratio of the paired times."""
    rows = []
    for file, batch, way, what in GEN_ROWS:
        d = json.loads((bench_dir / file).read_text())
        g = d["generate"][batch]
        v, new = g["ways"][way], g["new_tokens"]
        ref_ms = v["paired_ref_ms"] / new
        rows.append((f"| {what} | {ref_ms:.2f} ms a token ({int(batch) * 1e3 / ref_ms:,.0f} "
                     f"tok/s) | {v['ms'] / new:.2f} ms a token "
                     f"({v['tokens_per_s']:,.0f} tok/s), **{v['ratio']:.2f}x** | "
                     f"{d['device']}, {d['date'][:10]} |", generate_command(d["args"])))
    return rows


def generation_table(bench_dir: Path = DOCS / "bench") -> str:
    """docs/gpu.md's generate() table: per way, ms a token and tokens/s of its paired rounds,
    the ratio to the fastest dense way of its process, the captured decode step (and the rest of
    a token), the first ``accelerate`` + first generate, the target; each row numbered by the
    command that reproduces it, listed below the table."""
    rows = []
    for file, batch, way, what, target in GPU_GEN_ROWS:
        d = json.loads((bench_dir / file).read_text())
        v = d["generate"][batch]["ways"][way]
        ratio = f"{v['ratio']:.2f}x"
        step = ("" if v.get("decode_step_ms") is None
                else f"{v['decode_step_ms']:.2f} ({v['outside_step_ms']:.2f})")
        first = f"{v['accelerate_s'] + v['first_call_s']:.0f}" if "accelerate_s" in v else ""
        met = "" if target is None else f"{target}x: {'met' if v['ratio'] >= target else 'not met'}"
        rows.append((f"| {batch} | {what} | {v['ms_per_token']:.2f} | {v['tokens_per_s']:,.0f} | "
                     f"{f'**{ratio}**' if target else ratio} | {step} | {first} | {met} | "
                     f"{d['device']}, {d['date'][:10]} |", generate_command(d["args"])))
    commands = list(dict.fromkeys(command for _, command in rows))
    lines = ["| batch | way | ms a token | tokens/s | ratio (paired) | decode step ms (rest) | "
             "first call s | target | measured on | command |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | :---: |"]
    lines += [f"{row} ({commands.index(command) + 1}) |" for row, command in rows]
    lines.append("")
    lines += [f"{i}. `{command}`" for i, command in enumerate(commands, 1)]
    return "\n".join(lines)


def results_table(docs: Path = DOCS) -> str:
    """README's results: accuracy (MNIST-1D, three seeds: mean and range), perplexity and
    size (a small Llama), speed (ratio to the fastest dense bf16 way, timed alternately with
    it; time per call: median, and the range over the alternating blocks) and generation
    (ms a token, paired with the fastest dense way); each row numbered by the command that
    reproduces it, listed below the table."""
    rows = [*mnist_rows(docs / "seed_sweep_cpu.json"),
            *llm_rows(docs / "small_llama_h200.json", SMALL_LLAMA_H200),
            *real_llm_rows(docs / "bench" / REAL_LLM),
            *speed_rows(docs / "bench"), *generate_rows(docs / "bench")]
    commands = list(dict.fromkeys(command for _, command in rows))
    lines = ["| result | dense | compressed | measured on | command |",
             "| --- | ---: | ---: | --- | :---: |"]
    lines += [f"{row} ({commands.index(command) + 1}) |" for row, command in rows]
    lines.append("")
    lines += [f"{i}. `{command}`" for i, command in enumerate(commands, 1)]
    return "\n".join(lines)


def _first_sentence(path: Path) -> str:
    """The first sentence of a config file's header comment (after ``@package``)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text.startswith("@package"):
            lines.append(text)
    text = " ".join(lines)
    match = re.match(r"(.+?(?<!e\.g)(?<!i\.e)[.:])(\s|$)", text)
    return (match.group(1) if match else text).rstrip(":").replace("|", "\\|")


def groups_section() -> str:
    """Every config group with its options (each with the first sentence of its file), the
    recipes, and the keys whose values come from the schema or a registry."""
    from sparsekit.run.cli import choices_help, group_options
    from sparsekit.run.resources import conf_dir, recipes_dir

    out = []
    groups = sorted(p.name for p in conf_dir().iterdir() if p.is_dir())
    for group in [*groups, "recipe"]:
        folder = recipes_dir() if group == "recipe" else conf_dir() / group
        out.append(f"**`{group}`**" + (" (ready-made recipes: `recipe=NAME`)"
                                       if group == "recipe" else ""))
        out.append("")
        for option in group_options(group):
            about = _first_sentence(folder / f"{option}.yaml")
            out.append(f"- `{group}={option}`" + (f": {about}" if about else ""))
        out.append("")
    out.append("Keys with a fixed set of values (from the schema and the registries of criteria, "
               "quantization schemes and accel variants):")
    out.append("")
    out += [f"- `{key}`: {values}" for key, values in
            (line.split(": ", 1) for line in choices_help().splitlines())]
    return "\n".join(out)


BLOCKS = {  # name: (file, generator)
    "results": (ROOT / "README.md", results_table),
    "groups": (DOCS / "cli.md", groups_section),
    "generation": (DOCS / "gpu.md", generation_table),
}


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- generated: {name} [^\n]*-->\n)(.*?)(<!-- end generated: "
                      rf"{name} -->)", re.S)


def current(name: str) -> str:
    """The block ``name`` as it stands in its file (without its last newline)."""
    path, _ = BLOCKS[name]
    match = _pattern(name).search(path.read_text())
    if match is None:
        raise ValueError(f"{path.name} has no generated block {name!r}")
    return match.group(2).removesuffix("\n")


def write(name: str) -> bool:
    """Rewrite block ``name`` in its file; True when it changed."""
    path, make = BLOCKS[name]
    text = path.read_text()
    current(name)  # the block must exist
    new = _pattern(name).sub(lambda m: m.group(1) + make() + "\n" + m.group(3), text, count=1)
    path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the generated blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 if a block is out of date")
    args = ap.parse_args(argv)
    stale = []
    for name, (path, make) in BLOCKS.items():
        if args.write:
            print(f"{path.relative_to(ROOT)}: {name} {'rewritten' if write(name) else 'as is'}")
        elif args.check:
            if current(name) != make():
                stale.append(f"{path.relative_to(ROOT)} ({name})")
        else:
            print(make() + "\n")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python tools/docs_tables.py --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
