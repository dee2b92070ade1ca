"""2:4 sparse and fp8/int8 tensor cores against cuBLAS bf16 dense on one GPU (the H200).

    python tools/bench_gpu.py --out-dir bench_out               # full run on a CUDA GPU
    python tools/bench_gpu.py --sections gemm --out-dir out     # one section
    python tools/bench_gpu.py --smoke --out-dir /tmp/bench      # CPU, seconds (CI)

Sections (each written to ``bench_gpu.json`` and ``bench_gpu.md`` as soon as it finishes):
- ``gemm``: linear layers of ViT-B, BERT-L, Llama-7B and Llama-70B MLP shapes at M tokens in
  {64, 1024, 4096, 16384}. Every variant is timed under CUDA-graph replay (median of CUDA-event
  timings, best cuSPARSELt alg_id per shape) and given as a ratio to cuBLAS bf16 dense measured
  in the same run. fp8/int8 times include dynamic activation quantization; its share is shown.
  ``fp8s_2:4``: fp8 2:4 with a static activation scale (``fp8_static``; elementwise).
  ``fp8st_2:4``: the same with one weight scale per tensor (``fp8_static_tensor``): the
  activation is quantized by one elementwise kernel and the scale (and bias) run inside the
  GEMM on sparsekit's own cuSPARSELt binding (the layer's ``path`` is recorded per row).
  Peers: torch's stock ``to_sparse_semi_structured`` timed eagerly (as users call it), our bf16
  2:4 module eagerly (what graphs remove), and torchao's fp8 2:4 when importable.
- ``vit``: torchvision ViT-B/16 end to end at batch 64 and 256, ``sk.accelerate`` per
  precision, plus output error against an fp32 reference with the same masks.
- ``llama``: a Llama-7B-shaped decoder layer (RMSNorm, causal attention with 32 heads, SwiGLU
  MLP 4096 -> 11008; no rotary embedding) at 4096 tokens, same variants.
Weights are random with a magnitude 2:4 mask (speed does not depend on the values).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import platform
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import sparsekit as sk
from sparsekit.prune.patterns import nm_mask
from sparsekit.accel import algsearch, ops, planner
from sparsekit.accel import layers as accel_layers
from sparsekit.quant.formats import FP8
from sparsekit.nn.timing import eager_time_us, graph_time_us

GEMM_SHAPES = {  # model: [(layer, in_features K, out_features N)]; the targets' shapes first
    "Llama-7B": [("up", 4096, 11008), ("down", 11008, 4096)],
    "Llama-70B": [("up", 8192, 28672), ("down", 28672, 8192)],
    "ViT-B": [("qkv", 768, 2304), ("proj", 768, 768), ("fc1", 768, 3072), ("fc2", 3072, 768)],
    "BERT-L": [("qkv", 1024, 3072), ("fc1", 1024, 4096), ("fc2", 4096, 1024)],
}
TOKENS = (64, 1024, 4096, 16384)
OURS = ("bf16_2:4", "fp8_dense", "fp8_2:4", "int8_dense", "int8_2:4")
TARGETS = {  # (figure, target): from issue 4
    "gemm_llama_bf16_2:4_geomean": 1.6, "gemm_llama_fp8_2:4_geomean": 2.5,
    "gemm_llama_fp8s_2:4_geomean": 2.5, "gemm_llama_fp8st_2:4_geomean": 2.5,
    "vit_b256_bf16_2:4": 1.25, "vit_b256_fp8_2:4": 1.8,
    "llama_layer_bf16_2:4": 1.4, "llama_layer_fp8_2:4": 2.2,
    "auto_min_layer_speedup": 0.98,
}


def magnitude_24_(module: nn.Module) -> nn.Module:
    """Keep the 2 largest of every 4 weights along the input dim of each Linear weight and of
    MultiheadAttention's in_proj_weight, in place (what ``Pruner.finalize()`` leaves)."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.MultiheadAttention)):
                w = m.weight if isinstance(m, nn.Linear) else m.in_proj_weight
                if w is None or w.shape[1] % 4:
                    continue
                w.mul_(nm_mask(w.abs(), 2, 4))
    return module


def time_us(fn, device: torch.device) -> float:
    """Graph-replay median on CUDA; perf_counter median on CPU (smoke)."""
    if device.type == "cuda":
        return graph_time_us(fn)
    fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


# ---------------------------------------------------------------- peers

def stock_sparse_linear(lin: nn.Linear) -> nn.Linear:
    """torch's stock semi-structured path: the weight as ``to_sparse_semi_structured``."""
    from torch.sparse import to_sparse_semi_structured

    new = copy.deepcopy(lin).to(torch.bfloat16)
    new.weight = nn.Parameter(to_sparse_semi_structured(new.weight.detach()),
                              requires_grad=False)
    return new


