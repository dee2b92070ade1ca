"""sk.save / sk.load: compressed 2:4 format round-trips bit-exactly and is small."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import sparsekit as sk
from sparsekit.io import checkpoint as ck
from sparsekit.errors import UnsafeFileError

ROOT = Path(__file__).resolve().parents[1]


def random_24(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols // 4, 4, generator=g)
    keep = w.abs().topk(2, dim=-1).indices
    mask = torch.zeros_like(w, dtype=torch.bool).scatter_(-1, keep, True)
    w = (w * mask).reshape(rows, cols)
    w[0, :4] = 0.0  # a group with no non-zero
    w[1, :4] = torch.tensor([0.0, 0.0, 0.0, 1.5])  # a group with one
    return w


def mlp(width: int = 256, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
    with torch.no_grad():
        model[0].weight.copy_(random_24(2 * width, width, 1))
        model[2].weight.copy_(random_24(width, 2 * width, 2))
    return model


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]
)
def test_pack_roundtrip_exact(dtype):
    w = random_24(16, 32)
    t = (w * 20).round().to(dtype) if dtype == torch.int8 else w.to(dtype)
    values, meta = ck.pack_2to4(t)
    assert values.shape == (16, 16) and values.dtype == dtype
    assert meta.dtype == torch.uint8 and meta.numel() == -(-16 * 8 // 3)  # 3 groups a byte
    back = ck.unpack_2to4(values, meta, [16, 32])
    assert back.dtype == dtype
    assert torch.equal(back.float(), t.float())


def test_pack_conv_weight_and_odd_group_count():
    w = random_24(4, 4 * 2 * 2).reshape(4, 4, 2, 2)  # 16 groups: a partly filled meta byte
    values, meta = ck.pack_2to4(w)
    assert meta.numel() == 6
    assert torch.equal(ck.unpack_2to4(values, meta, list(w.shape)), w)


def test_dense_tensor_is_not_2to4():
    w = torch.randn(8, 16)
    assert not ck.is_2to4(w)
    assert not ck.is_2to4(torch.randn(8, 6))  # columns not a multiple of 4
    with pytest.raises(ValueError, match="2:4"):
        ck.pack_2to4(w)


def test_save_load_bf16_size_and_values(tmp_path):
    model = mlp().to(torch.bfloat16)
    sk.save(model, tmp_path / "c.safetensors")
    sk.save(model, tmp_path / "d.safetensors", compress=False)
    size = os.path.getsize(tmp_path / "c.safetensors")
    assert size / os.path.getsize(tmp_path / "d.safetensors") <= 0.57
    back = sk.load(tmp_path / "c.safetensors", model=mlp(seed=5))
    for (k, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert b.dtype == torch.bfloat16, k  # stored dtype wins over the fresh model's fp32
        assert torch.equal(a, b), k
    header = ck.read_header(tmp_path / "c.safetensors")
    assert set(header["sparse"]) == {"0.weight", "2.weight"}
    assert header["format"] == "sparsekit" and header["version"] == 1


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_save_load_quantized_2to4_size(tmp_path, scheme):
    from sparsekit.quant import quantize_

    dense_bf16 = mlp().to(torch.bfloat16)
    sk.save(dense_bf16, tmp_path / "dense.safetensors", compress=False)
    model = mlp()
    quantize_(model, scheme)
    sk.save(model, tmp_path / "q.safetensors")
    size = os.path.getsize(tmp_path / "q.safetensors")
    assert size / os.path.getsize(tmp_path / "dense.safetensors") <= 0.32
    assert ck.read_header(tmp_path / "q.safetensors")["quant"]  # the plan to rebuild layers
    back = sk.load(tmp_path / "q.safetensors", model=mlp(seed=3))
    x = torch.randn(4, 256)
    torch.testing.assert_close(back(x), model(x))
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k].float(), v.float()), k


def test_parametrized_masks_are_folded(tmp_path):
    model = nn.Sequential(nn.Linear(32, 16))
    pruner = sk.Pruner(model, pattern="2:4")
    pruner.step(0)
    masked = model[0].weight.detach().clone()
    assert ck.is_2to4(masked)
    sk.save(model, tmp_path / "p.safetensors")
    back = sk.load(tmp_path / "p.safetensors", model=nn.Sequential(nn.Linear(32, 16)))
    assert torch.equal(back[0].weight, masked)


def test_rebuild_from_spec_and_errors(tmp_path):
    lin = nn.Linear(8, 4)
    lin._sparsekit_spec = {"_target_": "torch.nn.Linear", "in_features": 8, "out_features": 4}
    sk.save(lin, tmp_path / "s.safetensors")
    with pytest.raises(UnsafeFileError, match="s.safetensors.*'torch.nn.Linear'"):
        sk.load(tmp_path / "s.safetensors")
    sk.register_model("test_linear", nn.Linear)
    lin._sparsekit_spec = {"builder": "test_linear",
                           "kwargs": {"in_features": 8, "out_features": 4}}
    sk.save(lin, tmp_path / "s.safetensors")
    back = sk.load(tmp_path / "s.safetensors")
    assert isinstance(back, nn.Linear) and torch.equal(back.weight, lin.weight)
    assert back._sparsekit_spec == lin._sparsekit_spec

    sk.save(nn.Linear(8, 4), tmp_path / "nospec.safetensors")
    with pytest.raises(ValueError, match="no model spec"):
        sk.load(tmp_path / "nospec.safetensors")
    save_file({"w": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="not a sparsekit checkpoint"):
        sk.load(tmp_path / "other.safetensors", model=nn.Linear(8, 4))
    with pytest.raises(UnsafeFileError, match="'nodots'"):
        ck.model_from_spec({"_target_": "nodots"})
    # a checkpoint naming an arbitrary callable must not run it on load
    evil = {"_target_": "subprocess.run", "args": ["touch", str(tmp_path / "pwned")]}
    with pytest.raises(UnsafeFileError, match="subprocess.run"):
        ck.model_from_spec(evil)
    assert not (tmp_path / "pwned").exists()

    class Fake(nn.Module):
        _sparsekit_accelerated = True

    with pytest.raises(ValueError, match="before sk.accelerate"):
        sk.save(Fake(), tmp_path / "f.safetensors")


def test_tied_weights_stored_once(tmp_path):
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    model[1].weight = model[0].weight
    sk.save(model, tmp_path / "t.safetensors")
    header = ck.read_header(tmp_path / "t.safetensors")
    assert header["aliases"] == {"1.weight": "0.weight"}
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        assert "1.weight" not in set(f.keys())
    fresh = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    fresh[1].weight = fresh[0].weight
    back = sk.load(tmp_path / "t.safetensors", model=fresh)
    assert back[1].weight is back[0].weight and torch.equal(back[0].weight, model[0].weight)


def test_header_is_plain_json(tmp_path):
    sk.save(mlp(64), tmp_path / "h.safetensors")
    with safe_open(str(tmp_path / "h.safetensors"), "pt") as f:
        header = json.loads(f.metadata()["sparsekit"])
    assert header["sparse"]["0.weight"]["shape"] == [128, 64]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_load_with_accelerate_on_cpu_returns_dense(tmp_path):
    model = mlp(64)
    sk.save(model, tmp_path / "a.safetensors")
    with pytest.warns(UserWarning, match="no CUDA"):
        back = sk.load(
            tmp_path / "a.safetensors",
            model=mlp(64, seed=1),
            accelerate={"example_inputs": torch.randn(2, 64)},
        )
    assert isinstance(back, nn.Sequential) and torch.equal(back[0].weight, model[0].weight)


def test_unstructured_sparse_tensors_stored_as_bitmask(tmp_path):
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    sk.save(model, tmp_path / "dense.safetensors")
    sk.prune_(model, sparsity=0.9)
    sk.save(model, tmp_path / "sparse.safetensors")
    ratio = (tmp_path / "sparse.safetensors").stat().st_size / (
        tmp_path / "dense.safetensors"
    ).stat().st_size
    # 10% of the fp32 values plus one bit per entry: ~0.13x of dense
    assert ratio < 0.15
    header = ck.read_header(tmp_path / "sparse.safetensors")
    assert set(header["bitmask"]) == {"0.weight", "1.weight"}
    back = sk.load(
        tmp_path / "sparse.safetensors",
        model=nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)),
    )
    for a, b in zip(model.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_bitmask_round_trip_exact_bits(dtype):
    t = torch.randn(33, 17)
    t[torch.rand(33, 17) < 0.8] = 0
    t = t.to(dtype) if dtype != torch.int8 else (t * 50).to(torch.int8)
    nonzeros, bits = ck.pack_bitmask(t)
    back = ck.unpack_bitmask(nonzeros, bits, list(t.shape))
    assert back.dtype == t.dtype
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("keep", [0, 7, 100, -16])
def test_damaged_file_names_itself(tmp_path, keep):
    """A truncated or corrupt file is a FileFormatError naming it, not SafetensorError/OSError."""
    from sparsekit.errors import FileFormatError

    sk.save(mlp(64), tmp_path / "m.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "bad.safetensors").write_bytes(data[:keep])
    with pytest.raises(FileFormatError, match="bad.safetensors"):
        sk.load(tmp_path / "bad.safetensors", model=mlp(64))


_FRESH = """
import sys, torch
from torch import nn
from sparsekit.errors import FileFormatError
from sparsekit.io.checkpoint import load
model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
try:  # the checkpoint alone: nothing has registered the channel and quant rebuilders
    load(sys.argv[1], model=model)
