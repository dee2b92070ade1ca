"""All of ``accelerate``'s planning: which variant each linear layer runs. :class:`Planner`
holds one model's plan: each layer's candidates (:func:`layer_plan`) and choice, a
:class:`PlannedLayer` per layer it may replace, the variant modules it builds, sibling fusion,
and the token counts up to which the small-M (decode) kernels serve (:meth:`Planner.plan_decode`).

With ``sparsity="auto"`` the planner is speed-aware: per GEMM shape, time each candidate
variant as it will run, keep the fastest, and remember the timings on disk.

Decode: a bf16 or fp8 2:4 layer also has a small-M kernel. On CUDA each such shape is timed at
M = 1, 4, 16, 32 (``DECODE_BUCKETS``) on the small-M kernel, the large-M path and bf16 dense
(:func:`time_decode`): the small-M kernel serves up to the last M where it beats the large-M
path, and under ``sparsity="auto"`` the layer runs bf16 dense (``F.linear`` on a bf16 copy of
its effective weight, 2 bytes per weight; ``PlanOptions(decode_dense=False)`` keeps none) for
the M where dense beats the 2:4 path it would run (:func:`dense_range`), so "auto" never runs a
decode batch slower than dense. M above 32 keeps the large-M path. ``sparsity="2:4"`` keeps
the 2:4 paths at every M (the report's notes name the batches where they lose to dense).

"As it will run": a candidate layer is compiled with ``torch.compile`` (inductor, so its
per-token activation quantization and scale epilogue are fused the way they will be inside the
model) and timed under CUDA-graph replay (the accelerated model runs under CUDA graphs), at the
token count of the example input. 2:4 candidates are timed with their best cuSPARSELt algorithm
(:mod:`sparsekit.accel.algsearch`). On CPU (reference ops) the same candidates are timed by
wall clock, so the code path is the same everywhere; only CUDA timings mean anything for speed.

Timings are cached in ``$SPARSEKIT_CACHE/plans.json`` (default ``~/.cache/sparsekit``) keyed
by device name, torch version, variant, weight shape (N, K), tokens M and input dtype, so a
second ``accelerate`` of the same shapes times nothing. :func:`choose` is the pure decision on
timings (tested on recorded H200 timings).

A layer timed alone misjudges the model: alone, an 8-bit layer's activation quantization reads
its input from memory, inside the model it is fused into the norm or activation that produces
it (on the 8B-shaped Llama the per-layer choice picked bf16 2:4 for 40 of 56 layers and ran at
1.18x where fp8 2:4 everywhere ran at 1.44x). So on CUDA ``accelerate`` then compares a few
WHOLE-MODEL plans, each compiled and run as it will run: all layers dense (the floor), the
per-layer choice, every 2:4 layer at the precision's 2:4, every 2:4 layer at bf16 2:4 (the
last two not at every size: :func:`whole_model_plans`), and keeps the fastest
(:func:`choose_plan`; a plan other than dense must beat it by ``min_speedup``; one within
``CONFIRM_BELOW`` of dense is timed again alternating with it, :func:`time_paired`, and must
beat it there by ``PLAN_MARGIN``). A model of
many identical blocks and at least ``SHORTEN_MIN_BYTES`` of weights is timed on a few of its
blocks and extrapolated (:func:`truncated`, :func:`extrapolate_ms`; the weights as they
are held while planning). The choice and
the plans' times are cached under a key of the model's layer shapes, input shapes and options
(:func:`model_key`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparsekit import _compat
from sparsekit.accel import algsearch
from sparsekit.accel.kernels.cusparselt import ext as cslt_ext
from sparsekit.accel.kernels.mma_sp import launch as sk24_mma
from sparsekit.accel import siblings as siblings_
from sparsekit.accel.layers import VARIANTS, scheme_precision, variant_name
from sparsekit.accel.model import AcceleratedModel
from sparsekit.accel.options import CompileOptions, PlanOptions
from sparsekit.accel.report import BASELINE, AccelReport, LayerDecision, decide
from sparsekit.io.cache import cache_root
from sparsekit.io.files import atomic_write
from sparsekit.nn.calibration import feed, tree_map
from sparsekit.nn.timing import flush_l2, graph_time_us, time_ms
from sparsekit.quant.formats import get_scheme
from sparsekit.quant.modules import QuantLinear

DECODE_TOKENS = 64  # M at or below this is decode-sized: 2:4 often loses there (docs/gpu.md)
DECODE_MARGIN = 1.05  # ... so there a 2:4 variant must beat the best dense one by 5%
# how decode plans time their layers; a cached plan timed otherwise is timed again
DECODE_TIMING = "weights-from-memory"


def cache_path() -> Path:
    return cache_root() / "plans.json"


def plan_key(device_name: str, torch_version: str, variant: str, out_features: int,
             in_features: int, tokens: int, dtype: str = "bfloat16",
             inductor: dict | None = None) -> str:
    """One cache entry's key: everything a variant's time depends on (extra ``inductor``
    options of the compile included)."""
    return (f"{device_name}|torch={torch_version}|{variant}|N={out_features}|K={in_features}|"
            f"M={tokens}|{dtype}" + (f"|inductor={sorted(inductor.items())}" if inductor else ""))


def load(path: Path | None = None) -> dict[str, dict]:
    path = path or cache_path()
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # a damaged cache is re-measured, not fatal
        return {}


def store(entries: dict[str, dict], path: Path | None = None) -> None:
    """Merge ``entries`` into the cache file (atomic write)."""
    path = path or cache_path()
    data = load(path)
    data.update(entries)
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1,
                                                                   sort_keys=True)))


def choose(timings_us: dict[str, float], tokens: int, min_speedup: float = 1.0
           ) -> tuple[str, str]:
    """(variant, why) from one GEMM shape's timings (us). The fastest variant that beats bf16
    dense by ``min_speedup``; bf16 dense otherwise. At decode sizes (``tokens`` <= 64) a 2:4
    variant must also beat the best dense variant (bf16 or fp8/int8 dense) by
    ``DECODE_MARGIN``, else that dense one is kept: small GEMMs time noisily, and there 2:4
    gains least and (for 8-bit) adds the most error."""
    variant, speedup = decide(timings_us, min_speedup)
    if variant == BASELINE:
        return BASELINE, "no variant beat bf16 dense" + (
            f" by {min_speedup}x" if min_speedup != 1.0 else "")
    why = f"fastest measured ({speedup:.2f}x bf16 dense at M={tokens})"
    if tokens <= DECODE_TOKENS and variant.endswith("2:4"):
        dense = {v: t for v, t in timings_us.items() if v.endswith("dense")}
        best_dense = min(dense, key=dense.get)
        if timings_us[variant] * DECODE_MARGIN > dense[best_dense]:
            if best_dense != BASELINE and dense[BASELINE] / dense[best_dense] < min_speedup:
                best_dense = BASELINE
            return best_dense, (f"decode-sized (M={tokens}): 2:4 not {DECODE_MARGIN}x faster "
                                f"than {best_dense}")
    return variant, why


def whole_model_plans(layers: dict[str, tuple[list[str], str]], precision: str,
                      decode: bool | None = None) -> dict[str, dict[str, str]]:
    """The whole-model plans to time, name -> {layer: variant}, from each layer's candidates
    and its per-layer choice (``layers``: name -> (candidates, choice)). "dense": each layer's
    first candidate (bf16 dense; a quantized layer's own dense variant); "per_layer": the
    choices; "<variant>" for the precision's 2:4, bf16 2:4 and the precision's dense: that
    variant on every layer that has it as a candidate, the per-layer choice elsewhere. Each
    plan costs a compile of the whole model, so at decode sizes (``decode``) only an 8-bit
    precision's 2:4 is tried of these (bf16 2:4 runs at 0.57-0.84x of dense at M <= 64; the
    precision's dense everywhere ran slower than bf16 dense on the H200's 32-layer decode step,
    18.74 vs 17.39 ms, and a decode step is timed whole, about 45 s a plan), and at prefill
    sizes the precision's dense is not (its 2:4 is faster
    wherever 8-bit pays); the per-layer choice still covers each layer's every candidate. A
    plan equal to an earlier one is left out. Pure."""
    plans: dict[str, dict[str, str]] = {
        "dense": {n: c[0] for n, (c, _) in layers.items()},
        "per_layer": {n: ch for n, (_, ch) in layers.items()},
    }
    sparse, dense = variant_name(precision, True), variant_name(precision, False)
    if decode is None:  # size unknown: every uniform plan
        uniform = [sparse, "bf16_2:4", dense]
    elif decode:  # bf16 2:4 never as a plan of its own (the per-layer choice may pick it)
        uniform = [sparse] if precision != "bf16" else []
    else:
        uniform = [sparse, "bf16_2:4"]
    for v in dict.fromkeys(uniform):
        plans[v] = {n: (v if v in c else ch) for n, (c, ch) in layers.items()}
    out: dict[str, dict[str, str]] = {}
    for name, assign in plans.items():
        if assign not in out.values():
            out[name] = assign
    return out


def choose_plan(ms: dict[str, float], min_speedup: float = 1.0) -> tuple[str, str]:
    """(plan, why) from whole-model times (ms per call, "dense" among them): the fastest plan,
    unless it is not ``min_speedup`` times faster than "dense", which is then kept. Pure."""
    if "dense" not in ms:
        raise ValueError(f"plan times must include 'dense', got {list(ms)}")
    best = min(ms, key=lambda p: (ms[p], p != "dense"))
    ratio = ms["dense"] / ms[best]
    if best == "dense":
        return "dense", "whole model: no plan faster than dense"
    if ratio < min_speedup:
        return "dense", f"whole model: best plan {best} only {ratio:.3f}x dense (< {min_speedup})"
    return best, f"whole model: plan {best} fastest ({ratio:.2f}x dense)"


# a non-dense plan timed within CONFIRM_BELOW of dense is timed again alternating with it
# (time_paired, CONFIRM_ROUNDS blocks each) and kept only if it beats dense by PLAN_MARGIN
# there: plans timed one after the other are 5% apart by drift and host state alone (H200:
# BERT-large's fp8 per-layer plan timed 1.002x dense, ran at 0.953x of it alternating; in
# another run 1.058x timed, 1.007x alternating; journal/gpu.md)
CONFIRM_BELOW = 1.10
CONFIRM_ROUNDS = 6
PLAN_MARGIN = 1.02

# a model of at least MIN_REPEATED_BLOCKS identical blocks and SHORTEN_MIN_BYTES of weights is
# timed with PLAN_BLOCKS_TIMED of its blocks. Smaller models are timed whole: their compiles
# take seconds, and on them the extrapolation misled (H200, BERT-large, 0.7 GB of weights:
# bf16 2:4 predicted 4.49 ms, ran 6.17; fp8 plans off by up to 10%,
# which flipped fp8 2:4 and dense); on the 8B-shaped Llama (16 GB) prefill within 1-8%, its
# decode step up to 22% (fp8 2:4 predicted 12.45 ms, ran 15.24) with the plans' order kept.
PLAN_BLOCKS_TIMED = (1, 5)
MIN_REPEATED_BLOCKS = 8
SHORTEN_MIN_BYTES = 4 << 30


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (a tensor held twice counted once)."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def repeated_blocks(model: nn.Module, plans: dict[str, dict[str, str]],
                    min_blocks: int = MIN_REPEATED_BLOCKS) -> tuple[str, nn.Module] | None:
    """(qualified name, container) of the ``nn.ModuleList``/``nn.Sequential`` of at least
    ``min_blocks`` blocks of one class and equal parameter shapes that holds the most planned
    layers, provided every plan gives each block the same variants (layer ``<name>.<i>.<rest>``
    the variant of ``<name>.0.<rest>``); None when there is none. Such a model can be timed on
    a few of its blocks (:func:`truncated`)."""
    def shape(block: nn.Module) -> tuple:
        return (type(block), tuple((n, tuple(p.shape)) for n, p in block.named_parameters()),
                tuple((n, type(m)) for n, m in block.named_modules()))

    best, best_count = None, 0
    for name, mod in model.named_modules():
        if type(mod) not in (nn.ModuleList, nn.Sequential) or len(mod) < min_blocks or not name:
            continue
        if len({shape(b) for b in mod}) != 1:
            continue
        keys = [str(k) for k in mod._modules]
        prefixes = [f"{name}.{k}." for k in keys]
        count = 0
        periodic = True
        for assign in plans.values():
            by_rest: dict[str, set[str]] = {}
            for layer, variant in assign.items():
                for prefix in prefixes:
                    if layer.startswith(prefix):
                        by_rest.setdefault(layer[len(prefix):], set()).add(variant)
                        count += 1
                        break
            periodic = periodic and all(len(v) == 1 for v in by_rest.values())
        if periodic and count > best_count:
            best, best_count = (name, mod), count
    return best


class truncated:
    """Context manager: the container ``name`` of ``model`` holds only its first ``k`` blocks
    inside (slicing keeps the blocks' names); restored on exit."""

    def __init__(self, model: nn.Module, name: str, k: int):
        parent_name, _, self.attr = name.rpartition(".")
        self.parent = model.get_submodule(parent_name)
        self.full = getattr(self.parent, self.attr)
        self.k = k

    def __enter__(self) -> nn.Module:
        setattr(self.parent, self.attr, self.full[:self.k])
        return self.parent

    def __exit__(self, *exc) -> None:
        setattr(self.parent, self.attr, self.full)


def extrapolate_ms(times: dict[int, float], total: int) -> float:
    """A model's ms per call with ``total`` repeated blocks, from its times with two other
    block counts (``{k1: ms, k2: ms}``), linear in the count (each block costs the same, never
    less than nothing; everything else is the rest)."""
    (k1, t1), (k2, t2) = sorted(times.items())
    per_block = max(t2 - t1, 0.0) / (k2 - k1)  # noise can make more blocks time faster
    return t1 + (total - k1) * per_block


def model_key(device_name: str, torch_version: str, signature: str) -> str:
    """The cache key of one whole-model decision (``signature``: a hash of layer shapes, tokens,
    candidates, per-layer choices, input shapes and accelerate's options)."""
    return f"model|{device_name}|torch={torch_version}|{signature}"


def time_model_ms(fn: Callable[[], object], device: torch.device, calls: int = 10,
                  warmup: int = 3, cold_l2: bool = False) -> float:
    """Median ms of one whole-model call as it will run (the first warm-up call compiles), by
    :func:`~sparsekit.nn.timing.time_ms`; on CUDA each call starts a new CUDA-graph step,
    as serving does. ``cold_l2``: the L2 cache is flushed before each timed call (outside the
    timed span; :func:`~sparsekit.nn.timing.flush_l2`)."""
    def step() -> object:
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        return fn()

    return time_ms(step, device, warmup=warmup, repeats=calls,
                   before=(lambda: flush_l2(device)) if cold_l2 else None)


def time_paired(ref_fn: Callable[[], object], fn: Callable[[], object], device: torch.device,
                rounds: int = 8, calls: int = 3, blocks: list | None = None
                ) -> tuple[float, float]:
    """(median ms of ``ref_fn``, of ``fn``), timed in alternating blocks of ``calls`` calls
    (``rounds`` blocks each; the order flips every round, ref first, then ``fn`` first: ABBA),
    each block after one warm-up call (:func:`time_model_ms`), the median over the blocks'
    medians. Two models timed minutes apart are timed at different GPU clocks (an H200 at its
    power cap lowers its clock as a run goes on: the same dense model 6.5% slower at the end of
    one bench run) and, on a 6 ms model, different host states; blocks a second apart compare
    them under one condition. ``blocks`` (a list) receives ``[ref|var, unix start, unix end,
    median ms]`` per block."""
    ref: list[float] = []
    var: list[float] = []
    for r in range(rounds):
        order = ((ref_fn, ref), (fn, var)) if r % 2 == 0 else ((fn, var), (ref_fn, ref))
        for f, acc in order:
            t0 = time.time()
            acc.append(time_model_ms(f, device, calls=calls, warmup=1))
            if blocks is not None:  # wall-clock span of the block (for a clock log beside it)
                blocks.append(["ref" if acc is ref else "var", round(t0, 3),
                               round(time.time(), 3), round(acc[-1], 4)])
    return statistics.median(ref), statistics.median(var)


def time_module(module: nn.Module, x: torch.Tensor, backend: str = "inductor",
                inductor: dict | None = None) -> float:
    """Microseconds per call of ``module(x)`` as it will run: compiled with ``backend`` and
    extra ``inductor`` options (no CUDA graphs of its own) and timed under CUDA-graph replay on
    CUDA; wall clock on CPU."""
    fn = _compat.compile_module(module, dynamic=False, backend=backend, options=inductor)
    # every candidate class shares _AccelLinear.forward's code object: without a higher limit
    # dynamo stops recompiling it after 8 candidates and the rest would be timed eagerly
    with torch.no_grad(), _compat.recompile_limit(1 << 16):
        if x.is_cuda:
            return graph_time_us(lambda: fn(x))
        return time_ms(lambda: fn(x), "cpu", warmup=1, repeats=5) * 1e3


# ---- accelerate's plan: per-layer candidates and choices, whole-model plans, decode limits ----

_ALIGN = 32  # in/out features the 8-bit and 2:4 kernels take (cuSPARSELt, _scaled_mm, _int_mm)
DECODE_BUCKETS = (1, 4, 16, 32)  # token counts at which the small-M kernel is timed


def own_precision(layer: nn.Module) -> str | None:
    """The accel precision that keeps a ``QuantLinear``'s numerics: a W8A8 layer's activation
    format ("fp8" for fp8 and fp8_static, "int8" for int8 and int8_static), "fp8w" for
    fp8_weight_only; None for other layers."""
    return scheme_precision(layer.scheme) if isinstance(layer, QuantLinear) else None


def layer_plan(has_2to4: bool, precision: str, sparsity: str, in_features: int,
               out_features: int, dense_precision: str = "bf16") -> tuple[list[str], str]:
    """Candidate variants for one linear (bf16 dense always first; the last one is what
    sparsity "2:4"/"dense" installs) and why the list is what it is. Pure."""
    if in_features % _ALIGN or out_features % _ALIGN:
        return [BASELINE], (f"in/out features {in_features}/{out_features} not multiples of "
                            f"{_ALIGN}: stays bf16 dense")
    if sparsity == "dense":
        return list(dict.fromkeys([BASELINE, variant_name(precision, False)])), "sparsity=dense"
    if not has_2to4:
        return (list(dict.fromkeys([BASELINE, variant_name(dense_precision, False)])),
                f"weight holds no 2:4 pattern: {dense_precision} dense")
    if sparsity == "2:4":
        return [BASELINE, variant_name(precision, True)], "2:4 pattern"
    cands = [BASELINE, variant_name(precision, False), "bf16_2:4", variant_name(precision, True)]
    return list(dict.fromkeys(cands)), "auto: fastest measured"


@dataclass
class PlannedLayer:
    """A layer ``accelerate`` may replace: the original ``layer``, the ``tokens`` (M) it is
    called with on the example inputs, its ``candidates`` (variants, bf16 dense first; with
    ``sparsity="auto"`` those that ran at its shape) and its ``decision`` (the report's entry;
    ``decision.variant`` is what gets installed)."""

    layer: nn.Module
    tokens: int
    candidates: list[str]
    decision: LayerDecision


class Planner:
    """``accelerate``'s planning for one model: each layer's candidates and choice
    (:meth:`decide`; with ``sparsity="auto"`` timed per GEMM shape), then on CUDA the
    whole-model plans (:meth:`plan_whole_model`), the variant modules (:meth:`build`, with the
    cuSPARSELt algorithm search), sibling fusion and the small-M kernels' token limits
    (:meth:`finish`). ``layers``: name -> :class:`PlannedLayer`. Timings and choices are read
    from and saved to the disk cache (``options.cache``). ``compile``/``compiled``: how the
    model will run (the whole-model plans are timed that way)."""

    def __init__(self, device: torch.device, precision: str, sparsity: str,
                 options: PlanOptions, compile: CompileOptions, compiled: bool,
                 report: AccelReport):
        self.device, self.precision, self.sparsity = device, precision, sparsity
        self.options, self.compile, self.compiled = options, compile, compiled
        self.report = report
        self.inductor = compile.inductor or {}
        self.whole_model = (device.type == "cuda" if options.whole_model is None
                            else options.whole_model)
        self.layers: dict[str, PlannedLayer] = {}
        self.algs: dict[tuple, int] = {}
        self.cache = load() if options.cache else {}
        self.new: dict[str, dict] = {}
        self.name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self._shapes: dict[tuple, tuple[str, str, dict]] = {}  # one choice per GEMM shape
        # the whole-model plans run as the model will, their outputs not cloned
        self._plan_compile = dataclasses.replace(compile, clone_outputs=False)

    # -- variant modules and their timings --

    def build(self, variant: str, layer: nn.Module, m: int) -> nn.Module:
        cls = VARIANTS[variant]
        # a layer's scheme picks its kernel route (per-tensor fp8: sparsekit's binding)
        key = (variant, layer.out_features, layer.in_features, m, getattr(layer, "scheme", None))
        fused_quant = self.options.fused_quant
        if cls.uses_alg and self.device.type == "cuda" and self.options.search_algs:
            if key not in self.algs:
                hit = self.cache.get(self._key(variant, layer, m), {})
                if "alg_id" in hit:
                    self.algs[key] = int(hit["alg_id"])
                else:
                    mod, self.algs[key], _ = algsearch.search(variant, layer, m,
                                                              use_cache=self.options.cache)
                    mod.fused_quant = fused_quant
                    return mod
        return cls(layer, alg_id=self.algs.get(key, 0), fused_quant=fused_quant)

    def _key(self, variant: str, layer: nn.Module, m: int) -> str:
        # a static-scheme layer quantizes its input elementwise: another cost than per token
        numerics = f"{variant}|{layer.scheme}" if isinstance(layer, QuantLinear) else variant
        return plan_key(self.name, torch.__version__, numerics, layer.out_features,
                        layer.in_features, m, inductor=self.inductor)

    def time(self, variant: str, layer: nn.Module, m: int) -> float:
        """Microseconds of ``variant`` for ``layer`` at ``m`` tokens, compiled (cached)."""
        key = self._key(variant, layer, m)
        hit = self.cache.get(key)
        if hit is not None and "us" in hit:
            return float(hit["us"])
        mod = self.build(variant, layer, m)
        x = torch.randn(m, layer.in_features, device=self.device, dtype=torch.bfloat16)
        us = time_module(mod, x, self.compile.backend, self.inductor)
        entry = {"us": us}
        if mod.uses_alg:
            entry["alg_id"] = mod.alg_id
        self.cache[key] = self.new[key] = entry
        return us

    def save(self) -> None:
        if self.options.cache and self.new:
            store(self.new)

    def install(self, model: nn.Module, assign: dict[str, str]) -> None:
        """Put the variants ``assign`` ({layer name: variant}) in place in ``model`` (bf16 dense
        keeps a float Linear as it is: cuBLAS)."""
        for name, variant in assign.items():
            planned = self.layers[name]
            if variant == BASELINE and not isinstance(planned.layer, QuantLinear):
                model.set_submodule(name, planned.layer)
            else:
                model.set_submodule(name, self.build(variant, planned.layer, planned.tokens))

    # -- per layer --

    def decide(self, name: str, layer: nn.Module, m: int, has_2to4: bool) -> None:
        """Layer ``name``'s candidates and, with ``sparsity="auto"``, its per-shape choice;
        adds its decision to the report and, when accelerate may replace it, to ``layers``."""
        cands, reason = layer_plan(has_2to4, self.precision, self.sparsity, layer.in_features,
                                   layer.out_features, self.options.dense_precision)
        quantized = own_precision(layer) is not None
        if quantized:  # only variants with the layer's own numerics: its scheme, dense or 2:4
            reason = f"quantized ({layer.scheme}): its weights, scales and activation numerics"
            if layer.in_features % _ALIGN or layer.out_features % _ALIGN:  # quant's forward
                self.report.layers.append(LayerDecision(
                    name, layer.out_features, layer.in_features, m, has_2to4, "QuantLinear",
                    reason + "; in/out features not multiples of 32: kept"))
                return
            cands = [variant_name(self.precision, False)] + (
                [variant_name(self.precision, True)] if has_2to4 and self.sparsity != "dense"
                else [])
        decision = LayerDecision(name, layer.out_features, layer.in_features, m, has_2to4,
                                 BASELINE, reason)
        self.report.layers.append(decision)
        planned = self.layers[name] = PlannedLayer(layer, m, cands, decision)
        if quantized and self.sparsity == "auto" and len(cands) > 1:
            timings = {v: self.time(v, layer, m) for v in cands}
            decision.variant = min(timings, key=timings.get)
            decision.timings_us = timings
            decision.reason += f"; faster measured at M={m}"
        elif self.sparsity != "auto" or len(cands) == 1:
            decision.variant = cands[-1]
        else:
            decision.variant, why, timings = self._choose_shape(layer, m, cands)
            decision.timings_us = dict(timings)
            decision.reason = f"{reason}; {why}"
            # a variant that did not run at this shape is no candidate of any plan
            planned.candidates = [c for c in cands if c in timings]

    def _choose_shape(self, layer: nn.Module, m: int,
                      cands: list[str]) -> tuple[str, str, dict[str, float]]:
        """(variant, why, timings in us) of ``layer``'s GEMM shape at ``m`` tokens (:func:`choose`
        on each candidate's time), timed once per shape."""
        key = (layer.out_features, layer.in_features, m, tuple(cands))
        if key not in self._shapes:
            timings = {}
            for v in cands:
                try:
                    timings[v] = self.time(v, layer, m)
                except RuntimeError as e:  # a kernel this shape cannot run: not a candidate
                    if v == BASELINE:
                        raise
                    self.report.notes.append(f"{v} at {layer.out_features}x{layer.in_features}"
                                             f", M={m} did not run: "
                                             f"{str(e).splitlines()[0][:120]}")
            variant, why = choose(timings, m, self.options.min_speedup)
            self._shapes[key] = (variant, why, timings)
        return self._shapes[key]

    # -- whole model --

    def plan_whole_model(self, model: nn.Module, inputs: Any) -> None:
        """Time a few whole-model plans as they will run (:func:`whole_model_plans`,
        :func:`choose_plan`; cached on disk) and set each decision to the best one's variant."""
        t0 = time.perf_counter()
        layers = {n: (p.candidates, p.decision.variant) for n, p in self.layers.items()}
        decode = all(p.tokens <= DECODE_TOKENS for p in self.layers.values())
        plans = whole_model_plans(layers, self.precision, decode)
        key = model_key(self.name, torch.__version__, self._signature(model, inputs))
        entry = self.cache.get(key, {})
        cached = entry.get("plan") in plans and "ms" in entry
        if cached:
            entry = {**entry, "ms": {k: float(v) for k, v in entry["ms"].items()},
                     "why": entry.get("why", f"whole model: plan {entry['plan']} (cached)")
                     + " (cached)"}
        else:
            entry = self._time_plans(model, inputs, plans, decode)
            self.cache[key] = self.new[key] = entry
        self.report.seconds["plan_model"] = time.perf_counter() - t0
        self._keep_plan(plans, entry["plan"], entry["why"], entry["ms"], entry.get("confirm_ms"))

    def _signature(self, model: nn.Module, inputs: Any) -> str:
        """A hash of everything a whole-model decision depends on (see :func:`model_key`):
        layer shapes, tokens, candidates, per-layer choices, input shapes and the options."""
        c, o = self.compile, self.options
        options = dict(compile=self.compiled, mode=c.mode, dynamic=c.dynamic,
                       backend=c.backend, inductor=c.inductor, capture=c.capture,
                       fused_quant=o.fused_quant, dense_precision=o.dense_precision,
                       precision=self.precision, min_speedup=o.min_speedup,
                       plan_blocks=PLAN_BLOCKS_TIMED, plan_cold_l2=True,
                       plan_confirm=[CONFIRM_BELOW, PLAN_MARGIN],
                       shorten_min_bytes=SHORTEN_MIN_BYTES,
                       # decisions of the planner that extrapolated decode steps from a few
                       # blocks are not reused
                       decode_timed_whole=True)
        shapes = []
        tree_map(lambda t: shapes.append([list(t.shape), str(t.dtype)]) or t, inputs)
        layers = [[n, p.decision.out_features, p.decision.in_features, p.decision.tokens,
                   p.decision.has_2to4, p.candidates, p.decision.variant,
                   getattr(p.layer, "scheme", None)] for n, p in self.layers.items()]
        blob = json.dumps([type(model).__name__, shapes, layers, options], sort_keys=True,
                          default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:20]

    def _time_plans(self, model: nn.Module, inputs: Any, plans: dict[str, dict[str, str]],
                    decode: bool) -> dict:
        """{"plan", "why", "ms" (each plan's ms per call)[, "confirm_ms"]}: every plan installed
        and timed (a big model of repeated blocks on a few of them), the fastest chosen, a
        close call confirmed by timing it alternating with dense (:meth:`_confirm_plan`)."""
        big = weight_bytes(model) >= SHORTEN_MIN_BYTES
        # a decode-sized step is timed whole: on the H200 1 and 5 of a 32-layer Llama's blocks
        # put its attention-bound decode step 20% off both ways, and "auto" chose a 2:4 plan
        # running at 0.77x; a step costs milliseconds, compiles are what planning a whole
        # model costs
        blocks = repeated_blocks(model, plans) if big and not decode else None
        if big and decode:
            self.report.notes.append("decode-sized input: whole-model plans timed on the whole "
                                     "model, not extrapolated from a few blocks")
        ms, blocks = self._time_each(model, inputs, plans, blocks)
        if blocks is not None:
            k1, k2 = PLAN_BLOCKS_TIMED
            self.report.notes.append(f"whole-model plans timed with {k1} and {k2} of the "
                                     f"{len(blocks[1])} blocks of {blocks[0]}, extrapolated "
                                     f"linearly to all of them")
        best, why = choose_plan(ms, self.options.min_speedup)
        entry = {"plan": best, "why": why, "ms": ms}
        if best != "dense" and blocks is None and ms["dense"] / ms[best] < CONFIRM_BELOW:
            best, why, entry["confirm_ms"] = self._confirm_plan(model, inputs, plans, best)
            entry.update(plan=best, why=why)
        return entry

    def _time_each(self, model: nn.Module, inputs: Any, plans: dict[str, dict[str, str]],
                   blocks: tuple[str, nn.Module] | None
                   ) -> tuple[dict[str, float], tuple[str, nn.Module] | None]:
        """(ms per call of each plan that ran, the ``blocks`` they were timed on: None when the
        model did not run shortened)."""
        ms: dict[str, float] = {}
        for pname, assign in plans.items():
            self.install(model, assign)
            if pname == "dense" and blocks is not None:
                try:  # a model whose forward needs all its blocks: time it whole
                    ms[pname] = self._time_plan(model, inputs, blocks)
                    continue
                except Exception as e:  # noqa: BLE001  (any failure of the shortened model)
                    self.report.notes.append(
                        f"the model did not run with {blocks[0]} shortened ({type(e).__name__}"
                        f": {str(e).splitlines()[0][:100]}): plans timed on the whole model")
                    blocks = None
            try:
                ms[pname] = self._time_plan(model, inputs, blocks)
            except RuntimeError as e:
                if pname == "dense":
                    raise
                self.report.notes.append(f"whole-model plan {pname} did not run: "
                                         f"{str(e).splitlines()[0][:120]}")
        return ms, blocks

    def _keep_plan(self, plans: dict[str, dict[str, str]], best: str, why: str,
                   ms: dict[str, float], confirm: dict[str, float] | None) -> None:
        """Plan ``best`` into the report (times, notes) and each layer's decision."""
        report = self.report
        report.plans_ms = dict(ms)
        report.plan = best
        src = confirm or ms  # the alternating times where there are any
        report.model_us = {"dense": src["dense"] * 1e3,
                           "accelerated": src.get(best, ms[best]) * 1e3}
        same = [p for p in plans if p != best and plans[p] == plans[best]]
        report.notes.append(why + "; plans timed (ms): " +
                            ", ".join(f"{p} {t:.3f}" for p, t in ms.items()) +
                            (f"; {best} = {', '.join(same)}" if same else "") +
                            ("; timed alternating (ms): " +
                             ", ".join(f"{p} {t:.3f}" for p, t in confirm.items())
                             if confirm else ""))
        for name, variant in plans[best].items():
            d = self.layers[name].decision
            if variant != d.variant:
                d.reason += (f"; per-layer choice {d.variant} overridden by whole-model plan "
                             f"{best}")
                d.variant = variant
            else:
                d.reason += f"; whole-model plan {best}"

    def _runner(self, model: nn.Module) -> AcceleratedModel:
        """``model`` as one plan of it will run: wrapped and compiled as accelerate's result."""
        r = self.report
        return AcceleratedModel(model, AccelReport(r.precision, "auto", r.min_speedup, r.device),
                                self.device, self._plan_compile, compile=self.compiled)

    def _confirm_plan(self, model: nn.Module, inputs: Any, plans: dict[str, dict[str, str]],
                      best: str) -> tuple[str, str, dict[str, float]]:
        """(plan, why, {"dense": ms, best: ms}): ``best`` and "dense" built side by side
        (module copies sharing the weights) and timed alternating (:func:`time_paired`);
        ``best`` is kept if it beats dense by ``min_speedup`` and ``PLAN_MARGIN`` there, else
        dense. Plans timed one after the other misjudged close calls: on the H200
        BERT-large's fp8 per-layer plan timed 1.002x dense and ran at 0.953x of it."""
        fns = []
        for name in ("dense", best):
            shell = _shell_copy(model)
            self.install(shell, plans[name])
            fns.append(functools.partial(feed, self._runner(shell), inputs))
        try:
            dense_ms, best_ms = time_paired(fns[0], fns[1], self.device, rounds=CONFIRM_ROUNDS)
        finally:
            fns = shell = None
            if self.compiled:
                _reset_compiled()
        ratio, need = dense_ms / best_ms, max(self.options.min_speedup, PLAN_MARGIN)
        timed = {"dense": dense_ms, best: best_ms}
        if ratio < need:
            return "dense", (f"whole model: plan {best} {ratio:.3f}x dense timed alternating "
                             f"with it (< {need}): dense"), timed
        return best, f"whole model: plan {best} {ratio:.2f}x dense, timed alternating with it", \
            timed

    def _time_plan(self, model: nn.Module, inputs: Any,
                   blocks: tuple[str, nn.Module] | None) -> float:
        """ms per call of the model as installed, compiled and run as it will run. A model of
        many repeated blocks (``blocks``) is timed with two small numbers of them and
        extrapolated: the plans differ block by block the same way, and each compile costs
        seconds per block. The shortened model's calls start with a cold L2 cache: in the whole
        model each block's weights were evicted by the other blocks (warm, a few small fp8 or
        2:4 blocks would read theirs from L2 and look faster per block than they run)."""
        def once() -> float:
            fast = self._runner(model)
            try:
                return time_model_ms(lambda: feed(fast, inputs), self.device,
                                     cold_l2=blocks is not None)
            finally:
                fast = None
                if self.compiled:
                    _reset_compiled()

        if blocks is None:
            return once()
        times = {}
        for k in PLAN_BLOCKS_TIMED:
            with truncated(model, blocks[0], k):
                times[k] = once()
        return extrapolate_ms(times, len(blocks[1]))

    # -- after the variants are installed --

    def fuse_siblings(self, model: nn.Module, inputs: Any,
                      groups: list[list[str]]) -> CompileOptions:
        """``PlanOptions(siblings=True)`` on the installed model: each group of layers fed one
        tensor becomes one GEMM (:func:`siblings.fuse`). Returns the compile options of the
        model: with the inductor pass merging the members' identical calls
        (:class:`siblings.MergeSameCalls`) when any was fused (unless ``inductor`` sets
        ``post_grad_custom_pre_pass``)."""
        if not self.compiled or self.compile.backend != "inductor":
            self.report.notes.append("siblings: not fused without compile by inductor "
                                     "(elsewhere every member would run the whole GEMM)")
            return self.compile
        notes = siblings_.fuse(model, inputs, groups, self.layers, self.build)
        self.report.notes.extend(notes)
        if not any(n.startswith("siblings fused") for n in notes):
            return self.compile
        return dataclasses.replace(self.compile, inductor={
            "post_grad_custom_pre_pass": siblings_.MergeSameCalls(), **self.inductor})

    def finish(self, model: nn.Module) -> None:
        """Record the cuSPARSELt algorithm each installed layer uses and how its epilogue runs,
        plan the small-M kernels' token limits (:meth:`plan_decode`), save the cache."""
        own = 0
        for name, planned in self.layers.items():
            mod = model.get_submodule(name)
            if getattr(mod, "uses_alg", False):
                planned.decision.alg_ids[planned.decision.variant] = mod.alg_id
            own += getattr(mod, "path", "") == "cslt_alpha"
        self._epilogue_note(own)
        self.plan_decode(model)
        self.save()

    def _epilogue_note(self, own: int) -> None:
        """A note on where the fp8 2:4 layers apply their scales (``own``: how many run on
        sparsekit's cuSPARSELt binding)."""
        fp8_24 = [p.layer for p in self.layers.values() if p.decision.variant == "fp8_2:4"]
        if own:
            self.report.notes.append(f"epilogue: {own} fp8 2:4 layer(s) on sparsekit's "
                                     f"cuSPARSELt binding (scale and bias in the GEMM)")
        elif any(not isinstance(layer, QuantLinear) for layer in fp8_24):
            self.report.notes.append(
                "epilogue: fp8 2:4 layers quantize activations per token, scales applied after "
                "the GEMM; a model quantized with quantize_(model, 'fp8_static_tensor', "
                "calibration=...) first runs scale and bias inside it (faster: docs/gpu.md)")
        elif any(get_scheme(layer.scheme).weight_granularity == "tensor" for layer in fp8_24) \
                and cslt_ext.reason():
            self.report.notes.append(f"epilogue: sparsekit's cuSPARSELt binding unavailable "
                                     f"({cslt_ext.reason()}); scales applied after torch's "
                                     f"binding")

    def plan_decode(self, model: nn.Module) -> None:
        """Per 2:4 layer with the small-M kernel, the token counts it serves: on CUDA each shape
        is timed at ``DECODE_BUCKETS`` (:func:`time_decode`) against the layer's large-M path
        and bf16 dense (CUDA graphs) and keeps the small-M kernel up to the last count where it
        beats the large-M path (``decode_max_m``). Under ``sparsity="auto"`` (and
        ``decode_dense``) the layer also runs bf16 dense on a copy of its weight for the counts
        ``dense_m`` where dense beats the 2:4 path it would run there
        (:meth:`~sparsekit.accel.layers._AccelLinear.keep_dense`). A layer drops the small-M
        format's copy of its weight where no count uses it. The choice is cached on disk with
        the per-layer timings (an entry without ``dense_m`` is timed again when a dense route
        is wanted). An fp8 layer that either small-M kernel takes (``dchoice``) is timed on
        both and keeps the faster (:func:`time_decode_choice`). On CPU the reference paths
        keep the small-M path for every M <= 32 and no dense route (numerics, not speed)."""
        if self.device.type != "cuda":
            return
        dense = self.sparsity == "auto" and self.options.decode_dense
        if sk24_mma.reason() and any(getattr(m, "dkernel", "") == "triton" or (
                getattr(m, "variant", "") == "int4_2:4" and m.path == "triton")
                for m in model.modules()):
            self.report.notes.append(f"decode: the mma.sp 2:4 kernel is not used "
                                     f"({sk24_mma.reason()}); the Triton kernel runs")
        chosen: dict[str, dict] = {}
        copies: dict[str, list] = {}  # key -> [a module of the shape, layers with a copy]
        for mod in model.modules():
            if getattr(mod, "dvalues", None) is None:
                continue
            choice = getattr(mod, "dchoice", False)
            numerics = (f"{mod.variant}|decode|{'triton/mma' if choice else mod.dkernel}|"
                        f"{mod.path}|{'dynamic' if mod.act_scale is None else 'static'}")
            key, entry, new = self._decode_entry(
                mod, numerics, chosen, functools.partial(
                    time_decode_choice if choice else time_decode, mod, self.device, dense=dense),
                fresh=lambda e: not dense or "dense_m" in e)
            if new:
                self.report.notes.append(decode_note(mod, entry))
            route_decode(mod, entry, dense)
            if mod.dense_weight is not None:
                copies.setdefault(key, [mod, 0])[1] += 1
        self._plan_int4_configs(model, chosen)
        for mod, count in copies.values():
            lo, hi = mod.dense_m
            extra = 2 * mod.out_features * mod.in_features * count
            self.report.notes.append(
                f"decode: {mod.variant} {mod.out_features}x{mod.in_features} runs bf16 dense "
                f"for M = {lo}..{hi} (faster there than its 2:4 paths): a bf16 copy of the "
                f"weight in {count} layer(s), {extra / 2**20:.1f} MiB extra")

    def _decode_entry(self, mod: nn.Module, numerics: str, chosen: dict[str, dict],
                      plan: Callable[[], dict], fresh: Callable[[dict], bool]
                      ) -> tuple[str, dict, bool]:
        """(key, entry, whether this call made it) of the decode plan of ``mod``'s shape with
        ``numerics``: the one ``chosen`` earlier in this call, else the cached one where
        ``fresh(entry)`` and it was timed as :data:`DECODE_TIMING` says, else ``plan()``
        (then cached)."""
        key = plan_key(self.name, torch.__version__, numerics, mod.out_features,
                       mod.in_features, 0, inductor=self.inductor)
        if key in chosen:
            return key, chosen[key], False
        hit = self.cache.get(key)
        if hit is None or hit.get("timing") != DECODE_TIMING or not fresh(hit):
            hit = {**plan(), "timing": DECODE_TIMING}
        chosen[key] = self.cache[key] = self.new[key] = hit
        return key, hit, True

    def _plan_int4_configs(self, model: nn.Module, chosen: dict[str, dict]) -> None:
        """The mma.sp kernel's int4 configurations per int4 2:4 layer shape and token bucket
        (:func:`plan_int4_config`, cached like the other decode plans), set on each layer; a
        note where int4 2:4 layers decode on the Triton kernel because the mma.sp int4 format
        does not take their shape or group (int4_weight_g64, _g32, or K not a multiple of 128)."""
        off = {(m.out_features, m.in_features, m.group_size) for m in model.modules()
               if getattr(m, "variant", "") == "int4_2:4" and m.mvalues is None
               and sk24_mma.check_int4(m.out_features, m.in_features, m.group_size)}
        if off and not sk24_mma.reason():
            shapes = ", ".join(f"{n}x{k} g{g}" for n, k, g in sorted(off))
            self.report.notes.append(
                f"decode: int4 2:4 layers {shapes} run the Triton kernel (the mma.sp int4 "
                f"kernel takes K and the group in multiples of {sk24_mma.INT4_COLUMNS})")
        for mod in model.modules():
            if getattr(mod, "mvalues", None) is None:
                continue
            _, entry, new = self._decode_entry(
                mod, f"{mod.variant}|decode|int4_mma|g{mod.group_size}", chosen,
                functools.partial(plan_int4_config, mod, self.device),
                fresh=lambda e: "config" in e)
            config = entry["config"]
            if new and config:
                self.report.notes.append(
                    f"decode: {mod.variant} {mod.out_features}x{mod.in_features} on the "
                    f"mma.sp int4 kernel ({sk24_mma.config_text(config)})")
            mod.dconfig = valid_mma_config(config, mod.mvalues) if config else None


def dense_range(us: dict[str, list[float]], decode_max_m: int) -> tuple[int, int]:
    """(lo, hi): the token counts M (lo <= M <= hi) a layer runs bf16 dense, from
    :func:`time_decode`'s timings ``us`` ({M: [small-M, large-M, bf16 dense]}, M in
    ``DECODE_BUCKETS``): from above the bucket before the first one where dense beats the path
    the layer runs there otherwise (the small-M kernel up to ``decode_max_m``, the large-M path
    above) up to the last such bucket; buckets between them run dense too (never slower than
    dense). (0, 0): none. A bucket's time stands for the counts above the bucket before it, as
    with ``decode_max_m``. Pure."""
    wins = [m for m in DECODE_BUCKETS if str(m) in us and len(us[str(m)]) > 2
            and us[str(m)][2] < us[str(m)][0 if m <= decode_max_m else 1]]
    if not wins:
        return 0, 0
    first = DECODE_BUCKETS.index(wins[0])
    return (DECODE_BUCKETS[first - 1] + 1 if first else 1), wins[-1]


def route_decode(mod: nn.Module, entry: dict, dense: bool) -> None:
    """Set 2:4 layer ``mod``'s small-M limit and (``dense``) its bf16 dense route from a decode
    plan ``entry`` (:func:`time_decode`'s, maybe read from the cache); the small-M format's
    copy of the weight goes where no token count is left to it."""
    if entry.get("kernel") in ("mma", "triton") and getattr(mod, "dchoice", False):
        mod.use_decode_kernel(entry["kernel"])
    mod.decode_max_m = int(entry["decode_max_m"])
    if entry.get("config") and getattr(mod, "dkernel", "").startswith("mma"):
        mod.dconfig = valid_mma_config(entry["config"], mod.dvalues,
                                       getattr(mod, "dwide", None))
    lo, hi = entry.get("dense_m", (0, 0)) if dense else (0, 0)
    mod.keep_dense(lo, hi)
    if mod.dense_weight is not None and lo <= 1 and mod.decode_max_m <= hi:
        mod.decode_max_m = 0  # every count of the small-M kernel runs dense
    if mod.decode_max_m == 0:
        mod.dvalues = mod.dmeta = None
        mod.dkernel = ""


def time_decode(mod: nn.Module, device: torch.device, dense: bool = False) -> dict:
    """{"decode_max_m": the last of DECODE_BUCKETS up to which ``mod``'s small-M kernel beats its
    large-M path, "us": {M: [small-M us, large-M us, bf16 dense us]}} (timed in CUDA graphs
    with the weights read from memory, not the L2, as in a decode step:
    :func:`~sparsekit.nn.timing.cold_time_us`; dense: ``F.linear`` on a bf16 weight of the
    layer's shape, the baseline a decode step is compared with). Timing stops at the first M
    where the small-M kernel loses, unless ``dense``: then every bucket is timed and the entry
    has "dense_m" too (:func:`dense_range`, a list [lo, hi])."""
    from sparsekit.nn import timing  # looked up per call: tests replace cold_time_us

    dense_w = torch.randn(mod.out_features, mod.in_features, device=device,
                          dtype=torch.bfloat16)
    config = choose_mma_config(mod, device) if mod.dkernel.startswith("mma") else None
    limit, us, losing = 0, {}, False
    for m in DECODE_BUCKETS:
        x = torch.randn(m, mod.in_features, device=device, dtype=torch.bfloat16)
        times = []
        for max_m in (m, 0):
            mod.decode_max_m = max_m
            times.append(timing.cold_time_us(functools.partial(mod, x)))
        times.append(timing.cold_time_us(functools.partial(F.linear, x, dense_w)))
        us[str(m)] = times
        losing = losing or times[0] >= times[1]
        if losing and not dense:
            break
        if not losing:
            limit = m
    entry = {"decode_max_m": limit, "us": us}
    if config is not None:
        entry["config"] = [list(c) for c in config]
    if dense:
        entry["dense_m"] = list(dense_range(us, limit))
    return entry


def decode_cost_us(entry: dict, buckets) -> float:
    """What a layer planned by ``entry`` (:func:`time_decode`'s) takes over ``buckets`` (token
    counts it timed): at each, the small-M kernel's time up to its ``decode_max_m``, the
    large-M path's above. Pure."""
    limit = int(entry["decode_max_m"])
    return sum(entry["us"][str(m)][0 if m <= limit else 1] for m in buckets)


def time_decode_choice(mod: nn.Module, device: torch.device, dense: bool = False) -> dict:
    """:func:`time_decode` of an fp8 layer that either small-M kernel takes (``dchoice``): once
    on the Triton kernel and once on the mma.sp kernel (its configurations chosen), keeping the
    one whose path costs less over the token counts both timed (:func:`decode_cost_us`; a tie
    keeps Triton). The entry says which ("kernel") and has both kernels' timings
    ("kernels_us"); ``mod`` is left on the chosen kernel."""
    mod.use_decode_kernel("triton")
    entries = {"triton": time_decode(mod, device, dense=dense)}
    mod.use_decode_kernel("mma")
    entries["mma"] = time_decode(mod, device, dense=dense)
    common = [m for m in DECODE_BUCKETS
              if str(m) in entries["triton"]["us"] and str(m) in entries["mma"]["us"]]
    cost = {k: decode_cost_us(e, common) for k, e in entries.items()}
    kernel = "mma" if cost["mma"] < cost["triton"] else "triton"
    mod.use_decode_kernel(kernel)
    return {**entries[kernel], "kernel": kernel,
            "kernels_us": {k: e["us"] for k, e in entries.items()}}


def choose_mma_config(mod: nn.Module, device: torch.device, values: torch.Tensor | None = None
                      ) -> tuple[tuple[int, ...], ...] | None:
    """Per bucket of ``sk24_mma.BUCKETS`` (M = 1, 2..8, 9..16, 17..32), the mma.sp kernel
    configuration with the least time at the bucket's largest M for ``mod``'s shape (CUDA
    graphs, the weight read from memory: :func:`~sparsekit.nn.timing.cold_time_us`), set on
    ``mod`` (``dconfig``) and returned; None when there is one candidate or none. ``values``:
    the weight in the kernel's format (default ``mod.dvalues``; an int4 2:4 layer's
    ``mvalues``: the int4 way's configurations)."""
    from sparsekit.accel.kernels.mma_sp import launch as sk24_mma
    from sparsekit.nn import timing  # looked up per call: tests replace cold_time_us

    values = mod.dvalues if values is None else values
    cands = sk24_mma.candidates(values, getattr(mod, "dwide", None))
    if len(cands) < 2:
        return None
    saved = getattr(mod, "decode_max_m", None)  # int4 layers decode up to w4a16.MAX_M always
    if saved is not None:
        mod.decode_max_m = max(sk24_mma.BUCKETS)
    chosen = []
    for m in sk24_mma.BUCKETS:
        x = torch.randn(m, mod.in_features, device=device, dtype=torch.bfloat16)
        best = None
        for cfg in cands:
            mod.dconfig = (cfg,) * len(sk24_mma.BUCKETS)
            t = timing.cold_time_us(functools.partial(mod, x))
            if best is None or t < best[1]:
                best = (cfg, t)
        chosen.append(best[0])
    if saved is not None:
        mod.decode_max_m = saved
    mod.dconfig = tuple(chosen)
    return mod.dconfig


def plan_int4_config(mod: nn.Module, device: torch.device) -> dict:
    """The decode plan entry of an int4 2:4 layer on the mma.sp kernel's int4 way:
    {"config": one configuration per ``sk24_mma.BUCKETS`` (:func:`choose_mma_config` on its
    ``mvalues``), or None where there is one candidate}; ``mod.dconfig`` is set."""
    config = choose_mma_config(mod, device, mod.mvalues)
    return {"config": None if config is None else [list(c) for c in config]}


def valid_mma_config(config, values: torch.Tensor, wide: torch.dtype | None = None
                     ) -> tuple[tuple[int, ...], ...] | None:
    """A decode plan's "config" (one configuration per ``sk24_mma.BUCKETS``) as ``dconfig``
    when every one is among the candidates for ``values``, else None (a plan from another
    version of the library: the defaults run)."""
    from sparsekit.accel.kernels.mma_sp import launch as sk24_mma

    if not isinstance(config, (list, tuple)) or len(config) != len(sk24_mma.BUCKETS):
        return None
    cands = set(sk24_mma.candidates(values, wide))
    got = tuple(tuple(c) if isinstance(c, (list, tuple)) else None for c in config)
    return got if all(c in cands for c in got) else None


def decode_note(mod: nn.Module, entry: dict) -> str:
    """The report's line for one decode plan: the limit, the timings per M and the token counts
    where neither 2:4 path beats bf16 dense (a decode step there is slower than dense)."""
    times = entry["us"]
    slower = [m for m, t in times.items() if len(t) > 2 and min(t[:2]) > t[2]]
    from sparsekit.accel.kernels.mma_sp import launch as sk24_mma

    kernel = (f" ({getattr(mod, 'dkernel', '')}"
              + (f" {sk24_mma.config_text(entry['config'])}" if entry.get("config") else "")
              + ")") if getattr(mod, "dkernel", "") else ""
    both = entry.get("kernels_us") or {}
    chose = ""
    if len(both) == 2 and entry.get("kernel") in both:
        other = next(k for k in both if k != entry["kernel"])
        chose = (f"; {entry['kernel']} chosen over {other} (small-M us: "
                 + ", ".join(f"M={m} {t[0]:.1f} vs {both[other][m][0]:.1f}"
                             for m, t in both[entry["kernel"]].items() if m in both[other])
                 + ")")
    return (f"decode: {mod.variant} {mod.out_features}x{mod.in_features} on the small-M "
            f"kernel{kernel} for M <= {entry['decode_max_m']} (us small-M/large-M/bf16 dense: "
            + ", ".join(f"M={m} " + "/".join(f"{u:.1f}" for u in t) for m, t in times.items())
            + ")" + (f"; slower than bf16 dense at M = {', '.join(slower)}" if slower else "")
            + chose)


def _shell_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules sharing its parameters and buffers (no tensor copied)."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _reset_compiled() -> None:
    """Drop what torch.compile holds (code caches, CUDA-graph trees and their memory)."""
    _compat.reset_compiled()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = ["CONFIRM_BELOW", "CONFIRM_ROUNDS", "DECODE_BUCKETS", "DECODE_TOKENS",
           "MIN_REPEATED_BLOCKS", "PLAN_BLOCKS_TIMED", "PLAN_MARGIN", "SHORTEN_MIN_BYTES",
           "PlannedLayer", "Planner", "cache_path", "choose", "choose_mma_config", "choose_plan",
           "decode_cost_us", "decode_note", "dense_range", "extrapolate_ms", "layer_plan", "load",
           "model_key", "own_precision", "plan_int4_config", "plan_key", "repeated_blocks",
           "route_decode", "store", "time_decode", "time_decode_choice", "time_model_ms",
           "time_module", "time_paired", "truncated", "valid_mma_config", "weight_bytes",
           "whole_model_plans"]
