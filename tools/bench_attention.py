"""Decode attention on the GPU: sparsekit's kernel (sparsekit/accel/kernels/attention/decode.py)
against what HF's SDPA path runs in a compiled static-cache decode step, per call, with the
bytes bound.

Llama-3-8B attention (32 query heads, 8 kv heads, head dim 128), one query token per
sequence, a static cache of ``--lengths`` positions of which the first ``--filled`` share take
part (a left-padded prompt's pad positions excluded too: the first 5 of sequence 0), batch in
``--batches``. Ways:
- ``hf_sdpa``: ``scaled_dot_product_attention`` on the kv heads repeated per query head with the
  boolean mask, compiled (``torch.compile``) as HF's ``sdpa_attention_forward`` runs under
  dynamo with a mask;
- ``sk``: ``sparsekit::decode_attention``.
Each call in a CUDA graph, caches cycled past the L2 (every layer has its own). Per row:
microseconds, the error against the float32 reference, the bytes sk must read at least (the
filled keys and values once) and the share of the HBM bound, and ``hf_over_sk``.

    python tools/bench_attention.py --out attention.json       # on a CUDA GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsekit.accel.kernels.attention import op as attn_op
from sparsekit.accel.kernels.attention import decode as attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import bound_tbs, copies_for, time_rotating  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def hf_way(q, k, v, mask, scale):
    """HF's compiled decode attention with a mask: repeat_kv, then SDPA."""
    rep = q.shape[1] // k.shape[1]
    kk = k[:, :, None].expand(-1, -1, rep, -1, -1).reshape(q.shape[0], -1, *k.shape[2:])
    vv = v[:, :, None].expand(-1, -1, rep, -1, -1).reshape(q.shape[0], -1, *v.shape[2:])
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[:, None, None, :],
                                          scale=scale).transpose(1, 2)


def case(batch: int, length: int, filled: int, device, gen: torch.Generator) -> dict:
    shape = (batch, KV_HEADS, length, HEAD_DIM)
    nbytes = 2 * batch * KV_HEADS * length * HEAD_DIM * 2
    copies = copies_for(nbytes)
    caches = [(torch.randn(shape, generator=gen).to(device, torch.bfloat16),
               torch.randn(shape, generator=gen).to(device, torch.bfloat16))
              for _ in range(copies)]
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    mask = torch.zeros(batch, length, dtype=torch.bool, device=device)
    mask[:, :filled] = True
    mask[0, :5] = False
    scale = HEAD_DIM ** -0.5
    compiled = torch.compile(hf_way)
    ways = {"hf_sdpa": lambda k, v: compiled(q, k, v, mask, scale),
            "sk": lambda k, v: attn_op.decode_attention(q, k, v, mask, scale)}
    ref = attention.reference(q, *caches[0], mask, scale).float()
    row: dict = {"batch": batch, "length": length, "filled": filled}
    for name, fn in ways.items():
        err = (fn(*caches[0]).float() - ref).abs().max().item()
        us = time_rotating([lambda fn=fn, c=c: fn(*c) for c in caches])
        row[name] = {"us": us, "max_abs_err": err}
    need = 2 * batch * KV_HEADS * filled * HEAD_DIM * 2
    row["sk"]["bytes"] = need
    row["sk"]["tbs"] = need / row["sk"]["us"] / 1e6
    row["sk"]["bound_share"] = row["sk"]["tbs"] / bound_tbs()
    row["hf_over_sk"] = row["hf_sdpa"]["us"] / row["sk"]["us"]
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--filled", type=float, default=0.75,
                    help="share of the cache's positions that take part")
    ap.add_argument("--out", default="bench_attention.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.exit(2, "bench_attention: needs a CUDA GPU\n")
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "bound_tbs": bound_tbs(), "rows": []}
    for length in (int(x) for x in args.lengths.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            row = case(batch, length, int(length * args.filled), device, gen)
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
