"""Token generation speed: decode GEMMs against the bandwidth bound, and HF ``generate()`` end to
end against the fastest dense way, on the GPU.

Sections (``--sections``, default both):
- ``gemm``: one decode GEMM (x (M, K) @ W.T) on Llama-3-8B and 70B shapes at M = 1, 4, 16, 32:
  cuBLAS bf16 dense (``F.linear``), sparsekit's small-M 2:4 kernel in bf16 and in fp8 (W8A8,
  activation already quantized), each in a CUDA graph. Per row: microseconds, the bytes a GEMM
  must move at least (weights as stored, x, y), achieved TB/s and its share of the GPU's
  bound (4.8 TB/s on an H200, 3.35 on an H100), and the ratio to cuBLAS; weights are cycled
  past the L2 as in a decode step. The summary gives the geo-means at M <= 16 against the
  targets (bf16 2:4 >= 1.6x, fp8 2:4 >= 2.8x) and the rows under 80% of the bound.
- ``configs``: every config of the small-M kernel's autotuning space per shape, M and dtype
  (compiled first in ``--jobs`` processes), beside cuBLAS bf16 and the autotuner's own pick:
  which configs win where, to keep the space small (``--explore``: also candidates outside
  it).
- ``generate``: an HF ``LlamaForCausalLM`` with Llama-3-8B shapes (``--layers`` of 32, random
  weights, 2:4 by magnitude on every Linear but the LM head), a prompt of ``--prompt`` tokens
  and ``--new`` new tokens, greedy, per batch in ``--batches``. Dense ways (``--dense``):
  ``dense_hf`` (HF's static cache, its decode step compiled by HF's own
  ``CompileConfig(mode="reduce-overhead")``: HF's documented fast path), ``dense_hf_default``
  (the same compiled in the default mode), ``dense_hf_eager`` (the static cache, not
  compiled), ``dense_sk`` (sparsekit's generate on a dense accelerated model, its prefill
  buckets, graphs and decode attention, no sparse kernels); the fastest of them is the
  reference. Compressed ways:
  ``sk_bf16_2:4``, ``sk_fp8_2:4`` (W8A8, per-token activation and per-channel weight
  scales), ``sk_fp8w_2:4`` (with ``--precisions`` naming fp8w: W8A16, per-channel fp8 weights,
  activations not quantized), ``sk_int4_2:4`` (with ``--precisions`` naming int4: W4A16,
  int4 weights rounded to nearest in groups of 128), ``sk_int4_dense`` (with ``--precisions``
  naming int4dense: the same int4 weights without 2:4, on sparsekit's int4 dense kernel: the
  comparison issue 32 asks for where torchao's int4 does not run; ``--head``: the LM head's
  precision in the compressed ways, bf16 by default as in the dense ways), ``<way>_perstep``
  for the ways in ``--per-step`` (the same model and graphs with the stop flag read after every
  token instead of sparsekit's lagged one: what the lag is worth), and the peers
  ``torchao_fp8_dense`` and ``torchao_int4_wo`` (weight-only int4, HF's static cache +
  compile) when torchao runs. Each way's time is paired (alternating ABBA blocks,
  :func:`sparsekit.accel.planner.time_paired`) with the fastest dense way, and its ratio is to
  that (dense ways other than the reference keep their sequential times: they only compete
  for the reference; ``--profile``: one more call per way under torch.profiler,
  :func:`bench_models.profile_shares`: kernel time by kind, the span of its kernels and its
  wall time). Per row: tokens/s, ms per new token, the paired ratio, the
  greedy tokens' agreement with the dense run of the same (masked) weights (beside it, the
  agreement of HF's eager generate with that dense run: random weights have small logit
  margins, so greedy tokens part at rounding differences; tools/check_generate_numerics.py
  checks agreement on a trained model), the seconds of each way's first call per batch
  (compiles; for sparsekit's ways also those of its calls that built a prefill or decode graph,
  ``first_call_graphs_s``) and of ``accelerate``. Each way is built once and
  serves every batch; on an 80 GB GPU, run one precision per call (``--precisions``).

``--smoke`` runs a one-layer tiny model on CPU (reference kernels, no timing claims): what CI
runs. JSON to ``--out``.

    python tools/bench_generate.py --out gen.json                   # on the H200
    python tools/bench_generate.py --smoke --out /tmp/gen.json      # CPU
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import sparsekit as sk
from sparsekit.accel.kernels.triton24 import op as sk24_op
from sparsekit import _compat
from sparsekit.accel import generate, planner
from sparsekit.accel import kernels as accel_kernels
from sparsekit.accel.linear import AccelLinear
from sparsekit.accel.kernels.triton24 import format as sk24
from sparsekit.nn.timing import graph_time_us
from sparsekit.prune.patterns import nm_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_models  # noqa: E402  (tools/bench_models.py, beside this script: profile_shares)
from llm_common import llama3_8b_shapes, random_llama  # noqa: E402

BOUNDS_TBS = {"H200": 4.8, "H100": 3.35}  # HBM peak (H200 HBM3e, H100 SXM HBM3)
BOUND_TBS = 4.8


def bound_tbs() -> float:
    """The HBM bandwidth bound of this GPU in TB/s (the H200's when unknown)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for k, v in BOUNDS_TBS.items() if k in name), BOUND_TBS)
# (name, N, K): Llama-3-8B attention (q+k+v fused, o) and MLP (gate+up fused, down); 70B MLP
# and attention
SHAPES = [("8b_qkv", 6144, 4096), ("8b_o", 4096, 4096), ("8b_gate_up", 28672, 4096),
          ("8b_down", 4096, 14336), ("70b_qkv", 10240, 8192), ("70b_o", 8192, 8192),
          ("70b_gate_up", 57344, 8192), ("70b_down", 8192, 28672)]
MS = (1, 4, 16, 32)
TARGETS = {"bf16_2:4": 1.6, "fp8_2:4": 2.8}


def masked_weight(n: int, k: int, device, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(n, k, generator=gen).to(device, torch.bfloat16)
    return w * nm_mask(w.abs(), 2, 4)


ROTATE_BYTES = 200e6  # weights cycled per timed call: more than the L2 (50 MB on H100/H200)


def copies_for(nbytes: int) -> int:
    """How many copies of a weight the timed calls cycle through, so that each call reads its
    weight from HBM as a decode step does, not from L2."""
    return max(1, min(16, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def rotating(fns: list):
    """One callable that calls ``fns`` in turn (each over its own copy of the weights)."""
    it = iter(range(1 << 62))
    return lambda: fns[next(it) % len(fns)]()


def time_rotating(fns: list) -> float:
    """Microseconds per call of a weight that is not in L2: ``len(fns)`` calls per graph."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    return graph_time_us(rotating(fns), calls=len(fns))


def weight_set(n: int, k: int, device, gen: torch.Generator) -> dict:
    w = masked_weight(n, k, "cpu", gen).to(device)
    vals, meta = sk24.compress(w)
    w8 = (w.float() / (w.float().abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn)
    ws = (w.float().abs().amax(1) / 448).contiguous()
    v8, m8 = sk24.compress(w8)
    return {"w": w, "vals": vals, "meta": meta, "v8": v8, "m8": m8, "ws": ws}


def gemm_rows(device: torch.device, shapes, ms, smoke: bool) -> list[dict]:
    """Time one decode GEMM per shape, M and kernel (CUDA graphs, weights cycled past L2)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, n, k in shapes:
        sets = [weight_set(n, k, device, gen)]
        if not smoke:
            sets += [{key: t.clone() for key, t in sets[0].items()}
                     for _ in range(copies_for(n * k * 2) - 1)]
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            x8, xs = x.to(torch.float8_e4m3fn), torch.ones(m, 1, device=device)
            # the kernel reads x's position planes (in a model, written by x's producer)
            xp, xp8 = sk24.planes(x), sk24.planes(x8)
            ways = {"bf16_dense": ([functools.partial(F.linear, x, s_["w"]) for s_ in sets],
                                   2 * n * k + 2 * m * k + 2 * m * n),
                    "bf16_2:4": ([functools.partial(sk24_op.sk24_mm, xp, s_["vals"], s_["meta"],
                                                    None, None, None) for s_ in sets],
                                 sk24.bound_bytes(m, n, k, torch.bfloat16)),
                    "fp8_2:4": ([functools.partial(sk24_op.sk24_mm, xp8, s_["v8"], s_["m8"], xs,
                                                   s_["ws"], None) for s_ in sets],
                                sk24.bound_bytes(m, n, k, torch.float8_e4m3fn))}
            ref = ways["bf16_dense"][0][0]().float()
            row = {"shape": name, "N": n, "K": k, "M": m, "copies": len(sets)}
            for way, (fns, nbytes) in ways.items():
                us = float("nan") if smoke else time_rotating(fns)
                err = ((fns[0]().float() - ref).norm() / ref.norm()).item()
                row[way] = {"us": us, "bytes": nbytes, "tb_s": nbytes / us / 1e6 if us else None,
                            "rel_err": err}
                if row[way]["tb_s"] is not None:
                    row[way]["bound_share"] = row[way]["tb_s"] / bound_tbs()
            for way in ("bf16_2:4", "fp8_2:4"):
                row[way]["over_dense"] = row["bf16_dense"]["us"] / row[way]["us"]
            rows.append(row)
            print(json.dumps({k_: (v if not isinstance(v, dict) else
                                   {kk: round(vv, 4) if isinstance(vv, float) else vv
                                    for kk, vv in v.items()}) for k_, v in row.items()}),
                  flush=True)
        del sets
    return rows


# --- kernel configurations ---------------------------------------------------------------------

def _compile_configs(job: tuple) -> int:
    """Compile (by launching on a small weight) the kernel for each (dtype, M, config) of
    ``job``: run in worker processes so that the configs compile in parallel."""
    items, = job
    count = 0
    for dtype_name, m, cfg in items:
        dtype = getattr(torch, dtype_name)
        w = masked_weight(64, 4096, "cuda", torch.Generator().manual_seed(0)).to(dtype)
        vals, meta = sk24.compress(w)
        x = sk24.planes(torch.randn(m, 4096, device="cuda").to(dtype))
        fp8 = dtype == torch.float8_e4m3fn
        xs = torch.ones(m, 1, device="cuda") if fp8 else None
        ws = torch.ones(64, device="cuda") if fp8 else None
        try:
            sk24.launch(x, vals, meta, xs, ws, None, config=cfg)
            count += 1
        except Exception as e:  # noqa: BLE001  (a config that does not compile is skipped)
            print(f"compile {dtype_name} M={m} {cfg}: {type(e).__name__}: {e}"[:300], flush=True)
    torch.cuda.synchronize()
    return count


# tensor-core candidates outside the autotuner's space, timed with --explore: eight warps, and
# smaller staged tiles (several programs an SM) (MODE 2 = DOT, BLOCK_N, BLOCK_W, SPLIT_K,
# warps, stages)
EXPLORE = [(2, 64, 32, 2, 8, 2), (2, 64, 32, 4, 8, 2), (2, 64, 16, 2, 4, 2), (2, 64, 16, 4, 4, 2),
           (2, 64, 16, 2, 8, 2), (2, 64, 16, 4, 8, 2), (2, 128, 16, 2, 8, 2),
           (2, 128, 16, 4, 8, 2), (2, 32, 32, 2, 4, 2), (2, 32, 32, 4, 4, 2)]


def space(explore: bool = False) -> list:
    """The kernel's autotuning space, with the EXPLORE candidates when ``explore``."""
    import triton

    from sparsekit.accel.kernels.triton24 import kernel as sk24_triton

    extra = [triton.Config({"MODE": mode, "BLOCK_N": bn, "BLOCK_W": bw, "SPLIT_K": split},
                           num_warps=warps, num_stages=stages)
             for mode, bn, bw, split, warps, stages in EXPLORE] if explore else []
    return sk24_triton.configs() + extra


def config_items(ms, k_min: int, explore: bool = False) -> list:
    """(dtype, M, config) for every config of the kernel's space that suits M (and K)."""
    from sparsekit.accel.kernels.triton24 import kernel as sk24_triton

    items = []
    for dtype_name in ("bfloat16", "float8_e4m3fn"):
        for m in ms:
            for c in space(explore):
                cfg = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                if sk24_triton.fits(c.kwargs, m, k_min, dtype_name == "float8_e4m3fn",
                                     c.num_stages):
                    items.append((dtype_name, m, cfg))
    return items


def config_rows(device: torch.device, shapes, ms, jobs: int, explore: bool = False
                ) -> list[dict]:
    """Every kernel config of the autotuner's space (and the EXPLORE candidates), timed per
    shape, M and dtype (weights cycled past L2), with the autotuner's own pick and cuBLAS bf16
    beside them."""
    import multiprocessing as mp

    from sparsekit.accel.kernels.triton24 import kernel as sk24_triton

    items = config_items(ms, 4096, explore)
    t0 = time.perf_counter()
    if jobs > 1:
        with mp.get_context("spawn").Pool(jobs) as pool:
            done = sum(pool.map(_compile_configs, [(items[i::jobs],) for i in range(jobs)]))
    else:
        done = _compile_configs((items,))
    print(f"compiled {done}/{len(items)} configs in {time.perf_counter() - t0:.0f} s",
          flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, n, k in shapes:
        sets = [weight_set(n, k, device, gen)]
        sets += [{key: t.clone() for key, t in sets[0].items()}
                 for _ in range(copies_for(n * k * 2) - 1)]
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            x8, xs = x.to(torch.float8_e4m3fn), torch.ones(m, 1, device=device)
            dense_us = time_rotating([functools.partial(F.linear, x, s_["w"]) for s_ in sets])
            planes = sk24.planes
            for dtype_name, xx, vk, mk, scales in (("bfloat16", planes(x), "vals", "meta", False),
                                                   ("float8_e4m3fn", planes(x8), "v8", "m8",
                                                    True)):
                nbytes = sk24.bound_bytes(m, n, k, xx.dtype)
                row = {"shape": name, "N": n, "K": k, "M": m, "dtype": dtype_name,
                       "dense_us": dense_us, "bytes": nbytes, "configs": []}
                for c in space(explore):
                    if not sk24_triton.fits(c.kwargs, m, k, dtype_name == "float8_e4m3fn",
                                            c.num_stages):
                        continue
                    cfg = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                    fns = [functools.partial(sk24.launch, xx, s_[vk], s_[mk],
                                             xs if scales else None,
                                             s_["ws"] if scales else None, None, cfg)
                           for s_ in sets]
                    try:
                        us = time_rotating(fns)
                    except Exception as e:  # noqa: BLE001
                        row["configs"].append({"config": cfg, "error": str(e)[:200]})
                        continue
                    row["configs"].append({"config": cfg, "us": us,
                                           "tb_s": nbytes / us / 1e6,
                                           "bound_share": nbytes / us / 1e6 / bound_tbs(),
                                           "over_dense": dense_us / us})
                fns = [functools.partial(sk24.launch, xx, s_[vk], s_[mk],
                                         xs if scales else None, s_["ws"] if scales else None,
                                         None) for s_ in sets]
                row["autotuned_us"] = time_rotating(fns)
                ok = [c for c in row["configs"] if "us" in c]
                best = min(ok, key=lambda c: c["us"]) if ok else None
                row["best"] = best
                row["autotuned_over_dense"] = dense_us / row["autotuned_us"]
                rows.append(row)
                print(json.dumps({"shape": name, "M": m, "dtype": dtype_name,
                                  "dense_us": round(dense_us, 2),
                                  "best_us": best and round(best["us"], 2),
                                  "best_tb_s": best and round(best["tb_s"], 2),
                                  "best_over_dense": best and round(best["over_dense"], 3),
                                  "best": best and best["config"],
                                  "auto_over_dense": round(row["autotuned_over_dense"], 3)}),
                      flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def config_summary(rows: list[dict]) -> dict:
    out = {}
    for dtype_name, way in (("bfloat16", "bf16_2:4"), ("float8_e4m3fn", "fp8_2:4")):
        r = [row for row in rows if row["dtype"] == dtype_name and row["M"] <= 16
             and row["best"]]
        geo = (math.exp(statistics.fmean(math.log(row["best"]["over_dense"]) for row in r))
               if r else float("nan"))
        auto = (math.exp(statistics.fmean(math.log(row["autotuned_over_dense"]) for row in r))
                if r else float("nan"))
        out[way] = {"best_config_geomean_over_cublas_m_le_16": geo,
                    "autotuned_geomean_over_cublas_m_le_16": auto, "target": TARGETS[way]}
    return out


def gemm_summary(rows: list[dict]) -> dict:
    out = {}
    for way, target in TARGETS.items():
        r = [row[way]["over_dense"] for row in rows if row["M"] <= 16
             and math.isfinite(row[way]["over_dense"])]
        geo = math.exp(statistics.fmean(math.log(v) for v in r)) if r else float("nan")
        out[way] = {"geomean_over_cublas_m_le_16": geo, "target": target,
                    "met": bool(geo >= target),
                    "rows_under_80pct_bound": [f"{row['shape']} M={row['M']}" for row in rows
                                               if row[way].get("bound_share", 1) < 0.8]}
    return out


# --- generate ----------------------------------------------------------------------------------

def llama(smoke: bool, layers: int, device):
    # smoke: widths that are multiples of 512, so the 2:4 layers take the small-M kernel
    config = llama3_8b_shapes(layers) if not smoke else dict(
        vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    model = random_llama(config, device, torch.bfloat16)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and name != "lm_head":
                mod.weight.mul_(nm_mask(mod.weight.abs(), 2, 4))
    return model


# HF's dense ways: {name: torch.compile mode of the decode step, None for eager}
DENSE_HF = {"hf": "reduce-overhead", "hf_default": "default", "hf_eager": None}


def hf_generate_fn(model, new: int, mode: str | None = "reduce-overhead"):
    """HF's documented fast path: a static cache, with which ``generate`` runs the prefill
    eagerly and compiles the decode step itself (``CompileConfig``: inductor, ``mode``;
    ``None``: no compile, the static cache eagerly). Compiling ``model.forward`` by hand
    instead also compiles the prefill, where the static cache's lazily made tensors become
    CUDA-graph outputs that the next replay overwrites."""
    from transformers import CompileConfig

    compiled = ({"disable_compile": True} if mode is None
                else {"compile_config": CompileConfig(mode=mode)})

    def run(ids):
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  cache_implementation="static", pad_token_id=0, **compiled)
    run.model = model
    return run


def eager_tokens(model, ids, new: int) -> torch.Tensor:
    """Greedy tokens of ``model`` run eagerly (HF's dynamic cache, no compile): the control for
    the agreement figures (how far the compiled dense way itself is from eager)."""
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)


def sk_generate_fn(model, ids, new: int, precision: str, sparsity: str, device,
                   siblings: bool = False, exclude: tuple[str, ...] = (), head: str = "bf16",
                   mma_sp: str = "auto"):
    """sparsekit's way: ``accelerate`` (timed; without the example's warm-up compile, a graph
    generate never runs; ``siblings``: q/k/v and gate/up as one GEMM each, under inductor;
    ``exclude``: modules left as they are; ``head``: the precision of the layers without 2:4
    zeros, the LM head, ``PlanOptions.dense_precision``; ``mma_sp``: ``PlanOptions.mma_sp``),
    then ``fast.generate``."""
    t0 = time.perf_counter()
    # on CPU (smoke) dynamo without inductor: the structure and numerics, not the speed
    backend = "inductor" if device.type == "cuda" else "eager"
    fast = sk.accelerate(model, {"input_ids": ids}, precision=precision, sparsity=sparsity,
                         device=device, exclude=exclude,
                         compile=sk.CompileOptions(backend=backend, warmup=False),
                         plan=sk.PlanOptions(siblings=siblings and backend == "inductor",
                                             dense_precision=head, mma_sp=mma_sp))
    kernels: dict[str, int] = {}  # layers per small-M kernel (its format's layout too)
    configs: dict[str, int] = {}  # layers per small-M configuration (per M bucket)
    for mod in fast.model.modules():
        if not isinstance(mod, AccelLinear):
            continue
        for route in mod.plan.routes:
            kernel = accel_kernels.get(route.kernel)
            if not kernel.small_m:
                continue
            layout = mod.weights(kernel.name).items().get("layout")
            name = kernel.name + (f"/{layout}" if layout else "")
            kernels[name] = kernels.get(name, 0) + 1
            if route.config:  # the configuration per M bucket, as planned
                text = kernel.config_text(route.config)
                configs[text] = configs.get(text, 0) + 1
    info = {"accelerate_s": time.perf_counter() - t0,
            "report_seconds": dict(fast.report.seconds), "decode_kernels": kernels,
            "decode_configs": configs,
            # whether generate runs decode attention on sparsekit's kernel
            "decode_attention": generate.attention_for(fast.model, device) is not None}
    print(json.dumps({"way": f"{precision} {sparsity}", **info}), flush=True)

    def run(ids):
        return fast.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return run, info, fast


def torchao_fn(model, new: int, kind: str):
    """HF's fast path (:func:`hf_generate_fn`) on ``model`` quantized by torchao."""
    return hf_generate_fn(torchao_quantize_(model, kind), new)


def torchao_quantize_(model, kind: str):
    """``model`` (in place) with every Linear but the LM head quantized by torchao: "fp8"
    (dynamic per-row fp8 activations, per-row fp8 weights) or "int4" (weight-only, groups of
    128)."""
    from torchao.quantization import quantize_

    if kind == "fp8":
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow
        cfg = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(),
                                                        set_inductor_config=False)
    else:
        from torchao.quantization import Int4WeightOnlyConfig
        cfg = Int4WeightOnlyConfig(group_size=128, set_inductor_config=False)
    quantize_(model, cfg, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "lm_head")
    return model


def agreement(out: torch.Tensor, ref: torch.Tensor, prompt: int,
              ref_logits: torch.Tensor | None = None) -> dict:
    """Greedy tokens of ``out`` against ``ref`` after the prompt: the equal fraction, per row
    the first new position that differs (the row's length when none) and, with the reference's
    teacher-forced logits, the reference's top-1 minus top-2 logit there and whether that is a
    tie in bfloat16 (at most two bfloat16 spacings at the top logit's magnitude: the two
    tokens are not told apart by bfloat16 arithmetic, and a different summation order picks
    either)."""
    a, b = out[:, prompt:].cpu(), ref[:, prompt:].cpu()
    n = min(a.shape[1], b.shape[1])
    same = a[:, :n] == b[:, :n]
    first = [int(r.logical_not().nonzero()[0]) if not r.all() else n for r in same]
    res = {"equal_fraction": same.float().mean().item(), "first_divergence": first,
           "all_equal": bool(same.all())}
    if ref_logits is not None:
        margins, ties = [], []
        for row, j in enumerate(first):
            if j >= n:
                continue
            top = ref_logits[row, prompt - 1 + j].float().topk(2).values.cpu()
            margin = (top[0] - top[1]).item()
            spacing = 2.0 ** (torch.floor(torch.log2(top[0].abs().clamp_min(1e-30))).item() - 7)
            margins.append(margin)
            ties.append(margin <= 2 * spacing)
        res.update(divergence_margins=margins, divergences_at_ties=ties,
                   equal_but_ties=all(ties))
    return res


# --inductor-<flag>: (inductor option set True for the whole run, what it does)
INDUCTOR_FLAGS = {
    "pdl": ("triton.enable_pdl", "inductor's Triton kernels launched as programmatic "
                                 "dependents (Hopper)"),
    # a decode step's rotary, cache writes and the cache layers' position counters are
    # independent small kernels after each q/k/v GEMM: one launch for them instead of four
    "combo": ("combo_kernels", "inductor's independent kernels combined into one launch"),
}

# --precisions tokens: (way, accelerate's precision, sparsity, every fp8 layer on the mma.sp
# kernel: PlanOptions(mma_sp="all"))
SK_WAYS = {"bf16": ("sk_bf16_2:4", "bf16", "2:4", False),
           "fp8": ("sk_fp8_2:4", "fp8", "2:4", False),
           "int4": ("sk_int4_2:4", "int4", "2:4", False),
           "fp8mma": ("sk_fp8_2:4_mma", "fp8", "2:4", True),
           "fp8w": ("sk_fp8w_2:4", "fp8w", "2:4", False),
           "int4dense": ("sk_int4_dense", "int4", "dense", False)}


def build_ways(args, master, ids, new: int, device) -> tuple[dict, dict]:
    """{way: run(ids)} and {way: error} for the dense and compressed ways (each built once and
    used for every batch; each is a copy of ``master``)."""
    smoke = args.smoke
    ways: dict = {}
    errors: dict = {}
    infos: dict = {}
    dense = ["sk"] if smoke else args.dense.split(",")
    unknown = sorted(set(dense) - {*DENSE_HF, "sk"})
    if unknown or not dense:
        raise SystemExit(f"--dense: unknown way(s) {unknown}; choose among "
                         f"{', '.join([*DENSE_HF, 'sk'])}")
    for token, (name, precision, sparsity, mma) in SK_WAYS.items():
        if token not in args.precisions.split(","):
            continue
        try:
            # the dense int4 way: every Linear but the LM head, as the 2:4 ways (whose LM
            # head, without 2:4 zeros, runs as --head), unless --head quantizes it too
            exclude = ("lm_head",) if sparsity == "dense" and args.head == "bf16" else ()
            ways[name], infos[name], fast = sk_generate_fn(
                copy.deepcopy(master), ids, new, precision, sparsity, device,
                args.siblings, exclude=exclude, head=args.head,
                mma_sp="all" if mma else "auto")
            infos[name].update(report=fast.report, fast=fast)
        except Exception as e:  # noqa: BLE001  (a way that fails is recorded, not fatal)
            errors[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    if not smoke and args.peers:
        for name, kind in (("torchao_fp8_dense", "fp8"), ("torchao_int4_wo", "int4")):
            try:
                ways[name] = torchao_fn(copy.deepcopy(master), new, kind)
            except Exception as e:  # noqa: BLE001
                errors[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    # the dense ways last, each on a copy of its own but hf and hf_eager on one (the eager
    # way keeps no compile state); the last copy made is ``master`` itself (one 8B copy fewer)
    keys = {way: "hf" if way == "hf_eager" else way for way in dense}
    last = list(dict.fromkeys(keys.values()))[-1]
    copies: dict = {}
    for way in dense:
        key = keys[way]
        if key not in copies:
            copies[key] = master if key == last else copy.deepcopy(master)
        if way == "sk":
            ways["dense_sk"], infos["dense_sk"], fast = sk_generate_fn(
                copies[key], ids, new, "bf16", "dense", device, args.siblings)
            infos["dense_sk"].update(report=fast.report, fast=fast)
        else:
            ways[f"dense_{way}"] = hf_generate_fn(copies[key], new, DENSE_HF[way])
    for name in args.per_step.split(",") if args.per_step and not smoke else ():
        if name in ways:  # the same model and graphs, the stop flag read after every step
            ways[f"{name}_perstep"] = per_step(ways[name], infos[name]["fast"])
            infos[f"{name}_perstep"] = {k: v for k, v in infos.get(name, {}).items()
                                        if k not in OBJECTS}
    return {n: (fn, infos.get(n, {})) for n, fn in ways.items()}, errors


OBJECTS = ("report", "fast")  # a way's info entries that are objects, not JSON


def decode_step_ms(fast, batch: int, replays: int = 50) -> float | None:
    """GPU time of one decode step of ``fast``'s generate at ``batch`` rows: its captured
    decode graph replayed back to back (no host work between steps), in ms; None where no
    decode graph of that batch was captured. Against a generated token's whole share of a
    call (ms / new tokens) the difference is what a token costs outside the step's graph: the
    prompt's prefill spread over the tokens, HF generate's host work and eager kernels."""
    gen = fast.__dict__.get("generator")
    for (_, kind), cache in ({} if gen is None else gen.graphs).items():
        for call in cache.graphs.values() if kind == "decode" else ():
            if any(t.dim() == 2 and tuple(t.shape) == (batch, 1) for t in call.inputs):
                for _ in range(3):
                    call.graph.replay()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                for _ in range(replays):
                    call.graph.replay()
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / replays
    return None


def per_step(run, fast):
    """``run`` (a ``fast.generate``) with sparsekit's lagged stop check off
    (``PlanOptions(lagged_stop=False)``): the loop then waits for the GPU after every
    token."""
    def wrapped(ids):
        plan = fast.plan
        fast.plan = dataclasses.replace(plan, lagged_stop=False)
        try:
            return run(ids)
        finally:
            fast.plan = plan
    return wrapped


def generate_rows(args, device, save=lambda out: None) -> dict:
    """Rows per batch; ``save(rows so far)`` after each way's timing (a run cut short by its
    time limit keeps what it measured)."""
    out = {}
    smoke = args.smoke
    new = 8 if smoke else args.new
    prompt = 12 if smoke else args.prompt
    master = llama(smoke, args.layers, device)
    batches = [int(b) for b in args.batches.split(",")]
    first_ids = torch.randint(0, master.config.vocab_size, (batches[0], prompt),
                              generator=torch.Generator().manual_seed(0)).to(device)
    ways, errors = build_ways(args, master, first_ids, new, device)
    del master
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for batch in batches:
        ids = torch.randint(0, 128 if smoke else 32000, (batch, prompt),
                            generator=torch.Generator().manual_seed(batch)).to(device)
        res: dict = {"batch": batch, "prompt": prompt, "new_tokens": new,
                     "ways": {n: dict(e) for n, e in errors.items()}}
        out[str(batch)] = res
        outputs = {}
        for name, (fn, info) in list(ways.items()):
            spent = dict(info["report"].seconds) if "report" in info else {}
            t0 = time.perf_counter()
            try:
                outputs[name] = fn(ids)  # compiles this batch's shapes
            except Exception as e:  # noqa: BLE001  (a way that fails is recorded, not fatal)
                res["ways"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(json.dumps({"batch": batch, "way": name, **res["ways"][name]}), flush=True)
                del ways[name]
                continue
            first = time.perf_counter() - t0
            res["ways"][name] = {"first_call_s": first,
                                 **{k: v for k, v in info.items() if k not in OBJECTS}}
            if "report" in info:  # sparsekit's ways: a first call that compiled nothing ran
                compiles = info["report"].compiles  # eagerly (or reused another's graphs)
                res["ways"][name].update(compiles=compiles, compiled=compiles > 0)
                # where the first call went: its graph-building prefill and decode calls
                res["ways"][name]["first_call_graphs_s"] = {
                    k.removeprefix("generate_"): v - spent.get(k, 0.0)
                    for k, v in info["report"].seconds.items() if k.startswith("generate_")}
                # the decode plan per layer shape: kernel, configurations, timings per M
                res["ways"][name]["decode_notes"] = list(dict.fromkeys(
                    n for n in info["report"].notes if n.startswith("decode")))
            print(json.dumps({"batch": batch, "way": name, "first_call_s": first}), flush=True)
        seq = {}
        for name, (fn, _) in ways.items():
            ms = float("nan") if smoke else planner.time_model_ms(
                functools.partial(fn, ids), device, calls=args.calls, warmup=1)
            seq[name] = ms
            res["ways"][name]["ms_sequential"] = ms
            fast = ways[name][1].get("fast")
            step = None if smoke or fast is None else decode_step_ms(fast, batch)
            if step is not None:  # the decode graph alone against a token of the whole call
                res["ways"][name].update(decode_step_ms=step,
                                         outside_step_ms=ms / new - step)
        dense_names = [n for n in ways if n.startswith("dense_")]
        if not dense_names:
            res["error"] = "no dense way ran: no ratio can be formed"
            save(out)
            continue
        ref_name = min(dense_names, key=lambda n: seq[n]) if not smoke else "dense_sk"
        res["reference"] = ref_name
        if res["ways"][ref_name].get("compiled") is False:
            res["reference_warning"] = (f"{ref_name} compiled nothing on its first call: it ran "
                                        "eagerly or reused another way's graphs")
            print(json.dumps({"batch": batch, "warning": res["reference_warning"]}), flush=True)
        hf_ways = [n for n in ways if n.startswith("dense_hf")]
        if hf_ways:  # on random weights a greedy token flips at a rounding difference
            control = eager_tokens(ways[hf_ways[0]][0].model, ids, new)
            res["control_agreement"] = {"dense_eager_vs_" + ref_name: agreement(
                control, outputs[ref_name], prompt)}
            print(json.dumps({"batch": batch, **res["control_agreement"]}), flush=True)
        # the compressed ways first (the claims), the other dense ways last; those only
        # compete for the reference, so they keep their sequential times (no pairing)
        order = sorted(ways, key=lambda n: n.startswith("dense_"))
        for name in order:
            fn = ways[name][0]
            row = res["ways"][name]
            paired = not (smoke or name.startswith("dense_"))
            if smoke:
                ref_ms = ms = float("nan")
            elif not paired:
                ref_ms, ms = seq[ref_name], seq[name]
            else:
                ref_ms, ms = planner.time_paired(functools.partial(ways[ref_name][0], ids),
                                                 functools.partial(fn, ids), device,
                                                 rounds=args.rounds, calls=args.calls)
            row.update(ms=ms, paired_ref_ms=ref_ms if paired else None, paired=paired,
                       ratio=ref_ms / ms,
                       tokens_per_s=batch * new / ms * 1e3, ms_per_token=ms / new,
                       agreement=agreement(outputs[name], outputs[ref_name], prompt))
            print(json.dumps({"batch": batch, "way": name,
                              **{k: row[k] for k in ("ms", "ratio", "tokens_per_s")},
                              "agree": row["agreement"]["equal_fraction"]}), flush=True)
            save(out)
        if args.profile:
            for name, (fn, _) in ways.items():
                res["ways"][name]["profile"] = bench_models.profile_shares(
                    functools.partial(fn, ids), device)
                print(json.dumps({"batch": batch, "way": name,
                                  "profile": res["ways"][name]["profile"]}), flush=True)
            save(out)
        del outputs
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="gemm,generate",
                    help="comma-separated: gemm, configs (every kernel config), generate")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling kernel configs")
    ap.add_argument("--explore", action="store_true",
                    help="configs: also time the EXPLORE candidates outside the space")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="configs: the M values")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--precisions", default="bf16,fp8",
                    help="generate: sparsekit's 2:4 ways, of bf16, fp8, int4 (W4A16, RTN), "
                         "fp8mma (fp8 with its layers on the mma.sp kernel: sk_fp8_2:4_mma), "
                         "fp8w (W8A16: fp8 weights, bf16 activations), int4dense (int4 W4A16 "
                         "without 2:4: sk_int4_dense)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--profile", action="store_true",
                    help="generate: one more call per way under torch.profiler (kernel time "
                         "by kind, kernel span and wall time; CUDA)")
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--dense", default="hf,hf_default,hf_eager,sk",
                    help="generate: the dense ways, the fastest of which every ratio is "
                         "against: hf (HF static cache, decode step compiled reduce-overhead), "
                         "hf_default (compiled, default mode), hf_eager (not compiled), sk "
                         "(sparsekit's generate on the dense model, its decode attention too)")
    ap.add_argument("--per-step", default="dense_sk,sk_bf16_2:4",
                    help="generate: sparsekit ways also timed with the stop flag read after "
                         "every token (sparsekit's lagged check off), as <way>_perstep")
    ap.add_argument("--siblings", action=argparse.BooleanOptionalAction, default=True,
                    help="generate: sparsekit's ways (dense_sk too) with "
                         "PlanOptions(siblings=True): q/k/v and gate/up one GEMM each")
    ap.add_argument("--head", default="bf16", choices=("bf16", "fp8", "int4"),
                    help="generate: the precision of the LM head (no 2:4 zeros) in sparsekit's "
                         "compressed ways (PlanOptions.dense_precision; int4dense: the LM head "
                         "bf16, else int4); the dense ways keep it bf16")
    for flag, (option, what) in INDUCTOR_FLAGS.items():
        ap.add_argument(f"--inductor-{flag}", action="store_true",
                        help=f"{what} (torch._inductor.config.{option}) in every way, the "
                             f"dense ones too")
    ap.add_argument("--shapes", default="all", help="comma-separated shape names, or all")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (what CI runs)")
    ap.add_argument("--out", default="bench_generate.json")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.precisions.split(",")) - set(SK_WAYS))
    if unknown:  # before an 8B model is built
        ap.exit(2, f"bench_generate: --precisions: unknown way(s) {unknown}; choose among "
                   f"{', '.join(SK_WAYS)}\n")
    for flag, (option, _) in INDUCTOR_FLAGS.items():
        if getattr(args, f"inductor_{flag}"):
            import torch._inductor.config as inductor_config

            if option not in inductor_config._config:
                ap.exit(2, f"bench_generate: --inductor-{flag}: torch {torch.__version__}'s "
                           f"inductor has no {option}\n")
            setattr(inductor_config, option, True)
    device = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_generate.py needs a CUDA GPU (--smoke runs on CPU)")
    res: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "args": vars(args),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    sections = args.sections.split(",")
    if "gemm" in sections:
        shapes = SHAPES if args.shapes == "all" else [s for s in SHAPES
                                                      if s[0] in args.shapes.split(",")]
        if args.smoke:
            shapes = [("smoke", 64, 512)]
        res["gemm"] = gemm_rows(device, shapes, (1, 3) if args.smoke else MS, args.smoke)
        res["gemm_summary"] = gemm_summary(res["gemm"])
        Path(args.out).write_text(json.dumps(res, indent=1))
    if "configs" in sections:
        shapes = SHAPES if args.shapes == "all" else [s for s in SHAPES
                                                      if s[0] in args.shapes.split(",")]
        ms = [int(m) for m in args.ms.split(",")]
        res["configs"] = config_rows(device, shapes, ms, args.jobs, args.explore)
        res["configs_summary"] = config_summary(res["configs"])
        print(json.dumps(res["configs_summary"]), flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    if "generate" in sections:
        def save(rows):
            res["generate"] = rows
            Path(args.out).write_text(json.dumps(res, indent=1))
        # many models of one class in one process: dynamo's per-frame limit (8) would leave
        # the later ways uncompiled (sparsekit's generate raises it for its calls; HF's
        # compiled ways need it too)
        with _compat.recompile_limit():
            res["generate"] = generate_rows(args, device, save)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
