"""Generation numerics of an accelerated 2:4 model against the eager masked model, on a trained
small Llama (``tools/train_small_llama.py``), where the logits' margins are real (on random
weights a greedy token flips at the first rounding difference).

For a model directory and its corpus: every Linear but the LM head is masked 2:4 by magnitude
(the "eager masked model", bfloat16, HF's own ``generate`` with its dynamic cache, no compile);
prompts are cut from the end of the corpus (the recipes' held-out part). Then, per batch in
``--batches`` (batch 1 runs the decode kernels at M = 1, larger batches at M = batch):
- ``sk_bf16_2:4``, ``sk_fp8_2:4`` (W8A8) and ``sk_fp8w_2:4`` (W8A16, fp8 weights alone):
  ``sk.accelerate`` then ``fast.generate``, greedy: the
  fraction of new tokens equal to the eager masked model's, per prompt the first position that
  differs, whether all of the first ``--new`` tokens are equal (the target for bf16 2:4), and
  at each first divergence the reference's own logit margin and whether it is a bfloat16 tie
  (``equal_but_ties``: every divergence is one); beside them the control
  ``control_hf_static_cache``: the eager model on HF's static cache against its dynamic one;
- the logits error of a teacher-forced forward over the reference's tokens (prompt + new):
  ``||logits - ref|| / ||ref||`` against the eager masked model in float32; for fp8 beside the
  same error of torchao's fp8 (dynamic per-row activations, per-row weights) on the masked
  model, when torchao runs (target: sparsekit's fp8 within 10% of torchao's); the summary
  also gives fp8 weight-only's error over W8A8's (what quantizing the activations costs).

    python tools/train_small_llama.py --device cpu --minutes 15 --hidden 512 --layers 2 \\
        --intermediate 1024 --heads 8 --vocab 2048 --seq-len 128 --recipes "" --out-dir sl
    python tools/check_generate_numerics.py --model sl/model --corpus sl/corpus.txt \\
        --out numerics.json                                        # on the GPU
    python tools/check_generate_numerics.py --smoke --out /tmp/n.json   # CPU, random tiny model

On CPU the accelerated model runs the kernels' reference paths (the numerics, not the speed).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

import sparsekit as sk

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import (  # noqa: E402  (tools/bench_generate.py, beside this script)
    agreement, eager_tokens, torchao_quantize_)


def load(args, device: torch.device):
    """(masked bf16 model on ``device``, prompt token ids (prompts, length) on CPU)."""
    import transformers

    if args.smoke:
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024,
                                       num_hidden_layers=1, num_attention_heads=8,
                                       num_key_value_heads=4, max_position_embeddings=512)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(0, 256, (args.prompts, args.prompt_len),
                            generator=torch.Generator().manual_seed(0))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
        tok = transformers.AutoTokenizer.from_pretrained(args.model)
        text = Path(args.corpus).read_text(errors="replace")
        tail = tok(text[-len(text) // 10:])["input_ids"]  # the end: the recipes' held-out part
        stride = max(args.prompt_len, (len(tail) - args.prompt_len) // args.prompts)
        ids = torch.tensor([tail[i * stride:i * stride + args.prompt_len]
                            for i in range(args.prompts)])
    model.config._attn_implementation = "sdpa"
    model = model.to(device, torch.bfloat16).eval()
    sk.prune_(model, pattern="2:4", criterion="magnitude", exclude=["lm_head"])
    return model, ids


@torch.no_grad()
def logits_error(fn, ids: torch.Tensor, ref_logits: torch.Tensor) -> float:
    got = fn(ids).logits.float()
    return ((got - ref_logits).norm() / ref_logits.norm()).item()


def run(args, save=lambda res: None) -> dict:
    """The rows (see the module's docstring); ``save(result so far)`` after each accelerated
    row, so that a run cut short by its time limit keeps what it measured."""
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    master, prompts = load(args, device)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "args": vars(args), "batches": {}}
    batches = [int(b) for b in args.batches.split(",")]
    refs = {}
    for batch in batches:
        ids = prompts[:batch].to(device)
        ref = eager_tokens(master, ids, args.new)
        with torch.no_grad():
            ref_logits = master(ref).logits.float()
        refs[batch] = (ids, ref, ref_logits)
        # the control: the same eager model on HF's static cache (attention over a longer,
        # masked cache) against its dynamic cache, the reference
        with torch.no_grad():
            static = master.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new,
                                     do_sample=False, pad_token_id=0,
                                     cache_implementation="static")
        res["batches"].setdefault(str(batch), {})["control_hf_static_cache"] = {
            "agreement": agreement(static, ref, ids.shape[1], ref_logits)}
    # generate compiles its own graphs: the example's forward is not warmed up
    compile_ = (sk.CompileOptions(backend="inductor", warmup=False) if device.type == "cuda"
                else False)
    peers: dict = {}
    if device.type == "cuda":
        try:
            peers["torchao_fp8_dense"] = torchao_quantize_(copy.deepcopy(master), "fp8")
        except Exception as e:  # noqa: BLE001  (a peer that does not run is recorded)
            res["torchao_fp8_dense"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    for name, precision in (("sk_bf16_2:4", "bf16"), ("sk_fp8_2:4", "fp8"),
                            ("sk_fp8w_2:4", "fp8w")):
        t0 = time.perf_counter()
        fast = sk.accelerate(copy.deepcopy(master), {"input_ids": refs[batches[0]][0]},
                             precision=precision, sparsity="2:4", device=device,
                             compile=compile_)
        res.setdefault("accelerate_s", {})[name] = time.perf_counter() - t0
        print(json.dumps({"way": name, "accelerate_s": res["accelerate_s"][name]}), flush=True)
        res.setdefault("notes", {})[name] = [n for n in fast.report.notes
                                              if n.startswith("decode")]
        for batch, (ids, ref, ref_logits) in refs.items():
            out = fast.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new,
                                do_sample=False)
            row = {"agreement": agreement(out, ref, ids.shape[1], ref_logits),
                   "logits_error": logits_error(fast, ref, ref_logits)}
            res["batches"][str(batch)][name] = row
            print(json.dumps({"batch": batch, "way": name, **row["agreement"],
                              "logits_error": row["logits_error"]}), flush=True)
            save(res)
        del fast
    for name, model in peers.items():
        for batch, (ids, ref, ref_logits) in refs.items():
            out = eager_tokens(model, ids, args.new)
            row = {"agreement": agreement(out, ref, ids.shape[1], ref_logits),
                   "logits_error": logits_error(model, ref, ref_logits)}
            res["batches"][str(batch)][name] = row
            print(json.dumps({"batch": batch, "way": name, **row["agreement"],
                              "logits_error": row["logits_error"]}), flush=True)
    res["summary"] = summary(res["batches"])
    print(json.dumps(res["summary"]), flush=True)
    return res


def summary(rows: dict) -> dict:
    """Per batch: bf16 2:4's first ``--new`` tokens all equal (the target), and fp8 2:4's
    logits error over torchao fp8's (target <= 1.10) where torchao ran."""
    out = {}
    for batch, ways in rows.items():
        s = {}
        if "sk_bf16_2:4" in ways:
            s["bf16_greedy_all_equal"] = ways["sk_bf16_2:4"]["agreement"]["all_equal"]
            s["bf16_greedy_equal_but_ties"] = ways["sk_bf16_2:4"]["agreement"]["equal_but_ties"]
        if "sk_fp8w_2:4" in ways and "sk_fp8_2:4" in ways:
            s["fp8w_error_over_fp8"] = (ways["sk_fp8w_2:4"]["logits_error"]
                                        / ways["sk_fp8_2:4"]["logits_error"])
        if "sk_fp8_2:4" in ways and "torchao_fp8_dense" in ways:
            ratio = ways["sk_fp8_2:4"]["logits_error"] / ways["torchao_fp8_dense"]["logits_error"]
            s["fp8_error_over_torchao"] = ratio
            s["fp8_within_10pct"] = ratio <= 1.10
        out[batch] = s
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a from_pretrained directory (train_small_llama's model)")
    ap.add_argument("--corpus", help="its text (prompts are cut from the end)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--smoke", action="store_true", help="a random tiny model on CPU")
    ap.add_argument("--out", default="generate_numerics.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.prompt_len, args.new, args.batches = 2, 12, 8, "1,2"
    elif not (args.model and args.corpus):
        ap.error("--model and --corpus are required (or --smoke)")
    def save(res):
        Path(args.out).write_text(json.dumps(res, indent=1))
    res = run(args, save)
    save(res)
    return res


if __name__ == "__main__":
    main()
