"""``accelerate``: a finalized (2:4-zeroed, optionally quantized) model with its linear layers on
sparse / low-precision kernels (``sparsekit::`` custom ops), the whole model compiled.

The default path: layers swapped for :mod:`sparsekit.accel.kernels` modules, then the model
through ``torch.compile``: inductor fuses the norms, rotary, SiLU*mul, residual adds, the
per-token activation quantization and the 8-bit scale epilogues around the GEMMs, and CUDA
graphs remove the host work (cuSPARSELt builds its plan on every call, 0.5-0.9 ms of host time,
which graph replay skips): sparsekit's own graph per input signature
(:mod:`sparsekit.accel.graphs`, which also skips dynamo's per-call guard check), or
``mode="reduce-overhead"`` where those cannot be captured. On CPU the same modules run the
ops' plain-torch references (``device="cpu"``): the model structure, the traced graph and the
numerics are the GPU's, the speed is not.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from sparsekit import _compat
from sparsekit.accel import algsearch, cslt_ext, graphs, planner
from sparsekit.accel import siblings as siblings_
from sparsekit.accel.epilogue import FuseGelu, uses_alpha_path
from sparsekit.accel.convert import ConvAsLinear, conv_skip_reason, split_attention_
from sparsekit.accel.kernels import SPARSITIES, VARIANTS, check_precision, variant_name
from sparsekit.accel.report import BASELINE, AccelReport, LayerDecision
from sparsekit.quant.formats import get_scheme
from sparsekit.quant.modules import QuantLinear
from sparsekit.nn.calibration import feed, tree_map
from sparsekit.prune.patterns import is_nm
from sparsekit.nn.select import name_filter

log = logging.getLogger(__name__)

_ALIGN = 32  # in/out features the 8-bit and 2:4 kernels take (cuSPARSELt, _scaled_mm, _int_mm)


def _own_precision(layer: nn.Module) -> str | None:
    """The accel precision that keeps a W8A8 ``QuantLinear``'s numerics (its activation format:
    "fp8" for fp8 and fp8_static, "int8" for int8 and int8_static); None for other layers."""
    if not isinstance(layer, QuantLinear):
        return None
    act = get_scheme(layer.scheme).activation
    return None if act is None else act.name




class AcceleratedModel(nn.Module):
    """The accelerated model: ``model`` (its linears replaced by kernel modules) run through
    ``torch.compile`` (or eagerly with ``compile=False``). Floating inputs are cast to
    bfloat16 and moved to the model's device. Outputs keep their types (HF ``ModelOutput``,
    tuples, dataclasses).

    ``sparsekit_report`` (also ``report``) is the :class:`AccelReport`; ``report.compiles``
    counts the graphs the compiler built so far (a new input shape may add one; torch's
    ``torch._dynamo.config.recompile_limit`` bounds them, after which the frame runs eagerly).
    ``clone_outputs``: under CUDA graphs an output lives in the graph's memory until the next
    call; cloning hands out tensors of your own (turn it off when you consume each output
    before the next call). ``capture`` (CUDA only): the model compiled in mode "default" and
    replayed as sparsekit's own CUDA graphs (``graphs``, a
    :class:`~sparsekit.accel.graphs.GraphCache`); a call that cannot be captured switches the
    model to ``mode="reduce-overhead"`` for good, with a note in the report."""

    _sparsekit_accelerated = True

    def __init__(self, model: nn.Module, report: AccelReport, device: torch.device, *,
                 compile: bool = True, mode: str | None = None, dynamic: bool | None = None,
                 backend: str = "inductor", inductor: dict | None = None,
                 clone_outputs: bool = True, max_compiles: int = 8, capture: bool = False):
        super().__init__()
        self.model = model
        self.sparsekit_report = report
        self.device = device
        self.clone_outputs = clone_outputs
        self.max_compiles = max_compiles
        self.fuse_gelu: FuseGelu | None = None
        self._compile_args = dict(dynamic=dynamic, backend=backend, inductor=inductor)
        capture = capture and compile and device.type == "cuda"
        if compile:
            if mode is None:
                mode = "default" if capture or device.type != "cuda" else "reduce-overhead"
            runner = self._compile(mode)
        else:
            runner = model
        self.compiled = compile
        # kept out of the module tree: the model's tensors are listed once, under ``model.``
        self.__dict__["runner"] = runner
        self.__dict__["graphs"] = graphs.GraphCache(runner) if capture else None

    def _compile(self, mode: str) -> Callable:
        """The model through ``torch.compile`` in ``mode`` (with sparsekit's GELU pass where
        its layers can take it)."""
        dynamic, backend, inductor = (self._compile_args[k] for k in
                                      ("dynamic", "backend", "inductor"))
        if backend == "inductor" and uses_alpha_path(self.model) and \
                "pre_grad_custom_pass" not in (inductor or {}):
            # GELU into the epilogue of the GEMMs on sparsekit's binding
            if self.fuse_gelu is None:
                self.fuse_gelu = FuseGelu()
            inductor = {**(inductor or {}), "pre_grad_custom_pass": self.fuse_gelu}
        return _compat.compile_module(self.model, mode=mode, dynamic=dynamic, backend=backend,
                                      options=inductor)

    @property
    def report(self) -> AccelReport:
        return self.sparsekit_report

    @property
    def capture(self) -> bool:
        """Whether calls run on sparsekit's own CUDA graphs now (False after a fallback to
        reduce-overhead)."""
        return self.graphs is not None

    def forward(self, *args, **kwargs):
        args, kwargs = tree_map(self._as_input, (args, kwargs))
        with torch.no_grad():
            out = self._captured(args, kwargs) if self.graphs is not None else None
            if out is None:
                before = _compat.compiled_graph_count() if self.compiled else 0
                out = self.runner(*args, **kwargs)
                if self.compiled:
                    self._count(_compat.compiled_graph_count() - before)
        if self.clone_outputs and self.device.type == "cuda":
            out = tree_map(torch.clone, out)
        return out

    def _captured(self, args: tuple, kwargs: dict) -> Any:
        """The output of the call's captured CUDA graph (captured now if its signature is new),
        or None: the model is then recompiled with ``mode="reduce-overhead"``, once, and this
        and every later call runs that (the report says why)."""
        cache = self.graphs
        before = cache.compiled
        out = cache.run(args, kwargs)
        self._count(cache.compiled - before)
        if out is not None:
            return out
        self.report.notes.append(f"own CUDA graphs off ({cache.why}): torch.compile's "
                                 f"reduce-overhead mode replays the model instead")
        self.__dict__["graphs"] = None
        self.__dict__["runner"] = self._compile("reduce-overhead")
        return None

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int | None = None, **kwargs: Any) -> torch.Tensor:
        """Hugging Face ``generate`` on the accelerated causal LM (greedy, or sampling with
        ``do_sample=True`` and HF's other sampling options): the prompt runs on the large-M
        (prefill) kernels, each new token on the small-M (decode) kernels, both compiled (CUDA
        graphs on CUDA) over a static KV cache kept by sparsekit. Prompts are left-padded to a
        bucket (the next power of two, at least 16), so prompt lengths in one bucket share one
        compiled graph (:mod:`sparsekit.accel.generate`). Returns the sequences, prompt
        included, as ``model.generate`` does; ``report.compiles`` counts the graphs built.

        >>> ids = fast.generate(input_ids, max_new_tokens=8)  # doctest: +SKIP
        """
        gen = self.__dict__.get("generator")
        if gen is None:
            from sparsekit.accel.generate import Generator
            gen = Generator(self.model, self.device, compile=self.compiled,
                            backend=self._compile_args["backend"], count=self._count,
                            notes=self.report.notes)
            self.__dict__["generator"] = gen
        return gen.generate(input_ids, attention_mask, max_new_tokens, **kwargs)

    def _count(self, new: int) -> None:
        """Add ``new`` compiled graphs to the report (a warning past ``max_compiles``)."""
        if new:
            self.report.compiles += new
            if self.report.compiles > self.max_compiles:
                log.warning("sk.accelerate: the model was compiled %d times (input shapes "
                            "vary); pass dynamic=True or fixed shapes", self.report.compiles)

    def _as_input(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        return t.to(torch.bfloat16) if t.is_floating_point() else t


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


def _convert(model: nn.Module, keep: Callable[[str], bool], report: AccelReport) -> None:
    """Replace convertible MultiheadAttention and convs over non-overlapping patches (1x1,
    patch embeddings) by Linears (skip reasons into the report)."""
    report.skipped.update(split_attention_(model, keep))
    for name, module in list(model.named_modules()):
        if name and keep(name) and isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            reason = conv_skip_reason(module)
            if reason:
                report.skipped[name] = reason
            else:
                model.set_submodule(name, ConvAsLinear(module))


def _weight_24(layer: nn.Module) -> bool:
    w = layer.weight if not isinstance(layer, QuantLinear) else layer.weight.float()
    return is_nm(w.detach(), 2, 4)


class _Planner:
    """Builds variant modules for layers, with alg search and cached timings (auto)."""

    def __init__(self, device: torch.device, search_algs: bool, use_cache: bool,
                 fused_quant: bool, backend: str, inductor: dict | None = None):
        self.device, self.search_algs, self.use_cache = device, search_algs, use_cache
        self.fused_quant, self.backend, self.inductor = fused_quant, backend, inductor or {}
        self.algs: dict[tuple, int] = {}
        self.cache = planner.load() if use_cache else {}
        self.new: dict[str, dict] = {}
        self.name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    def build(self, variant: str, layer: nn.Module, m: int) -> nn.Module:
        cls = VARIANTS[variant]
        # a layer's scheme picks its kernel route (per-tensor fp8: sparsekit's binding)
        key = (variant, layer.out_features, layer.in_features, m, getattr(layer, "scheme", None))
        if cls.uses_alg and self.device.type == "cuda" and self.search_algs:
            if key not in self.algs:
                hit = self.cache.get(self._key(variant, layer, m), {})
                if "alg_id" in hit:
                    self.algs[key] = int(hit["alg_id"])
                else:
                    mod, self.algs[key], _ = algsearch.search(variant, layer, m,
                                                              use_cache=self.use_cache)
                    mod.fused_quant = self.fused_quant
                    return mod
        return cls(layer, alg_id=self.algs.get(key, 0), fused_quant=self.fused_quant)

    def _key(self, variant: str, layer: nn.Module, m: int) -> str:
        # a static-scheme layer quantizes its input elementwise: another cost than per token
        numerics = f"{variant}|{layer.scheme}" if isinstance(layer, QuantLinear) else variant
        return planner.plan_key(self.name, torch.__version__, numerics, layer.out_features,
                                layer.in_features, m, inductor=self.inductor)

    def time(self, variant: str, layer: nn.Module, m: int) -> float:
        """Microseconds of ``variant`` for ``layer`` at ``m`` tokens, compiled (cached)."""
        key = self._key(variant, layer, m)
        hit = self.cache.get(key)
        if hit is not None and "us" in hit:
            return float(hit["us"])
        mod = self.build(variant, layer, m)
        x = torch.randn(m, layer.in_features, device=self.device, dtype=torch.bfloat16)
        us = planner.time_module(mod, x, self.backend, self.inductor)
        entry = {"us": us}
        if mod.uses_alg:
            entry["alg_id"] = mod.alg_id
        self.cache[key] = self.new[key] = entry
        return us

    def save(self) -> None:
        if self.use_cache and self.new:
            planner.store(self.new)


def _signature(model: nn.Module, inputs: Any, chosen: dict, options: dict) -> str:
    """A hash of everything a whole-model decision depends on (see planner.model_key)."""
    import hashlib
    import json

    shapes = []
    tree_map(lambda t: shapes.append([list(t.shape), str(t.dtype)]) or t, inputs)
    layers = [[n, d.out_features, d.in_features, d.tokens, d.has_2to4, c, d.variant,
               getattr(layer, "scheme", None)] for n, (layer, _, c, d) in chosen.items()]
    blob = json.dumps([type(model).__name__, shapes, layers, options], sort_keys=True,
                      default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:20]


def _reset_compiled() -> None:
    """Drop what torch.compile holds (code caches, CUDA-graph trees and their memory)."""
    _compat.reset_compiled()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _plan_whole_model(model: nn.Module, inputs: Any, chosen: dict, install, plan: "_Planner",
                      report: AccelReport, precision: str, min_speedup: float,
                      options: dict) -> None:
    """Time a few whole-model plans as they will run and set each decision to the best one's
    variant (planner.whole_model_plans / choose_plan; cached on disk)."""
    t0 = time.perf_counter()
    layers = {n: (c, d.variant) for n, (_, _, c, d) in chosen.items()}
    decode = all(d.tokens <= planner.DECODE_TOKENS for _, _, _, d in chosen.values())
    plans = planner.whole_model_plans(layers, precision, decode)
    key = planner.model_key(plan.name, torch.__version__,
                            _signature(model, inputs, chosen,
                                       {**options, "precision": precision,
                                        "min_speedup": min_speedup,
                                        "plan_blocks": planner.PLAN_BLOCKS_TIMED,
                                        "plan_cold_l2": True,
                                        "plan_confirm": [planner.CONFIRM_BELOW,
                                                         planner.PLAN_MARGIN],
                                        "shorten_min_bytes": planner.SHORTEN_MIN_BYTES,
                                        # decisions of the planner that extrapolated decode
                                        # steps from a few blocks are not reused
                                        "decode_timed_whole": True}))
    hit = plan.cache.get(key, {})
    if hit.get("plan") in plans and "ms" in hit:
        ms, best = {k: float(v) for k, v in hit["ms"].items()}, hit["plan"]
        why = hit.get("why", f"whole model: plan {best} (cached)") + " (cached)"
        confirm = hit.get("confirm_ms")
    else:
        ms = {}
        big = planner.weight_bytes(model) >= planner.SHORTEN_MIN_BYTES
        # a decode-sized step is timed whole: on the H200 1 and 5 of a 32-layer Llama's blocks
        # put its attention-bound decode step 20% off both ways, and "auto" chose a 2:4 plan
        # running at 0.77x; a step costs milliseconds, compiles are what planning a whole
        # model costs
        blocks = planner.repeated_blocks(model, plans) if big and not decode else None
        if big and decode:
            report.notes.append("decode-sized input: whole-model plans timed on the whole "
                                "model, not extrapolated from a few blocks")
        for pname, assign in plans.items():
            install(assign)
            if pname == "dense" and blocks is not None:
                try:  # a model whose forward needs all its blocks: time it whole
                    ms[pname] = _time_plan(model, inputs, blocks, plan, report, options)
                    continue
                except Exception as e:  # noqa: BLE001  (any failure of the shortened model)
                    report.notes.append(f"the model did not run with {blocks[0]} shortened "
                                        f"({type(e).__name__}: {str(e).splitlines()[0][:100]}"
                                        "): plans timed on the whole model")
                    blocks = None
            try:
                ms[pname] = _time_plan(model, inputs, blocks, plan, report, options)
            except RuntimeError as e:
                if pname == "dense":
                    raise
                report.notes.append(f"whole-model plan {pname} did not run: "
                                    f"{str(e).splitlines()[0][:120]}")
        if blocks is not None:
            k1, k2 = planner.PLAN_BLOCKS_TIMED
            report.notes.append(f"whole-model plans timed with {k1} and {k2} of the "
                                f"{len(blocks[1])} blocks of {blocks[0]}, extrapolated "
                                f"linearly to all of them")
        best, why = planner.choose_plan(ms, min_speedup)
        entry = {"plan": best, "why": why, "ms": ms}
        if best != "dense" and blocks is None and ms["dense"] / ms[best] < planner.CONFIRM_BELOW:
            best, why, entry["confirm_ms"] = _confirm_plan(model, inputs, chosen, plans, best,
                                                           plan, report, options, min_speedup)
            entry.update(plan=best, why=why)
        confirm = entry.get("confirm_ms")
        plan.cache[key] = plan.new[key] = entry
    report.seconds["plan_model"] = time.perf_counter() - t0
    report.plans_ms = dict(ms)
    report.plan = best
    src = confirm or ms  # the alternating times where there are any
    report.model_us = {"dense": src["dense"] * 1e3, "accelerated": src.get(best, ms[best]) * 1e3}
    same = [p for p in plans if p != best and plans[p] == plans[best]]
    report.notes.append(why + "; plans timed (ms): " +
                        ", ".join(f"{p} {t:.3f}" for p, t in ms.items()) +
                        (f"; {best} = {', '.join(same)}" if same else "") +
                        ("; timed alternating (ms): " + ", ".join(f"{p} {t:.3f}" for p, t in
                                                                confirm.items())
                         if confirm else ""))
    for name, variant in plans[best].items():
        d = chosen[name][3]
        if variant != d.variant:
            d.reason += f"; per-layer choice {d.variant} overridden by whole-model plan {best}"
            d.variant = variant
        else:
            d.reason += f"; whole-model plan {best}"


def _installer(model: nn.Module, chosen: dict, plan: "_Planner"):
    """A function putting variants in place, ``{layer name: variant}`` (bf16 dense keeps a
    float Linear as it is: cuBLAS)."""
    def install(assign: dict[str, str]) -> None:
        for name, variant in assign.items():
            layer, m, _, _ = chosen[name]
            if variant == BASELINE and not isinstance(layer, QuantLinear):
                model.set_submodule(name, layer)
            else:
                model.set_submodule(name, plan.build(variant, layer, m))
    return install


def _plan_runner(model: nn.Module, report: AccelReport, plan: "_Planner",
                 options: dict) -> AcceleratedModel:
    """``model`` as one plan of it will run: wrapped and compiled as accelerate's result."""
    return AcceleratedModel(model, AccelReport(report.precision, "auto", report.min_speedup,
                                               report.device), plan.device,
                            compile=options["compile"], mode=options["mode"],
                            dynamic=options["dynamic"], backend=options["backend"],
                            inductor=options["inductor"], clone_outputs=False,
                            capture=options["capture"])


def _shell_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules sharing its parameters and buffers (no tensor copied)."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _confirm_plan(model: nn.Module, inputs: Any, chosen: dict, plans: dict, best: str,
                  plan: "_Planner", report: AccelReport, options: dict,
                  min_speedup: float) -> tuple[str, str, dict[str, float]]:
    """(plan, why, {"dense": ms, best: ms}): ``best`` and "dense" built side by side (module
    copies sharing the weights) and timed alternating (:func:`planner.time_paired`); ``best``
    is kept if it beats dense by ``min_speedup`` and ``planner.PLAN_MARGIN`` there, else
    dense. Plans timed one after the other misjudged close calls: on the H200 BERT-large's fp8
    per-layer plan timed 1.002x dense and ran at 0.953x of it."""
    fns = []
    for name in ("dense", best):
        shell = _shell_copy(model)
        _installer(shell, chosen, plan)(plans[name])
        fns.append(functools.partial(feed, _plan_runner(shell, report, plan, options), inputs))
    try:
        dense_ms, best_ms = planner.time_paired(fns[0], fns[1], plan.device,
                                                rounds=planner.CONFIRM_ROUNDS)
    finally:
        fns = shell = None
        if options["compile"]:
            _reset_compiled()
    ratio, need = dense_ms / best_ms, max(min_speedup, planner.PLAN_MARGIN)
    timed = {"dense": dense_ms, best: best_ms}
    if ratio < need:
        return "dense", (f"whole model: plan {best} {ratio:.3f}x dense timed alternating with "
                         f"it (< {need}): dense"), timed
    return best, f"whole model: plan {best} {ratio:.2f}x dense, timed alternating with it", timed


