"""accelerate(precision="int4") on layers whose input is no multiple of 128 (SmolLM2's 576 =
64 * 9): int4 QuantLinears of group 64/32/per channel keep their values and groups in the
W4A16 layers; a float layer is rounded at the largest group that fits; on the GPU the int4 2:4
layers of group 64 decode on the Triton kernel (the mma.sp int4 format takes groups of 128),
with a note, and match the quantized model."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparsekit as sk
from sparsekit.accel import layers_int4

HIDDEN = 576


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(HIDDEN, 1536), nn.GELU(), nn.Linear(1536, HIDDEN)).eval()
    sk.prune_(model, pattern="2:4", criterion="magnitude")
    return model


@pytest.mark.parametrize("k,group", [(HIDDEN, 64), (320, 64), (96 * 2, 64), (1536, 128)])
def test_float_layer_takes_the_largest_group_that_fits(k, group):
    lin = nn.Linear(k, 32)
    for cls in (layers_int4.Int4Dense, layers_int4.Int4Sparse24):
        w = lin.weight if cls is layers_int4.Int4Dense else _two_four(lin.weight)
        src = nn.Linear(k, 32)
        with torch.no_grad():
            src.weight.copy_(w)
        layer = cls(src)
        q, s = layers_int4.rtn_int4(src.weight, group)
        assert layer.group_size == group and torch.equal(layer.int_weight(), q)
        assert torch.equal(layer.weights(layer.plan.kernels()[0]).scales, s)


def _two_four(w: torch.Tensor) -> torch.Tensor:
    g = w.detach().reshape(w.shape[0], -1, 4)
    keep = g.abs().topk(2, dim=-1).indices
    return (g * torch.zeros_like(g).scatter_(-1, keep, 1.0)).reshape(w.shape)


@pytest.mark.parametrize("group_size,groups", [("auto", (64, 128)), (64, (64, 64)),
                                               (32, (32, 32)), ("channel", (HIDDEN, 1536))])
@pytest.mark.parametrize("sparsity", ["2:4", "dense"])
def test_accelerate_keeps_the_quantized_groups(group_size, groups, sparsity):
    model = _model()
    sk.quantize_(model, "int4_weight", group_size=group_size)
    x = torch.randn(4, HIDDEN)
    with torch.no_grad():
        ref = copy.deepcopy(model)(x)
    fast = sk.accelerate(model, x, precision="int4", sparsity=sparsity, device="cpu",
                         compile=sk.CompileOptions(backend="eager"))
    layers = [fast.model[0], fast.model[2]]
    assert [m.group_size for m in layers] == list(groups)
    y = fast(x).float()
    assert (y - ref).norm() / ref.norm() < 2e-2  # bf16 activations, the same int4 weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_group_64_decodes_on_triton_with_a_note():
    model = _model()
    sk.quantize_(model, "int4_weight", group_size="auto")  # 576 -> g64, 1536 -> g128
    x = torch.randn(1, HIDDEN)
    with torch.no_grad():
        want = F.linear(F.gelu(F.linear(x.double(), model[0].dequantized_weight().double(),
                                        model[0].bias.double())),
                        model[2].dequantized_weight().double(), model[2].bias.double())
    fast = sk.accelerate(model, x.cuda(), precision="int4", sparsity="2:4")
    first, last = fast.model[0], fast.model[2]
    assert (first.group_size, first.path) == (64, "int4_24_triton")
    assert last.group_size == 128
    notes = " | ".join(fast.report.notes)
    assert f"{1536}x{HIDDEN} g64 run the int4_24_triton kernel: the mma_sp_int4" in notes, notes
    y = fast(x.cuda()).double().cpu()
    assert (y - want).norm() / want.norm() < 1e-2