def torchao_fp8_24(module: nn.Module, filter_fn=None) -> nn.Module:
    """torchao 0.17 fp8 (per-row) 2:4 (SPARSE_CUTLASS packing) on ``module``'s linears."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    from torchao.quantization.quantize_.workflows.float8.float8_packing_format import (
        Float8PackingFormat,
    )

    cfg = Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow(), packing_format=Float8PackingFormat.SPARSE_CUTLASS,
        set_inductor_config=False)
    quantize_(module, cfg, filter_fn=filter_fn)
    return module


def try_peer(fn):
    try:
        return fn(), None
    except Exception as e:  # a peer that does not run is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


# ---------------------------------------------------------------- sections

def static_fp8(lin: nn.Linear, x: torch.Tensor, scheme: str = "fp8_static") -> nn.Module:
    """A ``QuantLinear`` (``scheme``, a static fp8 one) of ``lin``, its input scale calibrated
    on ``x``."""
    import sparsekit as sk

    q = nn.Sequential(copy.deepcopy(lin))
    sk.quantize_(q, scheme, calibration=[x.to(lin.weight.dtype)])
    return q[0]


def gemm_row(lin: nn.Linear, m: int, device: torch.device) -> dict:
    """Every variant of one linear at ``m`` tokens: microseconds and ratios to bf16 dense."""
    x = torch.randn(m, lin.in_features, device=device, dtype=torch.bfloat16)
    dense = accel_layers.DenseBF16(lin)
    us = {"bf16_dense": time_us(lambda: dense(x), device)}
    row = {"K": lin.in_features, "N": lin.out_features, "M": m, "us": us, "alg_id": {},
           "errors": {}}
    if device.type != "cuda":
        row["ratio"] = {"bf16_dense": 1.0}
        return row
    for v in OURS:  # compiled, as they run inside an accelerated model
        if accel_layers.VARIANTS[v].uses_alg:
            mod, row["alg_id"][v], _ = algsearch.search(v, lin, m)
        else:
            mod = accel_layers.VARIANTS[v](lin)
        us[v] = planner.time_module(mod, x)
        if v == "bf16_2:4":
            us["bf16_2:4_eager"] = eager_time_us(lambda mod=mod: mod(x))
    # fp8 2:4 with a static activation scale (quantize_ fp8_static calibrated on x): the
    # activation quantization is elementwise
    mod = accel_layers.VARIANTS["fp8_2:4"](static_fp8(lin, x),
                                           alg_id=row["alg_id"].get("fp8_2:4", 0))
    us["fp8s_2:4"] = planner.time_module(mod, x)
    # fp8 2:4 with one weight scale per tensor (fp8_static_tensor): alpha inside the GEMM
    mod, row["alg_id"]["fp8st_2:4"], _ = algsearch.search(
        "fp8_2:4", static_fp8(lin, x, "fp8_static_tensor"), m)
    row["fp8st_path"] = mod.path
    us["fp8st_2:4"] = planner.time_module(mod, x)
    quant = torch.compile(lambda t: ops.act_quant_rows(t, FP8))
    us["act_quant_rows"] = time_us(lambda: quant(x), device)
    acc = torch.randn(m, lin.out_features, device=device, dtype=torch.bfloat16)
    rs = torch.rand(m, 1, device=device)
    cs = torch.rand(lin.out_features, device=device)
    epi = torch.compile(lambda a: (a.float() * rs * cs).to(torch.bfloat16))
    us["act_quant_epilogue"] = time_us(lambda: epi(acc), device)
    stock, err = try_peer(lambda: stock_sparse_linear(lin))
    if stock is not None:
        us["stock_2:4_eager"] = eager_time_us(lambda: stock(x))
    else:
        row["errors"]["stock_2:4_eager"] = err
    ao, err = try_peer(lambda: torchao_fp8_24(nn.Sequential(copy.deepcopy(lin).bfloat16())))
    if ao is not None:
        t, err = try_peer(lambda: time_us(lambda: ao(x), device))
        if t is not None:
            us["torchao_fp8_2:4"] = t
    if err:
        row["errors"]["torchao_fp8_2:4"] = err
    row["ratio"] = {v: us["bf16_dense"] / t for v, t in us.items()
                    if not v.startswith("act_quant")}
    return row


def bench_gemm(device: torch.device, shapes: dict, tokens: tuple, log, rows: list,
               on_row) -> None:
    """Append one row per (shape, tokens) to ``rows``; ``on_row()`` after each (saves)."""
    for model_name, layers in shapes.items():
        for layer, k, n in layers:
            torch.manual_seed(0)
            lin = magnitude_24_(nn.Linear(k, n, bias=False)).to(device)
            for m in tokens:
                row = {"model": model_name, "layer": layer, **gemm_row(lin, m, device)}
                rows.append(row)
                on_row()
                log(f"gemm {model_name} {layer} {n}x{k} M={m}: " + " ".join(
                    f"{v}={r:.2f}" for v, r in row["ratio"].items()))
                if device.type == "cuda":
                    torch.cuda.empty_cache()


class LlamaLayer(nn.Module):
    """A Llama-7B-shaped decoder layer: RMSNorm, causal multi-head attention (q/k/v/o
    projections, no rotary embedding), RMSNorm, SwiGLU MLP. x (B, T, d) -> (B, T, d)."""

    def __init__(self, d: int = 4096, heads: int = 32, ffn: int = 11008):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)
        for p in self.parameters():  # keep activations O(1) through the layer
            if p.dim() == 2:
                nn.init.normal_(p, std=p.shape[1] ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).reshape(b, t, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def bench_model(name: str, master: nn.Module, x: torch.Tensor, device: torch.device,
                stock_filter, ao_filter, log, unfused: bool = False) -> dict:
    """End to end: fp32 reference, then per precision ``sk.accelerate`` (ratio against the
    bf16 dense model timed in the same call), plus the peers."""
    out = {"name": name, "variants": {}, "errors": {}}
    torch.backends.cudnn.allow_tf32 = False  # a true fp32 reference (conv patch embedding)
    with torch.no_grad():
        ref = copy.deepcopy(master).to(device).float()(x.to(device).float())
    dense = copy.deepcopy(master).to(device, torch.bfloat16).eval()
    xb = x.to(device, torch.bfloat16)
    with torch.no_grad():  # the precision floor: the plain bf16 model against fp32
        out["variants"]["bf16_dense"] = {"rel_err": rel_err(dense(xb), ref)}
        if device.type != "cuda":
            out["dense_us"] = time_us(lambda: dense(xb), device)
            return out
    runs = [("bf16", "2:4", True), ("fp8", "2:4", True), ("int8", "2:4", True),
            ("bf16", "auto", True), ("fp8", "auto", True), ("fp8", "dense", True)]
    if unfused:  # what fusing the activation quantization into its producer adds
        runs += [("fp8", "2:4", False)]
    for precision, sparsity, fused in runs:
        key = f"{precision}_{sparsity}" + ("" if fused else "_unfused")
        t0 = time.time()
        res, err = try_peer(lambda p=precision, s=sparsity, f=fused: sk.accelerate(
            copy.deepcopy(master), x, precision=p, sparsity=s,
            plan=sk.PlanOptions(fused_quant=f)))
        if res is None:
            out["errors"][key] = err
            log(f"{name} {key}: FAILED {err}")
            continue
        rep = res.sparsekit_report
        entry = {"ratio": rep.model_speedup, "us": rep.model_us, "rel_err": rel_err(res(x), ref),
                 "accelerate_s": round(time.time() - t0, 1), "report": rep.to_dict()}
        chosen = [d.confirmed_speedup or d.speedup for d in rep.layers
                  if d.variant != "bf16_dense" and (d.confirmed_speedup or d.speedup)]
        entry["min_layer_speedup"] = min(chosen) if chosen else None
        entry["bound"] = rep.bound  # the most the chosen linear kernels can give this model
        out["variants"][key] = entry
        out["dense_us"] = rep.model_us["dense"]
        log(f"{name} {key}: {entry['ratio']:.2f}x of dense ({rep.model_us}), rel err "
            f"{entry['rel_err']:.4f}, accelerate {entry['accelerate_s']} s")
        res = None
        torch.cuda.empty_cache()
    stock = copy.deepcopy(dense)
    ok, err = try_peer(lambda: [stock.set_submodule(n, stock_sparse_linear(m))
                                for n, m in list(stock.named_modules()) if stock_filter(m, n)])
    with torch.no_grad():
        t_dense_eager = eager_time_us(lambda: dense(xb), calls=10)
        if ok is not None:
            t, err = try_peer(lambda: eager_time_us(lambda: stock(xb), calls=10))
            if t is not None:
                out["variants"]["stock_2:4_eager"] = {
                    "ratio": t_dense_eager / t, "us": {"dense_eager": t_dense_eager,
                                                       "stock_eager": t},
                    "rel_err": rel_err(stock(xb), ref)}
        if err:
            out["errors"]["stock_2:4_eager"] = err
        ao, err = try_peer(lambda: torchao_fp8_24(copy.deepcopy(dense), ao_filter))
        if ao is not None:
            t, err = try_peer(lambda: graph_time_us(lambda: ao(xb), calls=1))
            if t is not None:
                out["variants"]["torchao_fp8_2:4"] = {
                    "ratio": out["dense_us"] / t, "us": {"torchao": t},
                    "rel_err": rel_err(ao(xb), ref)}
        if err:
            out["errors"]["torchao_fp8_2:4"] = err
    for k in ("stock_2:4_eager", "torchao_fp8_2:4"):
        if k in out["variants"]:
            log(f"{name} {k}: {out['variants'][k]['ratio']:.2f}x")
        elif k in out["errors"]:
            log(f"{name} {k}: {out['errors'][k]}")
    return out


def vit_section(device: torch.device, batches: tuple, smoke: bool, log, out: list,
                on_batch) -> None:
    """Append one end-to-end entry per batch size to ``out``; ``on_batch()`` after each."""
    from torchvision.models import vit_b_16
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    master = (VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=2,
                                hidden_dim=64, mlp_dim=128) if smoke else vit_b_16()).eval()
    nn.init.normal_(master.heads.head.weight, std=0.02)  # torchvision zero-inits the head
    magnitude_24_(master)
    size = 32 if smoke else 224
    mlp = lambda m, n: isinstance(m, nn.Linear) and ".mlp." in f".{n}"  # noqa: E731
    for b in batches:
        out.append(bench_model(f"ViT-B/16 batch {b}", master, torch.randn(b, 3, size, size),
                               device, mlp, mlp, log))
        on_batch()


def llama_section(device: torch.device, tokens: int, smoke: bool, log) -> dict:
    torch.manual_seed(0)
    master = LlamaLayer(64, 4, 128) if smoke else LlamaLayer()
    magnitude_24_(master.eval())
    d = master.q_proj.in_features
    lin = lambda m, n: isinstance(m, nn.Linear)  # noqa: E731
    return bench_model(f"Llama-7B layer, {tokens} tokens", master, torch.randn(1, tokens, d),
                       device, lin, lin, log, unfused=True)


# ---------------------------------------------------------------- summary and output

def summarize(res: dict) -> dict:
    s: dict = {}
    gemm = [r for r in res.get("gemm", []) if r["model"].startswith("Llama") and r["M"] >= 1024]
    for v in ("bf16_2:4", "fp8_2:4", "fp8s_2:4", "fp8st_2:4", "int8_2:4", "fp8_dense", "int8_dense",
              "stock_2:4_eager", "torchao_fp8_2:4"):
        xs = [r["ratio"][v] for r in gemm if v in r["ratio"]]
        if xs:
            s[f"gemm_llama_{v}_geomean"] = geomean(xs)
            s[f"gemm_llama_{v}_min"], s[f"gemm_llama_{v}_max"] = min(xs), max(xs)
    for sec, key in (("vit", "vit_b256"), ("llama", "llama_layer")):
        entries = res.get(sec, [])
        entries = entries if isinstance(entries, list) else [entries]
        entries = [e for e in entries if "256" in e["name"]] if sec == "vit" else entries
        for e in entries:
            for v, d in e["variants"].items():
                if "ratio" in d:
                    s[f"{key}_{v}"] = d["ratio"]
    mins = []
    for sec in ("vit", "llama"):
        entries = res.get(sec, [])
        for e in entries if isinstance(entries, list) else [entries]:
            for v, d in e["variants"].items():
                if v.endswith("auto") and d.get("min_layer_speedup"):
                    mins.append(d["min_layer_speedup"])
    if mins:
        s["auto_min_layer_speedup"] = min(mins)
    return s


def to_markdown(res: dict) -> str:
    lines = [f"# bench_gpu: {res['device']}, {res['date']}", "",
             f"`{res['command']}`; torch {res['torch']}, cuSPARSELt {res['cusparselt']}, "
             f"triton {res.get('triton')}", ""]
    summ = res.get("summary", {})
    if summ:
        lines += ["## Summary (ratio to bf16 dense, same run)", "", "| figure | value | target |",
                  "| --- | --- | --- |"]
        for k, v in summ.items():
            t = TARGETS.get(k)
            met = "" if t is None else (f">= {t}: {'met' if v >= t else 'NOT met'}")
            lines.append(f"| {k} | {v:.3f} | {met} |")
        lines.append("")
    if res.get("gemm"):
        cols = ["bf16_2:4", "fp8_dense", "fp8_2:4", "fp8s_2:4", "fp8st_2:4", "int8_dense",
                "int8_2:4", "bf16_2:4_eager", "stock_2:4_eager", "torchao_fp8_2:4"]
        lines += ["## GEMMs (ratio to cuBLAS bf16 dense under graphs; eager = host work "
                  "included)", "",
                  "| model | layer | N x K | M | dense us | " + " | ".join(cols)
                  + " | fp8 2:4 share: act quant / scale epilogue |",
                  "| --- " * (len(cols) + 6) + "|"]
        for r in res["gemm"]:
            share = ""
            if "fp8_2:4" in r["us"]:
                q = r["us"]["act_quant_rows"]
                share = f"{q / r['us']['fp8_2:4']:.0%}"
                if "act_quant_epilogue" in r["us"]:
                    share += f" / {r['us']['act_quant_epilogue'] / r['us']['fp8_2:4']:.0%}"
            cells = [f"{r['ratio'][c]:.2f}" if c in r["ratio"] else "-" for c in cols]
            lines.append(f"| {r['model']} | {r['layer']} | {r['N']}x{r['K']} | {r['M']} | "
                         f"{r['us']['bf16_dense']:.1f} | " + " | ".join(cells) + f" | {share} |")
        lines.append("")
    for sec in ("vit", "llama"):
        entries = res.get(sec)
        if not entries:
            continue
        for e in entries if isinstance(entries, list) else [entries]:
            lines += [f"## {e['name']} (dense bf16 {e.get('dense_us', float('nan')):.0f} us)", "",
                      "| variant | ratio to dense | rel. error vs fp32 | min layer speedup | "
                      "bound: linears' share of dense time, max ratio |",
                      "| --- | --- | --- | --- | --- |"]
            for v, d in e["variants"].items():
                ratio = f"{d['ratio']:.2f}" if d.get("ratio") else "-"
                mls = d.get("min_layer_speedup")
                b = d.get("bound")
                bound = "" if not b else (f"{b['linear_dense_us'] / e['dense_us']:.0%}, "
                                          f"{b['max_speedup']:.2f}")
                lines.append(f"| {v} | {ratio} | {d['rel_err']:.4f} | "
                             f"{'' if mls is None else f'{mls:.2f}'} | {bound} |")
            for v, err in e["errors"].items():
                lines.append(f"| {v} | failed: {err} | | | |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="bench_gpu_out", help="where JSON and markdown go")
    ap.add_argument("--sections", default="gemm,vit,llama", help="comma list of gemm,vit,llama")
    ap.add_argument("--models", default=",".join(GEMM_SHAPES),
                    help=f"GEMM shapes of these models (of {', '.join(GEMM_SHAPES)})")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="GEMM token counts M")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI)")
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    bad = set(sections) - {"gemm", "vit", "llama"}
    if bad:
        raise SystemExit(f"--sections: unknown {sorted(bad)}; allowed: gemm, vit, llama")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU; use --smoke on CPU")
    device = torch.device("cpu" if args.smoke else "cuda")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    res: dict = {
        "command": "python tools/bench_gpu.py " + " ".join(argv if argv is not None else
                                                            __import__("sys").argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "cusparselt": torch.backends.cusparselt.version() if device.type == "cuda" else None,
    }

    def write() -> None:
        res["summary"] = summarize(res)
        (out_dir / "bench_gpu.json").write_text(json.dumps(res, indent=1, default=str))
        (out_dir / "bench_gpu.md").write_text(to_markdown(res) + "\n")

    unknown = set(args.models.split(",")) - set(GEMM_SHAPES)
    if unknown:
        raise SystemExit(f"--models: unknown {sorted(unknown)}; allowed: {', '.join(GEMM_SHAPES)}")
    shapes = {"tiny": [("fc", 64, 128)]} if args.smoke else {
        k: GEMM_SHAPES[k] for k in args.models.split(",")}
    tokens = (16,) if args.smoke else tuple(int(t) for t in args.tokens.split(","))
    for sec in sections:
        try:
            if sec == "gemm":
                res["gemm"] = []
                bench_gemm(device, shapes, tokens, log, res["gemm"], write)
            elif sec == "vit":
                res["vit"] = []
                vit_section(device, (2,) if args.smoke else (64, 256), args.smoke, log,
                            res["vit"], write)
            else:
                res["llama"] = llama_section(device, 16 if args.smoke else 4096, args.smoke, log)
        except Exception:
            res.setdefault("section_errors", {})[sec] = traceback.format_exc()[-2000:]
            log(f"section {sec} failed:\n{res['section_errors'][sec]}")
            if args.smoke:
                raise
        write()
    log(to_markdown(res))
    return res


if __name__ == "__main__":
    main()