def _time_plan(model: nn.Module, inputs: Any, blocks: tuple[str, nn.Module] | None,
               plan: "_Planner", report: AccelReport, options: dict) -> float:
    """ms per call of the model as installed, compiled and run as it will run. A model of many
    repeated blocks (``blocks``) is timed with two small numbers of them and extrapolated: the
    plans differ block by block the same way, and each compile costs seconds per block. The
    shortened model's calls start with a cold L2 cache: in the whole model each block's weights
    were evicted by the other blocks (warm, a few small fp8 or 2:4 blocks would read theirs from
    L2 and look faster per block than they run)."""
    def once() -> float:
        fast = _plan_runner(model, report, plan, options)
        try:
            return planner.time_model_ms(lambda: feed(fast, inputs), plan.device,
                                         cold_l2=blocks is not None)
        finally:
            fast = None
            if options["compile"]:
                _reset_compiled()

    if blocks is None:
        return once()
    times = {}
    for k in planner.PLAN_BLOCKS_TIMED:
        with planner.truncated(model, blocks[0], k):
            times[k] = once()
    return planner.extrapolate_ms(times, len(blocks[1]))


def _check_options(precision: str, dense_precision: str, sparsity: str,
                   min_speedup: float) -> AccelReport:
    """Validate accelerate's options; the (empty) report that records its choices."""
    check_precision("precision", precision)
    check_precision("dense_precision", dense_precision)
    if sparsity not in SPARSITIES:
        raise ValueError(f"sparsity must be one of {SPARSITIES}, got {sparsity!r}")
    if not min_speedup > 0:
        raise ValueError(f"min_speedup must be > 0, got {min_speedup}")
    return AccelReport(precision, sparsity, float(min_speedup), "")


