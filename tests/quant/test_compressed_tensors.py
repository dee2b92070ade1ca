"""The compressed-tensors export of a pruned and quantized tiny Llama round-trips through the
compressed-tensors package (and through transformers' compressed-tensors loader) to sparsekit's
own weights and logits; the reasons an export is skipped."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.quant import compressed_tensors as skct
from sparsekit.quant.formats import get_scheme
from sparsekit.quant.modules import _QuantWeight

transformers = pytest.importorskip("transformers")

from sparsekit.models import hf  # noqa: E402

needs_ct = pytest.mark.skipif(
    not skct.ct_available(),
    reason="compressed-tensors is not installed (pip install 'sparsekit[compressed]')")

FORMATS = {"fp8": "float-quantized", "int8": "int-quantized",
           "int8_weight_only": "pack-quantized", "fp8_weight_only": "naive-quantized",
           "fp8_static": "float-quantized", "fp8_static_tensor": "float-quantized"}
WEIGHT_ONLY = ("int8_weight_only", "fp8_weight_only")


def pruned_quantized(path, scheme):
    model = hf.load_pretrained(path)
    sk.prune_(model, pattern="2:4", criterion="magnitude", exclude=["lm_head"])
    if scheme is not None:  # a static scheme calibrates its activation scales
        g = torch.Generator().manual_seed(1)
        cal = [{"input_ids": torch.randint(0, 300, (2, 32), generator=g)} for _ in range(2)]
        sk.quantize_(model, scheme, exclude=["lm_head"], calibration=cal)
    return model.eval()


def quant_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, _QuantWeight)}


@needs_ct
@pytest.mark.parametrize("scheme", list(FORMATS))
def test_export_round_trips_through_compressed_tensors(scheme, hf_dirs, tmp_path):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    model = pruned_quantized(hf_dirs["llama"], scheme)
    layers = quant_layers(model)
    assert len(layers) == 14  # 7 Linear layers per block, 2 blocks; lm_head stays float
    out = tmp_path / skct.CT_DIR
    result = skct.export_compressed_tensors(model, out)
    assert result == {
        "compressed_tensors": f"written: {FORMATS[scheme]} ({scheme}, 14 layers), "
                              "sparsity_config dense 2:4 (0.500)",
        "compressed_tensors_dir": str(out)}

    qc_dict = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc_dict["quant_method"] == "compressed-tensors"
    assert qc_dict["format"] == FORMATS[scheme] and qc_dict["ignore"] == ["lm_head"]
    assert qc_dict["sparsity_config"] == {
        "format": "dense", "sparsity_structure": "2:4", "global_sparsity": 0.5,
        "targets": ["Linear"], "ignore": ["lm_head"]}

    # 1. through the package alone: its config parser, its compressor's decompress
    qc = QuantizationConfig.model_validate(qc_dict)
    (group,) = qc.config_groups.values()
    per_tensor = get_scheme(scheme).weight_granularity == "tensor"
    assert group.weights.strategy == ("tensor" if per_tensor else "channel")
    assert group.weights.num_bits == 8
    assert (group.input_activations is None) == (scheme in WEIGHT_ONLY)
    static = get_scheme(scheme).static
    if group.input_activations is not None:
        assert group.input_activations.dynamic is not static
        assert group.input_activations.strategy == ("tensor" if static else "token")
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    stored = load_file(out / "model.safetensors")
    plain = model.state_dict()
    for name, layer in layers.items():
        local = {k[len(name) + 1:]: v for k, v in stored.items()
                 if k.startswith(f"{name}.") and "." not in k[len(name) + 1:]}
        want = layer.dequantized_weight(torch.float32)  # sparsekit's values times scales
        if scheme != "int8_weight_only":  # naive formats store the 8-bit values as they are
            assert local["weight"].dtype == layer.weight.dtype
            assert torch.equal(local["weight"].view(torch.uint8), layer.weight.view(torch.uint8))
        else:  # four int8 values per int32
            assert local["weight_packed"].dtype == torch.int32 and "weight" not in local
        if static:  # the calibrated scale, under compressed-tensors' name
            assert torch.equal(local["input_scale"], layer.input_scale)
        if per_tensor:  # one weight scale, in the package's shape for a tensor strategy
            assert torch.equal(local["weight_scale"], layer.weight_scale[:1])
        got = compressor.decompress(local, group)["weight"]
        assert got.dtype == torch.float32 and torch.equal(got, want), name
        assert torch.equal(got == 0, layer.weight.float() == 0)  # the 2:4 zeros kept
        assert (got.reshape(got.shape[0], -1, 4) != 0).sum(-1).le(2).all()
    for key, value in plain.items():  # the float tensors (embeddings, norms, lm_head) as is
        if key.rsplit(".", 1)[0] not in layers:
            assert torch.equal(stored[key], value), key

    # 2. through transformers' compressed-tensors integration (decompressed on first forward)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert isinstance(back.config.quantization_config, transformers.CompressedTensorsConfig)
    ids = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        got, want = back(ids).logits, model(ids).logits
        for name, layer in layers.items():
            assert torch.equal(back.get_submodule(name).weight,
                               layer.dequantized_weight(torch.float32)), name
        if scheme in WEIGHT_ONLY:  # float activations: the same ops, exactly
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        elif scheme in ("fp8", "fp8_static", "fp8_static_tensor"):
            # the same activation scales (absmax/448 per token, or the one static scale, values
            # beyond it saturating at 448); the matmul order differs
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            # compressed-tensors' reference int8 activations use absmax/127.5 per token (range
            # [-128, 127]), sparsekit's absmax/127: logits agree to about one activation step
            dense = hf.load_pretrained(hf_dirs["llama"]).eval()(ids).logits
            assert (got - want).abs().max() < 0.1 * (want - dense).abs().max()
            # with activation quantization off on both sides the weights give equal logits
            for module in back.modules():
                if hasattr(module, "quantization_scheme"):
                    module.quantization_enabled = False
            for layer in layers.values():
                layer.scheme = "int8_weight_only"
            torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_skipped_when_the_package_is_missing(hf_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(skct, "ct_available", lambda: False)
    model = pruned_quantized(hf_dirs["llama"], "fp8")
    result = skct.export_compressed_tensors(model, tmp_path / "ct")
    assert result == {"compressed_tensors": "skipped: the compressed-tensors package is not "
                                            "installed (pip install 'sparsekit[compressed]')"}
    assert not (tmp_path / "ct").exists()


@pytest.mark.parametrize(("make", "expected"), [
    (lambda d: pruned_quantized(d, None), "skipped: the model is not quantized"),
    (lambda d: sk.quantize_(m := nn.Sequential(nn.Conv1d(4, 4, 3)), "int8_weight_only") and m,
     "skipped: compressed-tensors compresses Linear layers only; '0' is a quantized conv"),
])
def test_skipped_with_the_reason(make, expected, hf_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(skct, "ct_available", lambda: True)  # the reasons after the import
    result = skct.export_compressed_tensors(make(hf_dirs["llama"]), tmp_path / "ct")
    assert result["compressed_tensors"].startswith(expected), result
    assert not (tmp_path / "ct").exists()


@needs_ct
@pytest.mark.parametrize("scheme", ["int4_weight", "int4_weight_channel"])
def test_int4_2_4_export_is_pack_quantized_and_round_trips(scheme, tmp_path):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    cal = [{"input_ids": torch.randint(0, 300, (2, 32), generator=g)} for _ in range(2)]
    sk.quantize_(model, scheme, calibration=cal, method=sk.GPTQ(pattern="2:4"),
                 exclude=["lm_head"])
    layers = quant_layers(model)
    out = tmp_path / skct.CT_DIR
    result = skct.export_compressed_tensors(model, out)
    assert result["compressed_tensors"].startswith(f"written: pack-quantized ({scheme}, 7 layers)"
                                                   ", sparsity_config dense 2:4 (0.5")
    qc = QuantizationConfig.model_validate(
        json.loads((out / "config.json").read_text())["quantization_config"])
    (group,) = qc.config_groups.values()
    assert (group.weights.num_bits, group.weights.type, group.weights.symmetric) == (4, "int", True)
    grouped = scheme == "int4_weight"
    assert group.weights.strategy == ("group" if grouped else "channel")
    assert group.weights.group_size == (128 if grouped else None)
    assert group.input_activations is None and qc.format == "pack-quantized"
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    stored = load_file(out / "model.safetensors")
    for name, layer in layers.items():
        local = {k[len(name) + 1:]: v for k, v in stored.items()
                 if k.startswith(f"{name}.") and "." not in k[len(name) + 1:]}
        n, k = layer.weight.shape
        # eight 4-bit values per int32, the scales as sparsekit stores them, the shape
        assert local["weight_packed"].dtype == torch.int32
        assert local["weight_packed"].shape == (n, k // 8)
        assert torch.equal(local["weight_scale"].float(), layer.weight_scale)
        assert local["weight_scale"].shape == (n, k // 128 if grouped else 1)
        assert local["weight_shape"].tolist() == [n, k]
        got = compressor.decompress(local, group)["weight"]
        assert torch.equal(got.float(), layer.dequantized_weight(torch.float32)), name
        assert (got.reshape(n, -1, 4) != 0).sum(-1).le(2).all()
    back = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ids = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)
