"""Perplexity of dense, SparseGPT 2:4, 2:4 + int4 round-to-nearest and 2:4 + int4 GPTQ (one
joint sweep), and of dense int4 RTN vs GPTQ, on a small Llama and on the stdlib LM recipe.

    python tools/train_small_llama.py --out-dir small_llama --hidden 128 --layers 2 \\
        --intermediate 512 --vocab 1024 --seq-len 128 --minutes 6 --recipes ""
    python tools/eval_int4.py --llama-dir small_llama           # both models, minutes on CPU
    python tools/eval_int4.py --smoke --out /tmp/int4.json      # seconds (CI)
    python tools/eval_int4.py --llama-dir small_llama --no-stdlib --head  # + LM head variants

Every figure comes from a run of the command line's pipeline (in this process, composed as
``sparsekit OVERRIDES`` composes it): its summary.json ``variants`` (``quant.compare=true``),
or (``--head``) its ``dense`` and ``compressed`` figures.

- small Llama (``--llama-dir``: the ``model/`` and ``corpus.txt`` that train_small_llama.py
  writes): ``recipe=llm_sparsegpt_24_int4``, then the same with ``prune.pattern=none`` (GPTQ
  without pruning);
- stdlib LM: ``recipe=stdlib_lm_24`` (the byte-level transformer, trained dense by the run and
  cached) switched to SparseGPT 2:4 in one shot with int4 GPTQ (``prune.criterion=sparsegpt
  prune.fine_tune=false schedule=oneshot quant=int4_weight quant.method=gptq
  quant.compare=true``) and ``model.kwargs.d_model=128``, so that every pruned layer's input is
  a multiple of the 128-input scale groups (the recipe's d_model=64 is not); then
  ``prune.pattern=none``.

The targets checked (``targets`` in the JSON): joint 2:4 + GPTQ int4 perplexity <= 1.05x of
SparseGPT 2:4 unquantized, and GPTQ strictly below RTN, with and without 2:4.

``--head`` (the small Llama): the LM head, which the recipe leaves unquantized, rounded to
nearest as ``tools/bench_generate.py --head int4|fp8`` runs it in generation: int4 (the run's
scheme, ``int4_weight``: group 128) and fp8 (W8A8: per-channel weight and per-token
activation scales), each by a run with ``prune.pattern=none quant.method=rtn
quant.include=[lm_head]``: on the dense model, and on the joint 2:4 + GPTQ model (``model.path``
the 2:4 run's ``hf/`` export, its dequantized weights: that run's dense figure is the joint
model's, which is checked). ``head`` in the JSON: each variant's perplexity and runs (with the
layers each quantized: ``lm_head`` alone).

``--smoke``: a tiny random Llama and a tiny stdlib LM with one int4 scale per output
channel (their inputs are narrower than 128), a few steps: the shape of the result, not its
values.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import UTC, datetime
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from llm_common import llama_config, stdlib_corpus, train_tokenizer

from sparsekit.models.hf import hf
from sparsekit.run.cli import register_configs, to_config
from sparsekit.run.pipeline import run
from sparsekit.run.resources import conf_dir

TARGET_RATIO = 1.05
#: ``--head``'s LM head variants: name -> scheme (None: the run's int4 scheme); fp8 is W8A8 as
#: bench_generate's ``--head fp8`` (``PlanOptions.dense_precision="fp8"``)
HEAD_SCHEMES = {"int4_head": None, "fp8_head": "fp8"}


def run_summary(overrides: list[str], run_dir: Path, reuse: bool = False) -> dict:
    """The summary.json of one pipeline run of ``overrides`` into ``run_dir``. ``reuse``: read
    the one a finished run left in ``run_dir`` instead (its resolved config must be the one
    ``overrides`` compose)."""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = to_config(compose("config", overrides=overrides))
    if reuse and (run_dir / "summary.json").exists():
        saved = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
        want = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
        if saved != want:
            raise SystemExit(f"{run_dir}: its config.yaml is not what the overrides give")
        summary = json.loads((run_dir / "summary.json").read_text())
    else:
        summary = run(cfg, run_dir)
    return summary


def run_variants(overrides: list[str], run_dir: Path, reuse: bool = False) -> dict:
    """One pipeline run of ``overrides`` into ``run_dir`` (:func:`run_summary`): its variants
    and seconds."""
    summary = run_summary(overrides, run_dir, reuse)
    return {"overrides": overrides, "started_utc": summary["started_utc"],
            "variants": summary["variants"], "sparsity": summary["sparsity"],
            "seconds": summary["seconds"]}


def evaluate_model(name: str, base: list[str], scheme: str, out: Path, reuse: bool) -> dict:
    """The 2:4 run and the dense (``prune.pattern=none``) run of one model, with targets."""
    sparse = run_variants(base, out / name / "2_4", reuse)
    dense = run_variants([*base, "prune.pattern=none"], out / name / "dense", reuse)
    v, d = sparse["variants"], dense["variants"]
    joint, pruned = v[f"2:4+{scheme}/gptq"], v["2:4"]
    return {
        "runs": {"2:4": sparse, "dense": dense},
        "perplexity": {
            "dense": v["dense"], "2:4": pruned,
            "2:4+int4_rtn": v[f"2:4+{scheme}/rtn"], "2:4+int4_gptq": joint,
            "int4_rtn": d[f"dense+{scheme}/rtn"], "int4_gptq": d[f"dense+{scheme}/gptq"],
        },
        "targets": {
            "joint_over_2_4": joint / pruned,
            "joint_within_1.05x": joint / pruned <= TARGET_RATIO,
            "gptq_below_rtn_2_4": joint < v[f"2:4+{scheme}/rtn"],
            "gptq_below_rtn_dense": d[f"dense+{scheme}/gptq"] < d[f"dense+{scheme}/rtn"],
        },
    }


def evaluate_head(name: str, base: list[str], scheme: str, out: Path, reuse: bool,
                  joint: float) -> dict:
    """``--head``: the LM head alone rounded to nearest (:data:`HEAD_SCHEMES`) on the dense
    model and on the joint 2:4 + GPTQ model of :func:`evaluate_model`'s 2:4 run (its ``hf/``
    export, whose perplexity must be ``joint``)."""
    runs, perplexity = {}, {}
    for model, source in (("dense", []),
                          ("2:4+int4_gptq", [f"model.path={out / name / '2_4' / 'hf'}"])):
        for head, head_scheme in HEAD_SCHEMES.items():
            overrides = [*base, *source, "prune.pattern=none", "quant.method=rtn",
                         "quant.compare=false", f"quant.scheme={head_scheme or scheme}",
                         "quant.include=[lm_head]", "quant.exclude=[]"]
            key = f"{model}+{head}"
            s = run_summary(overrides, out / name / key.replace(":", "_"), reuse)
            metric = s["metric"]
            runs[key] = {"overrides": overrides, "started_utc": s["started_utc"],
                         "base": s["dense"][metric], "perplexity": s["compressed"][metric],
                         "quantized": [ly["name"] for ly in s["quant"]["layers"]
                                       if ly["status"] == "quantized"],
                         "seconds": s["seconds"]}
            perplexity[key] = s["compressed"][metric]
    for key, r in runs.items():  # the exported joint model is the one the 2:4 run measured
        if key.startswith("2:4") and abs(r["base"] / joint - 1) > 1e-4:
            raise SystemExit(f"{name}: {key}'s model (the 2:4 run's hf/) has perplexity "
                             f"{r['base']}, the joint model {joint}")
    return {"perplexity": perplexity, "runs": runs}


def smoke_llama(out: Path) -> Path:
    """A tiny random Llama with a tokenizer and corpus in ``out`` (train_small_llama's layout)."""
    corpus = stdlib_corpus(out / "corpus.txt", 60_000)
    tokenizer = train_tokenizer(corpus.read_text(), 300)
    torch.manual_seed(0)
    model = hf("causal_lm", llama_config(len(tokenizer), 32, 1, 64, 2, 2, 64))
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-dir", type=Path, help="train_small_llama.py's --out-dir")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--calibration-batches", type=int, default=16, help="of data.batch_size")
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--stdlib-d-model", type=int, default=128)
    ap.add_argument("--no-stdlib", action="store_true", help="the small Llama only")
    ap.add_argument("--work-dir", type=Path, default=Path("eval_int4"))
    ap.add_argument("--out", type=Path, help="the JSON (default journal/data/int4_<date>.json)")
    ap.add_argument("--reuse", action="store_true",
                    help="take finished runs' summary.json from --work-dir instead of rerunning")
    ap.add_argument("--head", action="store_true",
                    help="the small Llama also with its LM head int4 and fp8 (round to "
                         "nearest), dense and joint 2:4 + GPTQ")
    ap.add_argument("--smoke", action="store_true", help="tiny models, seconds")
    a = ap.parse_args(argv)
    work = a.work_dir.resolve()
    scheme = "int4_weight"
    tiny_lm: list[str] = []
    if a.smoke:
        scheme, a.seq_len, a.calibration_batches, a.eval_batches = "int4_weight_channel", 32, 2, 2
        a.stdlib_d_model, a.llama_dir = 32, smoke_llama(work / "llama")
        tiny_lm = ["model.kwargs.n_layers=1", "train.dense_steps=4", "data.kwargs.max_bytes=40000",
                   "data.eval_batch_size=8"]
    common = [f"prune.calibration_batches={a.calibration_batches}",
              f"data.eval_batches={a.eval_batches}", f"train.device={a.device}",
              "train.quiet=true", "tracker=none", "bench=off", f"cache_dir={work / 'cache'}",
              f"quant.scheme={scheme}"]
    register_configs()
    date = datetime.now(UTC)
    result = {"date_utc": date.strftime("%Y-%m-%d %H:%M"),
              "device": a.device if a.device != "cuda" else torch.cuda.get_device_name(),
              "cpu": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "scheme": scheme, "models": {}}
    if a.llama_dir is not None:
        llama = a.llama_dir.resolve()
        base = ["recipe=llm_sparsegpt_24_int4", f"model.path={llama / 'model'}",
                f"data.path={llama / 'corpus.txt'}", f"data.seq_len={a.seq_len}", *common]
        r = evaluate_model("small_llama", base, scheme, work, a.reuse)
        if a.head:
            r["head"] = evaluate_head("small_llama", base, scheme, work, a.reuse,
                                      r["perplexity"]["2:4+int4_gptq"])
        result["models"]["small_llama"] = r
    if not a.no_stdlib:
        base = ["recipe=stdlib_lm_24", "prune.criterion=sparsegpt", "prune.fine_tune=false",
                "schedule=oneshot", "quant=int4_weight", "quant.method=gptq",
                "quant.compare=true", "quant.exclude=[lm_head]",
                f"model.kwargs.d_model={a.stdlib_d_model}", *tiny_lm, *common]
        result["models"]["stdlib_lm"] = evaluate_model("stdlib_lm", base, scheme, work,
                                                       a.reuse)
    out = a.out or Path(__file__).resolve().parents[1] / "journal" / "data" / (
        f"int4_{date.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({m: r["perplexity"] | r.get("head", {}).get("perplexity", {}) | r["targets"]
                      for m, r in result["models"].items()}, indent=2))


if __name__ == "__main__":
    main()
