"""All of ``accelerate``'s planning: which variant each linear layer runs and which kernels run
it. :class:`Planner` holds one model's plan: each layer's candidates (:func:`layer_plan`) and
choice, a :class:`PlannedLayer` per layer it may replace, the variant modules it builds,
sibling fusion, and each layer's plan of kernels per token count (:meth:`Planner.plan_decode`).
The parts, none naming a kernel (they iterate :mod:`sparsekit.accel.kernels`):

- :mod:`.layer`: per layer: candidates, the pure choice on timings, timing one candidate;
- :mod:`.model`: the whole model: a few whole-model plans timed as they will run;
- :mod:`.decode`: each layer's small-M kernel, its limit, configurations, dense route;
- :mod:`.cache`: timings and choices on disk.

With ``sparsity="auto"`` the planner is speed-aware: per GEMM shape, time each candidate
variant as it will run (:func:`time_module`), keep the fastest (:func:`choose`, tested on
recorded H200 timings), and remember the timings on disk. 2:4 candidates are timed with their
best cuSPARSELt algorithm (:mod:`sparsekit.accel.algsearch`). On CPU (reference ops) the same
candidates are timed by wall clock, so the code path is the same everywhere; only CUDA
timings mean anything for speed. Then on CUDA ``accelerate`` compares a few whole-model plans
(:class:`.model.WholeModel`) and plans decode (:class:`.decode.Decode`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from sparsekit.accel import algsearch, kernels
from sparsekit.accel import siblings as siblings_
from sparsekit.accel.layers import VARIANTS, variant_name
from sparsekit.accel.linear import AccelLinear
from sparsekit.accel.options import CompileOptions, PlanOptions
from sparsekit.accel.planner.cache import cache_path, load, model_key, plan_key, store
from sparsekit.accel.planner.decode import (DECODE_BUCKETS, DECODE_TIMING, Decode,
                                            choose_config, decode_cost_us, decode_note,
                                            dense_range, plan_config, route_decode,
                                            time_decode, time_decode_choices)
from sparsekit.accel.planner.layer import (DECODE_MARGIN, DECODE_TOKENS, PlannedLayer, choose,
                                           layer_plan, own_precision, time_module)
from sparsekit.accel.planner.layer import _ALIGN
from sparsekit.accel.planner.model import (CONFIRM_BELOW, CONFIRM_ROUNDS, MIN_REPEATED_BLOCKS,
                                           PLAN_BLOCKS_TIMED, PLAN_MARGIN, SHORTEN_MIN_BYTES,
                                           WholeModel, choose_plan, extrapolate_ms,
                                           repeated_blocks, time_model_ms, time_paired,
                                           truncated, weight_bytes, whole_model_plans)
from sparsekit.accel.report import BASELINE, AccelReport, LayerDecision
from sparsekit.quant.modules import QuantLinear


class Planner(WholeModel, Decode):
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
        """Record the cuSPARSELt algorithm each installed layer uses, plan the small-M kernels'
        routes (:meth:`plan_decode`), add each kernel's note on the layers it runs and each
        layer's plan and weight bytes to the report, save the cache."""
        installed = {name: model.get_submodule(name) for name in self.layers}
        for name, planned in self.layers.items():
            mod = installed[name]
            if getattr(mod, "uses_alg", False):
                planned.decision.alg_ids[planned.decision.variant] = mod.alg_id
        self.plan_decode(model)
        accel = [m for m in model.modules() if isinstance(m, AccelLinear)]
        for kernel in kernels.kernels():
            note = kernel.note([m for m in accel if kernel.name in m.plan.kernels()])
            if note:
                self.report.notes.append(note)
        for name, planned in self.layers.items():
            mod, d = installed[name], planned.decision
            mod = getattr(mod, "group", mod)  # a sibling group's slice: the group's layer
            if isinstance(mod, AccelLinear):
                d.plan, d.weight_bytes = mod.plan.text(), mod.weight_bytes()
            elif isinstance(mod, nn.Linear):  # a float layer kept as it is (cuBLAS)
                d.plan = "M 1+: the float layer (F.linear)"
                d.weight_bytes = mod.weight.numel() * mod.weight.element_size()
        self.save()


__all__ = ["CONFIRM_BELOW", "CONFIRM_ROUNDS", "DECODE_BUCKETS", "DECODE_MARGIN", "DECODE_TIMING",
           "DECODE_TOKENS", "MIN_REPEATED_BLOCKS", "PLAN_BLOCKS_TIMED", "PLAN_MARGIN",
           "SHORTEN_MIN_BYTES", "PlannedLayer", "Planner", "cache_path", "choose",
           "choose_config", "choose_plan", "decode_cost_us", "decode_note", "dense_range",
           "extrapolate_ms", "layer_plan", "load", "model_key", "own_precision", "plan_config",
           "plan_key", "repeated_blocks", "route_decode", "store", "time_decode",
           "time_decode_choices", "time_model_ms", "time_module", "time_paired", "truncated",
           "weight_bytes", "whole_model_plans"]