except FileFormatError as e:
    print("direct:", e)
import sparsekit as sk
back = sk.load(sys.argv[1], model=nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)))
assert torch.equal(back(torch.ones(1, 16)), torch.load(sys.argv[1] + ".out"))
print("sk.load:", type(back[0]).__name__, back[0].weight.shape[0])
"""


def test_load_in_a_fresh_process_rebuilds_channels_and_quantized_layers(tmp_path):
    """The checkpoint imports neither channels nor quant: they register their rebuild
    functions, and sk.load makes sure they have (a fresh interpreter has imported nothing)."""
    import subprocess
    import sys

    path = str(tmp_path / "m.safetensors")
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    sk.prune_channels_(model, torch.randn(2, 16), ratio=0.5, round_to=None, exclude=["2"])
    sk.quantize_(model, "int8_weight_only")
    sk.save(model, path)
    torch.save(model(torch.ones(1, 16)), path + ".out")
    header = ck.read_header(path)
    assert header["channels"] and header["quant"]
    fresh = subprocess.run([sys.executable, "-c", _FRESH, path], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    direct, loaded = fresh.stdout.splitlines()
    assert loaded.split() == ["sk.load:", "QuantLinear", "4"]  # 8 outputs pruned to 4, int8
    assert ("holds a channels plan and nothing is registered to rebuild it: load it with "
            "sparsekit.load, or import sparsekit.prune.channels first") in direct
