"""Export to the compressed-tensors format (vLLM / llm-compressor checkpoints), when that
package is installed (``pip install 'sparsekit[compressed]'``).

What compressed-tensors can write decides what this writes. Its 0.20 releases compress
*quantized* weights only (``naive_quantized``: ``float-quantized`` for fp8, ``int-quantized`` for
int8 W8A8, ``naive-quantized`` for fp8 weight-only; ``pack_quantized`` for int weight-only);
its sparse compressors (bitmask, 2:4 bitmask, marlin-24) are gone, only their config classes
are left, and ``ModelCompressor.update_config`` writes an empty ``sparsity_config``. So:

- a model sparsekit quantized with ``fp8``, ``int8``, a weight-only 8-bit scheme, a static
  scheme or an int4 scheme (Linear layers) is written with the format compressed-tensors
  infers for that scheme (int4 weight-only: ``pack-quantized``, eight 4-bit values per int32 in
  ``weight_packed``, beside ``weight_scale`` (out, in // 128), or (out, 1) per channel, and
  ``weight_shape``; what vLLM and llm-compressor read for W4A16), through
  its own API: a :class:`~compressed_tensors.quantization.QuantizationScheme` per the sparsekit
  scheme (8-bit symmetric weights with one scale per output channel, or one per tensor for
  ``fp8_static_tensor``, the very scales sparsekit computed; W8A8: dynamic per-token
  activations, or a static scale per tensor), each layer's ``weight``/``weight_scale``
  compressed by the format's compressor, and ``ModelCompressor.update_config`` writing
  ``quantization_config`` into config.json. Before anything is written, each layer is
  decompressed again through the package and must give sparsekit's dequantized weight bit for
  bit.
- pruning is recorded as metadata: ``quantization_config.sparsity_config`` is a
  ``DenseSparsityConfig`` (format ``dense``: the zeros are stored as values, since no sparse
  compressor exists to pack them) with ``sparsity_structure`` ``2:4`` when every quantized layer
  is 2:4 along its input dimension (else ``unstructured``) and the measured ``global_sparsity``.
- a model that is not quantized (pruned only) is skipped, with the reason: there is nothing the
  package can compress, and ``<run>/hf/`` already holds the pruned float weights.

>>> reason_skipped(nn.Sequential(nn.Linear(4, 4))).startswith("skipped: ")
True
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparsekit.errors import UsageError
from sparsekit.io.files import follow_umask
from sparsekit.io.zeros import is_2to4, mask_from_zeros

# the directory beside <run>/hf/ that holds the export
CT_DIR = "hf-compressed-tensors"
INSTALL = "pip install 'sparsekit[compressed]'"


def ct_available() -> bool:
    """Whether ``import compressed_tensors`` works."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        return False
    return True


def _version() -> str:
    import compressed_tensors

    return getattr(compressed_tensors, "__version__", "?")


def _quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    from sparsekit.quant.modules import _QuantWeight

    return {n: m for n, m in model.named_modules() if isinstance(m, _QuantWeight)}


def reason_skipped(model: nn.Module) -> str | None:
    """Why ``model`` cannot be exported to compressed-tensors (a line starting ``skipped: ``),
    or None when it can."""
    if not ct_available():
        return f"skipped: the compressed-tensors package is not installed ({INSTALL})"
    from sparsekit.quant.modules import QuantLinear

    layers = _quantized_layers(model)
    if not layers:
        return ("skipped: the model is not quantized (no quant.scheme); compressed-tensors "
                "compresses quantized weights only (it has no sparse compressor), and hf/ holds "
                "the pruned weights")
    others = sorted(n for n, m in layers.items() if not isinstance(m, QuantLinear))
    if others:
        return (f"skipped: compressed-tensors compresses Linear layers only; {others[0]!r} is a "
                "quantized convolution")
    schemes = sorted({m.scheme for m in layers.values()})
    if len(schemes) > 1:
        return f"skipped: the model mixes quantization schemes {schemes}; one is exported"
    return None


