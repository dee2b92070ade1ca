"""Time joint SparseGPT 2:4 + GPTQ int4 (one sweep, group 128) on a model of Llama-3-8B's
shapes with random weights: issue 32's target is the whole 32-layer model on 128 calibration
sequences of 2048 tokens in 15 minutes or less, memory bounded (block by block).

    python tools/bench_sparsegpt_gptq.py --layers 8 --out sgpt_8b.json     # GPU
    python tools/bench_sparsegpt_gptq.py --smoke --out /tmp/sgpt.json      # seconds, CPU

The sweep is :func:`sparsekit.quantize_` with ``method=GPTQ(pattern="2:4")`` and
``exclude=["lm_head"]``, exactly what ``quant.method=gptq`` with ``prune.criterion=sparsegpt``
runs on the command line. It goes block by block (every block's inputs recorded, each block
solved from its own inputs, then run once to give the next its inputs), so each of the
identical decoder blocks costs the same: the JSON has the measured seconds for ``--layers``
blocks and, when that is fewer than ``--full-layers`` (32), the figure scaled to the whole model
(``seconds_full_scaled``: measured x full / layers; labelled as scaled, not measured), beside
the peak GPU memory and a check that every pruned layer holds 2:4 and int4 values. One device
call (10 minutes) holds a few 8B blocks: ``--layers 8`` is the default.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from llm_common import llama3_8b_shapes, random_llama
from torch import nn

import sparsekit as sk

FULL_LAYERS = 32
TARGET_MINUTES = 15.0


def model_of(smoke: bool, layers: int, device: torch.device) -> nn.Module:
    """A LlamaForCausalLM of Llama-3-8B's shapes (``layers`` decoder blocks; ``smoke``: a tiny
    one whose widths are multiples of the 128-input scale groups), random weights, bf16 on
    CUDA (float32 on CPU)."""
    config = llama3_8b_shapes(layers) if not smoke else dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return random_llama(config, device,
                        torch.bfloat16 if device.type == "cuda" else torch.float32)


def calibration(vocab: int, sequences: int, length: int, batch: int, device: torch.device
                ) -> list[dict]:
    """``sequences`` random token sequences of ``length``, in batches of ``batch``."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (sequences, length), generator=g)
    return [{"input_ids": ids[i:i + batch].to(device)} for i in range(0, sequences, batch)]


def check_24_int4(model: nn.Module) -> dict:
    """Every quantized layer: int4 values in [-8, 7] and at most 2 nonzeros in every group of
    4 along its input."""
    layers, bad = 0, []
    for name, mod in model.named_modules():
        scale = getattr(mod, "weight_scale", None)
        if scale is None or name.endswith("lm_head"):
            continue
        layers += 1
        w = mod.weight.detach()
        nz = (w.reshape(w.shape[0], -1, 4) != 0).sum(-1)
        if not (bool(nz.le(2).all()) and int(w.min()) >= -8 and int(w.max()) <= 7):
            bad.append(name)
    return {"layers": layers, "failing": bad, "ok": layers > 0 and not bad}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="decoder blocks of 8B shapes")
    ap.add_argument("--full-layers", type=int, default=FULL_LAYERS,
                    help="the whole model's blocks the measured time is scaled to")
    ap.add_argument("--sequences", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="calibration sequences per batch")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny Llama (2 blocks, widths 128/256) on the CPU: seconds")
    ap.add_argument("--out", default="bench_sparsegpt_gptq.json")
    args = ap.parse_args(argv)
    if args.layers < 1 or args.full_layers < args.layers:
        raise SystemExit(f"--layers must be 1..--full-layers ({args.full_layers}), "
                         f"got {args.layers}")
    if args.smoke:
        args.layers, args.full_layers, args.sequences, args.seq_len, args.batch = 2, 4, 4, 32, 2
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("bench_sparsegpt_gptq.py: no CUDA device (use --smoke on the CPU)")
    else:
        device = torch.device("cuda")
    model = model_of(args.smoke, args.layers, device)
    batches = calibration(model.config.vocab_size, args.sequences, args.seq_len, args.batch,
                          device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    sk.quantize_(model, "int4_weight", calibration=batches,
                          method=sk.GPTQ(pattern="2:4"), exclude=["lm_head"])
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    res = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__, "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "args": vars(args),
        "seconds": seconds,
        "peak_gpu_gb": (torch.cuda.max_memory_allocated() / 2**30
                        if device.type == "cuda" else None),
        "check": check_24_int4(model),
    }
    if args.layers < args.full_layers:
        res["seconds_full_scaled"] = seconds * args.full_layers / args.layers
    full = res.get("seconds_full_scaled", seconds)
    res["target"] = {"minutes": TARGET_MINUTES, "full_minutes": full / 60,
                     "met": full / 60 <= TARGET_MINUTES,
                     "how": "scaled from the blocks measured" if args.layers < args.full_layers
                     else "measured"}
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("device", "seconds", "peak_gpu_gb", "target",
                                          "check")}))
    return res


if __name__ == "__main__":
    main()
