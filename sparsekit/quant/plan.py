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

from torch import nn

from sparsekit.errors import UsageError
from sparsekit.io import checkpoint
from sparsekit.quant.formats import SCHEMES
from sparsekit.registry import from_file
from sparsekit.quant.layers import after_swap, kind, set_module
from sparsekit.quant.modules import _QuantWeight, quantized_module

PLAN_VERSION = 1


def quant_plan(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Qualified layer name -> ``{"version", "scheme", "type", "weight_shape", "bias"}`` for
    every quantized layer of ``model`` (JSON-serialisable; empty for a float model)."""
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


checkpoint.register_plan("quant", quant_plan, apply_quant_plan)