def ct_scheme(scheme: str, targets: list[str]) -> Any:
    """The compressed-tensors ``QuantizationScheme`` equal to sparsekit's ``scheme``: 8-bit
    symmetric weights, one scale per output channel (``channel``) or, for a scheme with
    ``weight_granularity="tensor"``, one for the whole weight (``tensor``); int4 schemes: 4-bit
    symmetric integer weights (range [-8, 7]), one scale per group of ``group_size`` inputs
    (``group``) or per output channel (``channel``), activations unquantized; for W8A8 also 8-bit
    symmetric activations, same type as weights, with a dynamic scale per token (``token``) or,
    for a static scheme, the layer's one calibrated ``input_scale`` (``tensor``, not dynamic)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from sparsekit.quant.formats import FP8, INT8, get_scheme

    s = get_scheme(scheme)
    if s.grouped:
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                   strategy=s.weight_granularity, group_size=s.group_size,
                                   dynamic=False)
        return QuantizationScheme(targets=targets, weights=weights)
    if s.weight not in (INT8, FP8) or s.activation not in (None, INT8, FP8):
        raise UsageError(f"scheme {s.name!r}: the compressed-tensors export takes the int8 and "
                         "fp8 formats only (its own format names no other)")
    kind = "float" if s.weight == FP8 else "int"
    weights = QuantizationArgs(num_bits=8, type=kind, symmetric=True,
                               strategy=s.weight_granularity, dynamic=False)
    acts = None
    if s.activation is not None:
        acts = QuantizationArgs(num_bits=8, type="float" if s.activation == FP8 else "int",
                                symmetric=True, strategy="tensor" if s.static else "token",
                                dynamic=not s.static)
    return QuantizationScheme(targets=targets, weights=weights, input_activations=acts)


def sparsity_metadata(layers: dict[str, nn.Module], ignore: list[str]) -> dict | None:
    """``quantization_config.sparsity_config`` for the quantized ``layers``: a
    ``DenseSparsityConfig`` (the zeros stored as values) with the structure (``2:4`` when every
    layer has at most 2 nonzeros in each group of 4 along its input, else ``unstructured``) and
    the fraction of zeros; None when no weight is zero."""
    from compressed_tensors.config import DenseSparsityConfig

    zeros = total = 0
    two_four = True
    for m in layers.values():
        nonzero = mask_from_zeros(m.weight)  # float8's negative zero counts as zero
        zeros += int((~nonzero).sum())
        total += nonzero.numel()
        two_four = two_four and is_2to4(m.weight)
    if zeros == 0:
        return None
    meta = DenseSparsityConfig(
        targets=["Linear"], ignore=ignore, global_sparsity=zeros / total,
        sparsity_structure="2:4" if two_four else "unstructured").model_dump()
    meta.pop("registry_requires_subclass", None)  # the registry's own field, not the format's
    return meta


def compress_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], Any, str]:
    """``model``'s state dict under its transformers keys with each quantized layer compressed
    by compressed-tensors, the ``QuantizationConfig`` describing it and the format name.
    Raises RuntimeError if decompressing a layer through the package does not give back
    sparsekit's dequantized weight bit for bit (:func:`export_compressed_tensors` then
    reports the export as skipped, with that reason, rather than failing the run)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    from sparsekit.io.checkpoint import plain_state_dict

    layers = _quantized_layers(model)
    quantized = set(layers)
    ignore = sorted(n for n, m in model.named_modules()
                    if isinstance(m, nn.Linear) and n not in quantized)
    scheme = ct_scheme(next(iter(layers.values())).scheme, ["Linear"])
    fmt = infer_module_format(nn.Linear, scheme)
    scheme.format = fmt
    compressor = BaseCompressor.get_value_from_registry(fmt.value)
    sd = plain_state_dict(model)
    for name, m in layers.items():
        sd.pop(f"{name}.weight")
        sd.pop(f"{name}.weight_scale")
        # on the CPU: the package's CUDA kernels need not round as its reference code does
        want = m.dequantized_weight(torch.float32).cpu()
        # the package's shapes: (out, 1) per channel, (1,) per tensor (sparsekit stores it
        # once per output channel, all equal)
        w_scale = m.weight_scale.float().cpu()
        if w_scale.dim() == 1:  # int4 layers' scales are already (out, groups)
            w_scale = w_scale[:1] if scheme.weights.strategy == "tensor" else w_scale.reshape(-1, 1)
        local = {"weight": want, "weight_scale": w_scale}
        packed = compressor.compress(local, scheme)
        back = compressor.decompress(packed, scheme)["weight"]
        if back.dtype != torch.float32 or not torch.equal(back, want):
            raise RuntimeError(f"compressed-tensors {fmt.value} does not give back layer "
                               f"{name!r} exactly")
        sd.update({f"{name}.{k}": v.contiguous() for k, v in packed.items()})
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore,
                                format=fmt.value,
                                quantization_status=QuantizationStatus.COMPRESSED)
    return sd, config, fmt.value


def export_compressed_tensors(model: nn.Module, out_dir: str | os.PathLike,
                              tokenizer: Any = None, quiet: bool = False) -> dict[str, str]:
    """Write ``out_dir`` in compressed-tensors' format (see the module doc) when the package is
    installed and the model is quantized with a scheme it has. Returns
    ``{"compressed_tensors": "written: ..." | "skipped: <why>"}`` plus
    ``"compressed_tensors_dir"`` when written (for summary.json's ``hf``)."""
    why = reason_skipped(model)
    if why is not None:
        return {"compressed_tensors": why}
    from compressed_tensors.base import QUANTIZATION_CONFIG_NAME, SPARSITY_CONFIG_NAME
    from compressed_tensors.compressors import ModelCompressor

    from sparsekit.models.hf import quiet_progress

    try:
        sd, config, fmt = compress_state_dict(model)
    except Exception as e:  # noqa: BLE001 - an optional extra: the run's other outputs stand
        return {"compressed_tensors": f"skipped: compressed-tensors {_version()} could not "
                                      f"compress the model: {type(e).__name__}: {e}"}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_progress(quiet):
        model.save_pretrained(os.fspath(out), state_dict=sd)
    ModelCompressor(quantization_config=config).update_config(os.fspath(out))
    layers = _quantized_layers(model)
    sparsity = sparsity_metadata(layers, config.ignore)
    what = f"{fmt} ({next(iter(layers.values())).scheme}, {len(layers)} layers)"
    if sparsity is not None:
        path = out / "config.json"
        data = json.loads(path.read_text())
        data[QUANTIZATION_CONFIG_NAME][SPARSITY_CONFIG_NAME] = sparsity
        path.write_text(json.dumps(data, indent=2, sort_keys=True))
        what += (f", sparsity_config {sparsity['format']} {sparsity['sparsity_structure']} "
                 f"({sparsity['global_sparsity']:.3f})")
    if tokenizer is not None:
        tokenizer.save_pretrained(os.fspath(out))
    follow_umask(out)
    return {"compressed_tensors": f"written: {what}", "compressed_tensors_dir": str(out)}