def _check_capture(capture: bool | None, device: torch.device, compile: bool,
                   mode: str | None, inputs: Any) -> bool:
    """Whether the model runs on sparsekit's own CUDA graphs (:mod:`sparsekit.accel.graphs`).
    None: on a CUDA device, compiled, no ``mode`` asked for, and ``inputs`` of tensors and
    scalars only (an HF ``Cache`` in them: ``mode="reduce-overhead"``)."""
    if capture is None:
        return (device.type == "cuda" and compile and mode is None
                and graphs.input_key(inputs) is not None)
    if capture and (device.type != "cuda" or not compile or mode == "reduce-overhead"):
        raise ValueError(f"capture=True needs a CUDA device, compile=True and a mode other "
                         f"than 'reduce-overhead' (CUDA graphs of its own), got "
                         f"device={device}, compile={compile}, mode={mode!r}")
    return bool(capture)


def _check_inductor(inductor: dict | None, backend: str) -> None:
    """``inductor`` must be a dict of inductor option names torch.compile knows."""
    if inductor is None:
        return
    if not isinstance(inductor, dict) or not all(isinstance(k, str) for k in inductor):
        raise ValueError(f"inductor must be a dict of inductor option names, got {inductor!r}")
    try:
        _compat.compile_module(nn.Identity(), backend=backend, options=inductor)
    except ValueError as e:
        raise ValueError(f"inductor: {e}") from None


