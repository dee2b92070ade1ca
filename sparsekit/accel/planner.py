"""The speed-aware planner behind ``sparsity="auto"``: per GEMM shape, time each candidate
variant as it will run, keep the fastest, and remember the timings on disk.

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

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from sparsekit import _compat
from sparsekit.io.files import atomic_write
from sparsekit.accel.report import BASELINE, decide
from sparsekit.io.cache import cache_root
from sparsekit.nn.timing import flush_l2, graph_time_us, time_ms

DECODE_TOKENS = 64  # M at or below this is decode-sized: 2:4 often loses there (docs/gpu.md)
DECODE_MARGIN = 1.05  # ... so there a 2:4 variant must beat the best dense one by 5%


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
    from sparsekit.accel.kernels import variant_name

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
# another run 1.058x timed, 1.007x alternating; docs/bench/JOURNAL.md)
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


__all__ = ["CONFIRM_BELOW", "CONFIRM_ROUNDS", "DECODE_TOKENS", "MIN_REPEATED_BLOCKS",
           "PLAN_BLOCKS_TIMED", "PLAN_MARGIN", "SHORTEN_MIN_BYTES", "cache_path", "choose",
           "choose_plan", "extrapolate_ms", "load", "model_key", "plan_key", "repeated_blocks",
           "store", "time_model_ms", "time_module", "time_paired", "truncated", "weight_bytes",
           "whole_model_plans"]
