"""``accelerate``: a finalized (2:4-zeroed, optionally quantized) model with its linear layers on
sparse / low-precision kernels (``sparsekit::`` custom ops), the whole model compiled.

The default path: layers swapped for :mod:`sparsekit.accel.layers` modules, then the model
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

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from sparsekit.checks import check_module
from sparsekit.accel import graphs
from sparsekit.accel import siblings as siblings_
from sparsekit.accel.kernels import switches
from sparsekit.accel.convert import ConvAsLinear, conv_skip_reason, split_attention_
from sparsekit.accel.layers import SPARSITIES, check_precision
from sparsekit.accel.model import AcceleratedModel
from sparsekit.accel.options import CompileOptions, PlanOptions
from sparsekit.accel.planner import Planner, own_precision
from sparsekit.accel.report import AccelReport
from sparsekit.errors import ConfigTypeError, UsageError
from sparsekit.nn.calibration import check_no_meta, feed, tree_map
from sparsekit.nn.select import name_filter
from sparsekit.prune.patterns import is_nm
from sparsekit.quant.modules import QuantLinear


def accelerate(
    model: nn.Module,
    example_inputs: Any,
    *,
    precision: str = "bf16",
    sparsity: str = "2:4",
    include: str | Sequence[str] = ("*",),
    exclude: str | Sequence[str] = (),
    device: str | torch.device | None = None,
    compile: bool | CompileOptions = True,
    plan: PlanOptions | None = None,
) -> AcceleratedModel:
    """Run ``model``'s linear layers on sparse / low-precision kernels, the model compiled
    (docs/gpu.md has the details and the measured speeds). Modifies ``model`` in place (to
    ``device``, bfloat16, eval); returns the :class:`AcceleratedModel` wrapping it.

    ``model``: weights hold their 2:4 zeros (after ``Pruner.finalize()``); layers without 2:4
    run as ``plan.dense_precision``. A model quantized by ``sk.quantize_``/QAT (fp8 or int8
    ``QuantLinear``) runs its own weights, scales and activation numerics: ``precision`` must be
    its scheme (an ``fp8_static_tensor`` model's fp8 2:4 layers run scale, bias and a following
    tanh GELU inside the GEMM on sparsekit's cuSPARSELt binding,
    :mod:`sparsekit.accel.kernels.cusparselt.ext`).
    ``example_inputs``: a tensor, tuple (``model(*x)``) or dict (``model(**x)``) of the shape you
    will serve, run several times (an input with state, e.g. an HF ``StaticCache``, advances).
    ``precision``: "bf16" | "fp8" | "int8" (W8A8; per-token or a static scheme's own scales) |
    "fp8w" (W8A16: fp8 weights, bf16 activations) | "int4" (W4A16).
    ``sparsity``: "2:4", "dense", or "auto": per GEMM shape the fastest of bf16 dense, precision
    dense, bf16 2:4, precision 2:4, each timed as it will run, then (``plan.whole_model``) a few
    whole-model plans (:mod:`sparsekit.accel.planner`). ``include``/``exclude``: the modules it
    may touch (fnmatch globs or ``re:<regex>`` over qualified names, as everywhere).
    ``device``: "cuda" (default) or "cpu" (the ops' reference kernels: tests, not speed).
    ``compile``: True (``CompileOptions()``), a :class:`CompileOptions`, or False (eager).
    ``plan``: a :class:`PlanOptions` (None: ``PlanOptions()``)."""
    options, compiled = _compile_options(compile)
    plan = _plan_options(plan)
    with switches.using(plan.switches()):  # the kernels read the plan's choices
        fast = _accelerate(model, example_inputs, precision, sparsity, include, exclude,
                           device, options, compiled, plan)
    fast.plan = plan
    return fast


def _accelerate(model: nn.Module, example_inputs: Any, precision: str, sparsity: str,
                include: Any, exclude: Any, device: Any, options: CompileOptions,
                compiled: bool, plan: PlanOptions) -> AcceleratedModel:
    """:func:`accelerate` with its options checked and the plan's kernel choices current."""
    check_module(model, where="sk.accelerate: ")
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type == "meta"]
    if meta:
        raise UsageError(f"sk.accelerate: {meta[0]!r} is on the meta device (no values): "
                         "materialize the model first (to_empty and load its weights)")
    check_no_meta(example_inputs, "sk.accelerate: example_inputs")
    report = _check_options(precision, sparsity, plan)
    device = _device_of(device)
    report.device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    t0 = time.perf_counter()
    model = model.eval().to(device, torch.bfloat16)
    inputs = tree_map(lambda t: t.to(device, torch.bfloat16 if t.is_floating_point() else None),
                      example_inputs)
    options = _check_capture(options, device, compiled, inputs)
    names, tokens, groups = _layers(model, inputs, include, exclude, precision, report)
    planner = Planner(device, precision, sparsity, plan, options, compiled, report)
    for name in [n for n in names if n in tokens]:
        layer = model.get_submodule(name)
        planner.decide(name, layer, tokens[name], _weight_24(layer))
    report.seconds["plan_layers"] = time.perf_counter() - t0
    if sparsity == "auto" and planner.whole_model and planner.layers:
        planner.plan_whole_model(model, inputs)
    planner.install(model, {n: p.decision.variant for n, p in planner.layers.items()})
    if plan.siblings:
        options = planner.fuse_siblings(model, inputs, groups)
    planner.finish(model)
    report.seconds["plan"] = time.perf_counter() - t0
    return _wrap(model, report, device, options, compiled, inputs)


def _wrap(model: nn.Module, report: AccelReport, device: torch.device, options: CompileOptions,
          compiled: bool, inputs: Any) -> AcceleratedModel:
    """The :class:`AcceleratedModel` of the installed ``model``; when compiling with
    ``options.warmup``, run once on ``inputs`` (the first call compiles: its time is part of
    accelerate's)."""
    fast = AcceleratedModel(model, report, device, options, compile=compiled)
    if compiled and options.warmup:
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


def _compile_options(compile: bool | CompileOptions) -> tuple[CompileOptions, bool]:
    """(the compile options, whether the model is compiled) of ``accelerate(compile=...)``."""
    if isinstance(compile, CompileOptions):
        return compile, True
    if isinstance(compile, bool):
        return CompileOptions(), compile
    raise ConfigTypeError(f"compile must be True, False or a CompileOptions, got {compile!r}")


def _plan_options(plan: PlanOptions | None) -> PlanOptions:
    if plan is None:
        return PlanOptions()
    if not isinstance(plan, PlanOptions):
        raise ConfigTypeError(f"plan must be a PlanOptions or None, got {plan!r}")
    return plan


def _check_options(precision: str, sparsity: str, plan: PlanOptions) -> AccelReport:
    """Validate accelerate's options; the (empty) report that records its choices."""
    check_precision("precision", precision)
    if sparsity not in SPARSITIES:
        raise UsageError(f"sparsity must be one of {SPARSITIES}, got {sparsity!r}")
    return AccelReport(precision, sparsity, float(plan.min_speedup), "")


def _check_capture(options: CompileOptions, device: torch.device, compiled: bool,
                   inputs: Any) -> CompileOptions:
    """``options`` with ``capture`` decided: whether the model runs on sparsekit's own CUDA
    graphs (:mod:`sparsekit.accel.graphs`). None: on a CUDA device, compiled, no ``mode`` asked
    for, and ``inputs`` of tensors and scalars only (an HF ``Cache`` in them: mode
    "reduce-overhead")."""
    capture = options.capture
    if capture is None:
        capture = (device.type == "cuda" and compiled and options.mode is None
                   and graphs.input_key(inputs) is not None)
    elif capture and device.type != "cuda":
        raise UsageError(f"CompileOptions(capture=True) needs a CUDA device (CUDA graphs of "
                         f"its own), got device={device}")
    return dataclasses.replace(options, capture=bool(capture))


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
        own = own_precision(q)
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
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"sk.accelerate: device={device!r} is not a torch device; use 'cuda', "
                         "'cuda:0', ... or 'cpu'") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a CUDA device or 'cpu', got {device}")
    return device


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


__all__ = ["accelerate", "output_types_equal"]