def _layers(model: nn.Module, inputs: Any, include: Any, exclude: Any, precision: str,
            report: AccelReport) -> tuple[list[str], dict[str, int], list[list[str]]]:
    """Convert attention/conv modules, then the selected linear layers' names, the token count
    each sees on ``inputs`` (layers not called are reported as skipped) and the groups fed one
    tensor (:func:`siblings.first_calls`); a layer quantized with another scheme than
    ``precision`` is an error."""
    keep = name_filter([n for n, _ in model.named_modules() if n], include, exclude)
    _convert(model, keep, report)
    names = [n for n, m in model.named_modules()
             if isinstance(m, (nn.Linear, QuantLinear)) and keep(n)]
    for n in names:
        q = model.get_submodule(n)
        own = _own_precision(q)
        if own is not None and own != precision:
            raise ValueError(f"layer {n!r} is quantized with {q.scheme!r}: accelerate it with "
                             f"precision={own!r} (its numerics), got {precision!r}")
    tokens, groups = siblings_.first_calls(model, inputs, names)
    for name in names:
        if name not in tokens:
            report.skipped[name] = "not called on the example inputs"
    return names, tokens, groups


def _device_of(device: str | torch.device | None) -> torch.device:
    """The device accelerate runs on: CUDA by default (an error when none is visible), or CPU
    for the reference kernels."""
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("sk.accelerate needs a CUDA GPU (sparse tensor cores); none is "
                               "visible (device='cpu' runs the reference kernels, for tests)")
        device = "cuda"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a CUDA device or 'cpu', got {device}")
    return device


