"""The structure of a quantized model as plain data, so a checkpoint of its state_dict can be
loaded into a fresh float model.

>>> from sparsekit.quant import quantize_
>>> model = nn.Sequential(nn.Linear(8, 4))
>>> _ = quantize_(model, "fp8")
>>> plan = quant_plan(model)
>>> plan
{'0': {'version': 1, 'scheme': 'fp8', 'type': 'Linear', 'weight_shape': [4, 8], 'bias': True}}
>>> fresh = nn.Sequential(nn.Linear(8, 4))
>>> apply_quant_plan(fresh, plan)
>>> fresh.load_state_dict(model.state_dict())
<All keys matched successfully>
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparsekit.checks import check_mapping, check_module
from sparsekit.errors import FileFormatError, UsageError
from sparsekit.io import checkpoint
from sparsekit.quant.formats import SCHEMES
from sparsekit.registry import from_file
from sparsekit.quant.layers import after_swap, kind, set_module
from sparsekit.quant.modules import _QuantWeight, quantized_module

PLAN_VERSION = 1


def quant_plan(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Qualified layer name -> ``{"version", "scheme", "type", "weight_shape", "bias"}`` for
    every quantized layer of ``model`` (JSON-serialisable; empty for a float model)."""
    check_module(model, where="quant_plan: ")
    return {
        name: {
            "version": PLAN_VERSION,
            "scheme": m.scheme,
            "type": kind(m),
            "weight_shape": list(m.weight.shape),
            "bias": m.bias is not None,
        }
        for name, m in model.named_modules()
        if isinstance(m, _QuantWeight)
    }


def apply_quant_plan(model: nn.Module, plan: dict[str, dict[str, Any]]) -> None:
    """Turn the layers of a fresh float ``model`` named in ``plan`` (from :func:`quant_plan`)
    into quantized layers with zero-filled storage of the right shapes and dtypes, in place,
    ready for ``load_state_dict``. ValueError naming the layer when the model does not match."""
    check_module(model, where="apply_quant_plan: ")
    check_mapping(plan, "apply_quant_plan: plan", "layer name -> spec, from quant_plan(model)")
    for name, spec in plan.items():
        if spec.get("version") != PLAN_VERSION:
            raise UsageError(
                f"quant plan entry {name!r} has version {spec.get('version')!r}; "
                f"this sparsekit reads version {PLAN_VERSION}"
            )
        scheme = from_file(SCHEMES, spec.get("scheme"), f"quant plan entry {name!r}")
        try:
            module = model.get_submodule(name)
        except AttributeError as e:
            raise UsageError(f"quant plan layer {name!r} is not in the model") from e
        found = (kind(module), list(module.weight.shape), module.bias is not None)
        expected = (spec["type"], spec["weight_shape"], spec["bias"])
        if isinstance(module, _QuantWeight) or found != expected:
            raise UsageError(
                f"quant plan layer {name!r} expects a float {expected[0]} with weight shape "
                f"{expected[1]} and bias={expected[2]}; the model has "
                f"{type(module).__name__} {found[1]} bias={found[2]}"
            )
        set_module(model, name, quantized_module(module, scheme, fill=False))
    after_swap(model)


def _bad(t: torch.Tensor, bad: torch.Tensor) -> str:
    """``n of N (e.g. VALUE at INDEX)`` for the entries of ``t`` where ``bad`` is true."""
    index = tuple(int(i) for i in bad.nonzero()[0])
    return f"{int(bad.sum())} of {t.numel()} (e.g. {t[index].item()!r} at {list(index)})"


def check_quant_values(model: nn.Module, plan: dict[str, dict[str, Any]], path: str) -> None:
    """The loaded values of every quantized layer in ``plan`` against its scheme's format:
    the weight in the format's dtype and shape with values in [qmin, qmax] (int8 [-127, 127],
    int4 [-8, 7], float8 finite within +-448), scales float, of the layer's scale shape,
    finite and positive. A :class:`~sparsekit.errors.FileFormatError` naming ``path``, the
    tensor and what its format allows (a checkpoint with other values would give other
    outputs than the model that was saved, without a word)."""
    for name, spec in plan.items():
        module = model.get_submodule(name)
        scheme = SCHEMES[spec["scheme"]]
        fmt, where = scheme.weight, f"{path}: {name}"
        w = module.weight
        if w.dtype != fmt.dtype or list(w.shape) != list(spec["weight_shape"]):
            raise FileFormatError(f"{where}.weight is {w.dtype} {list(w.shape)}; {scheme.name} "
                                  f"stores {fmt.dtype} {spec['weight_shape']}")
        values = w.float()
        bad = ~values.isfinite() | (values < fmt.qmin) | (values > fmt.qmax)
        if bool(bad.any()):
            raise FileFormatError(f"{where}.weight: {_bad(values, bad)} values outside "
                                  f"{fmt.name}'s [{fmt.qmin:g}, {fmt.qmax:g}]")
        expected = ((w.shape[0], w.shape[1] // module.group_size) if scheme.grouped
                    else (w.shape[0],))
        scales = [("weight_scale", module.weight_scale, expected)]
        if "input_scale" in module._buffers:
            scales.append(("input_scale", module.input_scale, (1,)))
        for key, t, shape in scales:
            if not t.dtype.is_floating_point or t.dtype.itemsize < 2 or tuple(t.shape) != shape:
                raise FileFormatError(f"{where}.{key} is {t.dtype} {list(t.shape)}; "
                                      f"{scheme.name} stores float32 {list(shape)}")
            bad = ~t.isfinite() | (t <= 0)
            if bool(bad.any()):
                raise FileFormatError(f"{where}.{key}: {_bad(t, bad)} scales not finite and "
                                      "positive")


checkpoint.register_plan("quant", quant_plan, apply_quant_plan, check_quant_values)
