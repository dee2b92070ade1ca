"""Where a first ``generate()`` of an accelerated LM goes: per precision, the seconds of
``accelerate`` and of the first generate, and of the generate's calls that built its prefill
and decode graphs (``report.seconds["generate_prefill"]``, ``["generate_decode"]``: compile,
warm-up, capture), each precision in a fresh process with an empty inductor cache (a cold
first call, as a user's first run).

    python tools/bench_first_call.py --out first_call.json                 # CPU, ~3 minutes
    python tools/bench_first_call.py --device cuda --layers 32 --hidden 4096 ...   # a GPU
    python tools/bench_first_call.py --smoke --out /tmp/first_call.json    # seconds (CI)

The model: a HF LlamaForCausalLM (random weights; ``--layers``, ``--hidden``,
``--intermediate``), 2:4 by magnitude on every Linear but the LM head; ``dense``: the same
pruned model accelerated with ``sparsity="dense"``; ``bf16``: bf16 2:4; ``fp8w``: quantized
``fp8_weight_only`` first (fp8 weights, bf16 activations); ``int4``: int4 2:4 (RTN group 128).
A prompt of ``--prompt`` tokens, ``--new`` new tokens, greedy. On CPU the layers run their
kernels' references: the graphs' build time is what this measures there, not speed.
``--smoke``: one layer, the eager backend (no inductor): the structure of the result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

PRECISIONS = ("dense", "bf16", "fp8w", "int4")


def one(args: argparse.Namespace, precision: str) -> dict:
    """Build, accelerate and generate once with ``precision`` in this process."""
    import torch
    from llm_common import random_llama

    import sparsekit as sk

    device = torch.device(args.device)
    model = random_llama(dict(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=1024),
        device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    sk.prune_(model, pattern="2:4", criterion="magnitude", exclude=["lm_head"])
    if precision == "fp8w":
        sk.quantize_(model, "fp8_weight_only", exclude=["lm_head"])
    ids = torch.randint(0, 512, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    fast = sk.accelerate(model, {"input_ids": ids.to(device)},
                         precision="bf16" if precision == "dense" else precision,
                         sparsity="dense" if precision == "dense" else "2:4", device=device,
                         compile=sk.CompileOptions(backend=args.backend, warmup=False))
    t1 = time.perf_counter()
    out = fast.generate(ids.to(device), max_new_tokens=args.new)
    t2 = time.perf_counter()
    return {"precision": precision, "accelerate_s": t1 - t0, "first_generate_s": t2 - t1,
            "graphs_s": {k.removeprefix("generate_"): v for k, v in fast.report.seconds.items()
                         if k.startswith("generate_")},
            "compiles": fast.report.compiles, "tokens": out[0, -args.new:].tolist()}


def run_fresh(argv: list[str], precision: str) -> dict:
    """:func:`one` in a new Python process with its own empty inductor cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        done = subprocess.run([sys.executable, __file__, *argv, "--one", precision], env=env,
                              capture_output=True, text=True)
    if done.returncode:
        return {"precision": precision, "error": done.stderr.strip().splitlines()[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="first_call.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.backend = 1, "eager"
    if args.one:
        print(json.dumps(one(args, args.one)), flush=True)
        return {}
    precisions = args.precisions.split(",")
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        ap.exit(2, f"bench_first_call: unknown --precisions {bad} (choose from "
                   f"{', '.join(PRECISIONS)})\n")
    passed = list(argv if argv is not None else sys.argv[1:])
    res = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "host": platform.processor() or platform.machine(), "args": vars(args), "runs": []}
    for precision in precisions:
        res["runs"].append(run_fresh(passed, precision))
        print(json.dumps(res["runs"][-1]), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