def _decide(name: str, layer: nn.Module, m: int, precision: str, sparsity: str,
            dense_precision: str, min_speedup: float, plan: _Planner, report: AccelReport,
            decided: dict, chosen: dict) -> None:
    """Layer ``name``'s candidates and, with ``sparsity="auto"``, its per-shape choice (timed
    once per GEMM shape, shared through ``decided``); adds its decision to ``report`` and, when
    accelerate may replace it, to ``chosen``."""
    has24 = _weight_24(layer)
    cands, reason = layer_plan(has24, precision, sparsity, layer.in_features,
                               layer.out_features, dense_precision)
    quantized = _own_precision(layer) is not None
    if quantized:  # only variants with the layer's own numerics: its scheme, dense or 2:4
        reason = f"quantized ({layer.scheme}): its weights, scales and activation numerics"
        if layer.in_features % _ALIGN or layer.out_features % _ALIGN:  # quant's forward
            report.layers.append(LayerDecision(name, layer.out_features, layer.in_features,
                                               m, has24, "QuantLinear", reason + "; "
                                               "in/out features not multiples of 32: kept"))
            return
        cands = [variant_name(precision, False)] + (
            [variant_name(precision, True)] if has24 and sparsity != "dense" else [])
    decision = LayerDecision(name, layer.out_features, layer.in_features, m, has24,
                             BASELINE, reason)
    report.layers.append(decision)
    chosen[name] = (layer, m, cands, decision)
    if quantized and sparsity == "auto" and len(cands) > 1:
        timings = {v: plan.time(v, layer, m) for v in cands}
        decision.variant = min(timings, key=timings.get)
        decision.timings_us = timings
        decision.reason += f"; faster measured at M={m}"
    elif sparsity != "auto" or len(cands) == 1:
        decision.variant = cands[-1]
    else:
        key = (layer.out_features, layer.in_features, m, tuple(cands))
        if key not in decided:
            timings = {}
            for v in cands:
                try:
                    timings[v] = plan.time(v, layer, m)
                except RuntimeError as e:  # a kernel this shape cannot run: not a candidate
                    if v == BASELINE:
                        raise
                    report.notes.append(f"{v} at {layer.out_features}x{layer.in_features}, "
                                        f"M={m} did not run: {str(e).splitlines()[0][:120]}")
            variant, why = planner.choose(timings, m, min_speedup)
            decided[key] = (variant, why, timings)
        decision.variant, why, decision.timings_us = decided[key][0], decided[key][1], \
            dict(decided[key][2])
        decision.reason = f"{reason}; {why}"
        # a variant that did not run at this shape is no candidate of any plan
        chosen[name] = (layer, m, [c for c in cands if c in decision.timings_us], decision)


