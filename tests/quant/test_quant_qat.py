"""QAT: straight-through gradients, learning, conversion, and composition with the Pruner."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import sparsekit as sk
from sparsekit.quant import QuantConv, QuantLinear
from sparsekit.quant.numerics import channel_scales, fake_quantize, row_scales
from sparsekit.quant.formats import get_scheme

SCHEMES = ["int8_weight_only", "int8", "fp8"]


def _cnn():
    return nn.Sequential(
        nn.Conv1d(4, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8, 16),
        nn.ReLU(),
        nn.Linear(16, 3),
    )


def _task(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, 8, generator=g)
    y = (x[:, 0].sum(1) > 0).long() + (x[:, 1].mean(1) > 0.3).long()
    return x, y


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_straight_through_gradient_is_the_gradient_at_the_quantized_point(scheme):
    lin = nn.Linear(12, 5)
    x, target = torch.randn(7, 12), torch.randn(7, 5)
    fmt = get_scheme(scheme).weight
    # reference: a float layer evaluated at the fake-quantized weight and input
    wq = fake_quantize(lin.weight, channel_scales(lin.weight, fmt)[:, None], fmt).detach()
    wq.requires_grad_(True)
    xq = fake_quantize(x, row_scales(x, fmt), fmt)
    F.mse_loss(F.linear(xq, wq, lin.bias), target).backward()
    sk.prepare_qat_(nn.Sequential(lin), scheme)
    lin.bias.grad = None
    F.mse_loss(lin(x), target).backward()
    original = lin.parametrizations.weight.original
    torch.testing.assert_close(original.grad, wq.grad)
    assert original.grad.abs().sum() > 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_qat_learns_a_toy_task_and_convert_matches_fake_quant(scheme):
    torch.manual_seed(0)
    model = _cnn()
    report = sk.prepare_qat_(model, scheme)
    assert report.quantized == ["0", "3", "5"]
    x, y = _task()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    fake = model(x).detach()
    sk.convert_(model)
    assert isinstance(model[0], QuantConv) and isinstance(model[5], QuantLinear)
    assert not model[0]._forward_pre_hooks and not hasattr(model[0], "sparsekit_qat_scheme")
    real = model(x).detach()
    # The two paths round fp32 sums in different orders, so an activation sitting on a
    # quantization boundary can land one step apart in the next layer (seen on torch 2.11):
    # nearly every output agrees tightly, and none is off by more than a few 8-bit steps.
    scale = float(fake.abs().max())
    tight = (real - fake).abs() <= 1e-4 * scale + 1e-4 * fake.abs()
    assert tight.float().mean() >= 0.97
    torch.testing.assert_close(real, fake, rtol=0, atol=0.03 * scale)


@pytest.mark.parametrize("qat_first", [False, True])
def test_qat_under_a_pruner_sees_masked_weights_and_keeps_zeros_through_convert(qat_first):
    torch.manual_seed(0)
    model = _cnn()
    if qat_first:
        sk.prepare_qat_(model, "int8")
    pruner = sk.Pruner(model, pattern="2:4", schedule=sk.Linear(start=0, end=20, every=5))
    if not qat_first:
        sk.prepare_qat_(model, "int8")
    for m in (model[0], model[3]):  # mask first, fake quantization second, in either order
        assert [type(p).__name__ for p in m.parametrizations.weight] == [
            "WeightMask",
            "WeightFakeQuant",
        ]
    keys = set(model.state_dict())
    assert not any("parametrizations.weight.1" in k for k in keys)  # fake quant has no state
    x, y = _task()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(30):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        pruner.step(step)
        if step in (10, 29):  # the fake-quantized weight is zero wherever the mask prunes
            for name, keep in pruner.masks.items():
                assert bool((model.get_submodule(name).weight[~keep] == 0).all())
    masks = {n: m.clone() for n, m in pruner.masks.items()}
    assert all(float((~m).float().mean()) == 0.5 for m in masks.values())
    pruner.finalize()
    fake = model(x).detach()
    sk.convert_(model)
    for name, keep in masks.items():
        q = model.get_submodule(name).weight.float()
        assert bool((q[~keep] == 0).all())
    real = model(x).detach()
    # The two paths round fp32 sums in different orders, so an activation sitting on a
    # quantization boundary can land one step apart in the next layer (seen on torch 2.11):
    # nearly every output agrees tightly, and none is off by more than a few 8-bit steps.
    scale = float(fake.abs().max())
    tight = (real - fake).abs() <= 1e-4 * scale + 1e-4 * fake.abs()
    assert tight.float().mean() >= 0.97
    torch.testing.assert_close(real, fake, rtol=0, atol=0.03 * scale)
    assert F.cross_entropy(real, y) < 0.9  # still learned something after pruning + int8


def test_convert_folds_a_mask_still_attached():
    model = _cnn()
    pruner = sk.Pruner(model, pattern="2:4", include="3")
    sk.prepare_qat_(model, "fp8")
    pruner.step(0)
    keep = pruner.masks["3"].clone()
    x = _task()[0]
    fake = model(x).detach()
    sk.convert_(model)
    assert bool((model[3].weight.float()[~keep] == 0).all())
    torch.testing.assert_close(model(x), fake, rtol=1e-4, atol=1e-4 * float(fake.abs().max()))


def test_convert_without_a_pruner_restores_the_float_weight_exactly():
    model = _cnn()
    before = copy.deepcopy(model[3].weight.detach())
    sk.prepare_qat_(model, "fp8", include="3")
    assert parametrize.is_parametrized(model[3], "weight")
    sk.convert_(model)
    lin = nn.Linear(64, 16)
    with torch.no_grad():
        lin.weight.copy_(before)
    assert torch.equal(model[3].weight.float(), QuantLinear.from_float(lin, "fp8").weight.float())
