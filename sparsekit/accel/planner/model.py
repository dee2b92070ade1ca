"""The whole model: which plans to time (:func:`whole_model_plans`), the pure choice among
their times (:func:`choose_plan`), a close call confirmed alternating with dense
(:func:`time_paired`), a big model of repeated blocks timed on a few of them and extrapolated
(:func:`repeated_blocks`, :func:`truncated`, :func:`extrapolate_ms`), and the
:class:`Planner`'s part that installs, compiles and times each plan (:class:`WholeModel`).

A layer timed alone misjudges the model: alone, an 8-bit layer's activation quantization reads
its input from memory, inside the model it is fused into the norm or activation that produces
it (on the 8B-shaped Llama the per-layer choice picked bf16 2:4 for 40 of 56 layers and ran at
1.18x where fp8 2:4 everywhere ran at 1.44x). So on CUDA ``accelerate`` compares a few
WHOLE-MODEL plans, each compiled and run as it will run, and keeps the fastest; the choice and
the plans' times are cached under a key of the model's layer shapes, input shapes and options
(:func:`~sparsekit.accel.planner.cache.model_key`).
"""

from __future__ import annotations

import copy
import functools
import gc
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sparsekit import _compat
from sparsekit.accel.layers import variant_name
from sparsekit.accel.model import AcceleratedModel
from sparsekit.accel.planner.cache import model_key
from sparsekit.accel.planner.layer import DECODE_TOKENS
from sparsekit.accel.report import AccelReport
from sparsekit.nn.calibration import feed, tree_map
from sparsekit.nn.timing import flush_l2, time_ms

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



class WholeModel:
    """The :class:`~sparsekit.accel.planner.Planner`'s whole-model planning (on CUDA, under
    ``sparsity="auto"``): time a few whole-model plans as they will run and keep the
    fastest."""

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


__all__ = ["CONFIRM_BELOW", "CONFIRM_ROUNDS", "MIN_REPEATED_BLOCKS", "PLAN_BLOCKS_TIMED",
           "PLAN_MARGIN", "SHORTEN_MIN_BYTES", "WholeModel", "choose_plan", "extrapolate_ms",
           "repeated_blocks", "time_model_ms", "time_paired", "truncated", "weight_bytes",
           "whole_model_plans"]