def _fuse_siblings(model: nn.Module, inputs: Any, groups: list[list[str]], chosen: dict,
                   plan: _Planner, report: AccelReport, compiled: dict) -> None:
    """``accelerate(siblings=True)`` on the installed model: each group of layers fed one tensor
    becomes one GEMM (:func:`siblings.fuse`); the inductor pass merging the members' identical
    calls (:class:`siblings.MergeSameCalls`) is installed when any was fused (unless
    ``inductor`` sets ``post_grad_custom_pre_pass``)."""
    if not compiled["compile"] or compiled["backend"] != "inductor":
        report.notes.append("siblings: not fused without compile by inductor (elsewhere every "
                            "member would run the whole GEMM)")
        return
    notes = siblings_.fuse(model, inputs, groups, chosen, plan.build)
    report.notes.extend(notes)
    if any(n.startswith("siblings fused") for n in notes):
        compiled["inductor"] = {"post_grad_custom_pre_pass": siblings_.MergeSameCalls(),
                                **(compiled["inductor"] or {})}


DECODE_BUCKETS = (1, 4, 16, 32)  # token counts at which the small-M kernel is timed


def _plan_decode(model: nn.Module, device: torch.device, report: AccelReport,
                 plan: _Planner) -> None:
    """Per 2:4 layer with the small-M kernel, the token counts it serves: on CUDA each shape is
    timed at ``DECODE_BUCKETS`` against the layer's large-M path (CUDA graphs) and keeps the
    small-M kernel up to the last count where it is faster (``decode_max_m``; 0: never, and
    the layer drops that format's copy of its weight); the choice is cached on disk with the
    planner's timings. On CPU the reference paths keep it for every M <= 32 (numerics, not
    speed)."""
    if device.type != "cuda":
        return
    chosen: dict[str, dict] = {}
    for mod in model.modules():
        if getattr(mod, "dvalues", None) is None:
            continue
        numerics = (f"{mod.variant}|decode|{mod.path}|"
                    f"{'dynamic' if mod.act_scale is None else 'static'}")
        key = planner.plan_key(plan.name, torch.__version__, numerics, mod.out_features,
                               mod.in_features, 0, inductor=plan.inductor)
        if key not in chosen:
            chosen[key] = plan.cache.get(key) or _time_decode(mod, device)
            plan.cache[key] = plan.new[key] = chosen[key]
            report.notes.append(
                f"decode: {mod.variant} {mod.out_features}x{mod.in_features} on the small-M "
                f"kernel for M <= {chosen[key]['decode_max_m']} (us small-M/large-M: " +
                ", ".join(f"M={m} {t[0]:.1f}/{t[1]:.1f}" for m, t in chosen[key]["us"].items())
                + ")")
        mod.decode_max_m = int(chosen[key]["decode_max_m"])
        if mod.decode_max_m == 0:  # never used: its copy of the weight goes
            mod.dvalues = mod.dmeta = None


def _time_decode(mod: nn.Module, device: torch.device) -> dict:
    """{"decode_max_m": the last of DECODE_BUCKETS where ``mod``'s small-M kernel beats its
    large-M path, "us": {M: [small-M us, large-M us]}} (timed in CUDA graphs)."""
    from sparsekit.nn.timing import graph_time_us

    limit, us = 0, {}
    for m in DECODE_BUCKETS:
        x = torch.randn(m, mod.in_features, device=device, dtype=torch.bfloat16)
        pair = []
        for max_m in (m, 0):
            mod.decode_max_m = max_m
            pair.append(graph_time_us(functools.partial(mod, x)))
        us[str(m)] = pair
        if pair[0] >= pair[1]:
            break
        limit = m
    return {"decode_max_m": limit, "us": us}


def _finish(model: nn.Module, chosen: dict, plan: _Planner, report: AccelReport,
            device: torch.device, inputs: Any, t0: float, options: dict,
            groups: list[list[str]] | None) -> AcceleratedModel:
    """Fuse the sibling ``groups`` when asked (not None), record the algorithms the installed
    layers use, save the plan cache, wrap the model and (when compiling) run it once, timing
    the compile."""
    if groups is not None:
        _fuse_siblings(model, inputs, groups, chosen, plan, report, options)
    own = 0
    for name, (_, _, _, decision) in chosen.items():
        mod = model.get_submodule(name)
        if getattr(mod, "uses_alg", False):
            decision.alg_ids[decision.variant] = mod.alg_id
        own += getattr(mod, "path", "") == "cslt_alpha"
    if own:
        report.notes.append(f"epilogue: {own} fp8 2:4 layer(s) on sparsekit's cuSPARSELt "
                            f"binding (scale and bias in the GEMM)")
    elif any(d.variant == "fp8_2:4" and not isinstance(layer, QuantLinear)
             for layer, _, _, d in chosen.values()):
        report.notes.append("epilogue: fp8 2:4 layers quantize activations per token, scales "
                            "applied after the GEMM; a model quantized with "
                            "quantize_(model, 'fp8_static_tensor', calibration=...) first runs "
                            "scale and bias inside it (faster: docs/gpu.md)")
    elif any(isinstance(layer, QuantLinear) and d.variant == "fp8_2:4"
             and get_scheme(layer.scheme).weight_granularity == "tensor"
             for layer, _, _, d in chosen.values()) and cslt_ext.reason():
        report.notes.append(f"epilogue: sparsekit's cuSPARSELt binding unavailable "
                            f"({cslt_ext.reason()}); scales applied after torch's binding")
    _plan_decode(model, device, report, plan)
    plan.save()
    report.seconds["plan"] = time.perf_counter() - t0
    fast = AcceleratedModel(model, report, device, **options)
    if options["compile"]:  # the first call compiles: its time is part of accelerate's
        t1 = time.perf_counter()
        feed(fast, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        report.seconds["compile"] = time.perf_counter() - t1
        if fast.fuse_gelu is not None and fast.fuse_gelu.fused:  # 0 on a graph-cache hit
            report.notes.append(f"epilogue: GELU in the GEMM of {fast.fuse_gelu.fused} 2:4 "
                                f"layer(s) on sparsekit's cuSPARSELt binding")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return fast


def accelerate(
    model: nn.Module,
    example_inputs: Any,
    *,
    precision: str = "bf16",
    sparsity: str = "2:4",
    min_speedup: float = 1.0,
    include: str | Sequence[str] = ("*",),
    exclude: str | Sequence[str] = (),
    dense_precision: str = "bf16",
    device: str | torch.device | None = None,
    compile: bool = True,
    mode: str | None = None,
    dynamic: bool | None = None,
    backend: str = "inductor",
    inductor: dict | None = None,
    fused_quant: bool = True,
    search_algs: bool = True,
    plan_cache: bool = True,
    clone_outputs: bool = True,
    whole_model: bool | None = None,
    siblings: bool = False,
    capture: bool | None = None,
) -> AcceleratedModel:
    """Run ``model``'s linear layers on sparse / low-precision kernels, the model compiled
    (docs/gpu.md has the details and the measured speeds).

    ``model``: weights hold their 2:4 zeros (after ``Pruner.finalize()``); layers without 2:4
    run as ``dense_precision`` ("bf16"; "fp8" runs e.g. an LM head as fp8 dense). A model
    quantized by ``sk.quantize_``/QAT (fp8 or int8 ``QuantLinear``) runs its own weights, scales
    and activation numerics: ``precision`` must be its scheme; an ``fp8_static_tensor`` model's
    fp8 2:4 layers run their scale and bias (and a tanh GELU that follows) inside the GEMM, on
    sparsekit's own cuSPARSELt binding, compiled on first use (:mod:`sparsekit.accel.cslt_ext`;
    the report says when it is used or why not). ``example_inputs``: a tensor,
    tuple (``model(*x)``) or dict (``model(**x)``) of the shape you will serve, run several
    times (an input with state, e.g. an HF ``StaticCache``, advances: not the one you serve).
    ``precision``: "bf16" | "fp8" | "int8" (W8A8; per-token or a static scheme's own scales).
    ``sparsity``: "2:4", "dense", or "auto": per GEMM shape the fastest of bf16 dense,
    precision dense, bf16 2:4, precision 2:4 (each compiled and timed; kept only if it beats
    bf16 dense by ``min_speedup``; at M <= 64 2:4 must also beat the dense variants), then with
    ``whole_model`` (default: on CUDA) a few whole-model plans timed as they will run, the
    fastest kept if it beats all-dense by ``min_speedup`` (a plan within 10% of dense is timed
    again alternating with it and must beat it there by 2% too). Timings and choices are cached on
    disk (``plan_cache=False`` re-measures). ``include``/``exclude``: the modules it may touch
    (fnmatch globs or ``re:<regex>`` over qualified names, as everywhere).
    ``device``: "cuda" (default) or "cpu" (the ops' reference kernels: tests, not speed).
    ``compile``: ``torch.compile(mode=mode, dynamic=dynamic, backend=backend)``, ``mode``
    "reduce-overhead" on CUDA, "default" on CPU; a new input shape recompiles once with dynamic
    sizes (``report.compiles`` counts graphs; a warning names more than 8). ``inductor``: extra
    inductor options (e.g. ``{"triton.multi_kernel": 1}``) over ``mode``'s, model and planner.
    ``fused_quant``: activation quantization as plain torch ops fused into its producer
    (default) or the opaque ``sparsekit::quant_rows`` op.
    ``siblings``: layers fed one tensor (q/k/v, gate/up), one variant: one GEMM (compiled, an
    inductor pass merging their calls; :mod:`sparsekit.accel.siblings`). Modifies ``model`` in
    place (to ``device``, bfloat16, eval); returns the :class:`AcceleratedModel` wrapping it.
    ``capture``: sparsekit's own CUDA graph per input signature around the model compiled in
    mode "default", replayed without dynamo's guard check (:mod:`sparsekit.accel.graphs`);
    default on CUDA when ``mode`` is not given and the example inputs hold only tensors and
    scalars; False: ``mode="reduce-overhead"``."""
    report = _check_options(precision, dense_precision, sparsity, min_speedup)
    _check_inductor(inductor, backend)
    device = _device_of(device)
    report.device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    t0 = time.perf_counter()
    model = model.eval().to(device, torch.bfloat16)
    inputs = tree_map(lambda t: t.to(device, torch.bfloat16 if t.is_floating_point() else None),
                      example_inputs)
    names, tokens, groups = _layers(model, inputs, include, exclude, precision, report)
    plan = _Planner(device, search_algs, plan_cache, fused_quant, backend, inductor)
    decided: dict[tuple, tuple[str, str, dict]] = {}
    chosen: dict[str, tuple[nn.Module, int, list[str], LayerDecision]] = {}
    for name in [n for n in names if n in tokens]:
        _decide(name, model.get_submodule(name), tokens[name], precision, sparsity,
                dense_precision, min_speedup, plan, report, decided, chosen)
    report.seconds["plan_layers"] = time.perf_counter() - t0

    install = _installer(model, chosen, plan)
    whole_model = device.type == "cuda" if whole_model is None else whole_model
    capture = _check_capture(capture, device, compile, mode, inputs)
    compiled = dict(compile=compile, mode=mode, dynamic=dynamic, backend=backend,
                    inductor=inductor, capture=capture)
    if sparsity == "auto" and whole_model and chosen:
        _plan_whole_model(model, inputs, chosen, install, plan, report, precision, min_speedup,
                          {**compiled, "fused_quant": fused_quant,
                           "dense_precision": dense_precision})
    install({n: d.variant for n, (_, _, _, d) in chosen.items()})
    return _finish(model, chosen, plan, report, device, inputs, t0,
                   {**compiled, "clone_outputs": clone_outputs}, groups if siblings else None)


def output_types_equal(a: Any, b: Any) -> bool:
    """Whether two outputs have the same structure of types (used by tests and tools)."""
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(output_types_equal(getattr(a, f.name), getattr(b, f.name))
                   for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(output_types_equal, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(output_types_equal(a[k], b[k]) for k in a)
    return True


__all__ = ["AcceleratedModel", "accelerate", "layer_plan", "output_types_equal"]
