"""GPTQ against a reference written straight from the papers (GPTQ's Algorithm 1 without the
lazy batching, SparseGPT's Algorithm 1 with quantization, float64), block-size invariance,
act-order, the joint 2:4 pattern kept exactly, and quantize_(method="gptq") end to end."""

import copy

import pytest
import torch
from torch import nn

import sparsekit as sk
from sparsekit.errors import UsageError
from sparsekit.quant.formats import INT4
from sparsekit.quant.gptq import GPTQ, gptq_sweep
from sparsekit.quant.numerics import expand_groups, group_scales, quantize


def reference(w, h, group, percdamp=0.01, nm=None, order=None):
    """Quantize columns left to right; each column's rounding (and pruning) error, divided by
    the diagonal of the Cholesky factor U of H^-1, is subtracted from the columns after it along
    U's row. Group scales from the current weights at each group's first column, or (``order``,
    act-order) from the original weights up front. Returns (q, scale, keep)."""
    w, h = w.double().clone(), h.double().clone()
    rows, cols = w.shape
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    h += percdamp * h.diagonal().mean() * torch.eye(cols, dtype=torch.float64)
    static = None
    if order is not None:
        static = w.abs().reshape(rows, -1, group).amax(2) / 7
        w, h = w[:, order], h[order][:, order]
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    q = torch.zeros(rows, cols, dtype=torch.float64)
    scale = torch.zeros(rows, cols // group, dtype=torch.float64) if static is None else static
    pruned = torch.zeros(rows, cols, dtype=torch.bool)
    for j in range(cols):
        if nm is not None and j % nm[1] == 0:
            sal = w[:, j : j + nm[1]] ** 2 / u.diagonal()[j : j + nm[1]] ** 2
            sal[:, dead[j : j + nm[1]]] = 0  # an always-zero input costs nothing to prune
            idx = sal.argsort(dim=1)[:, : nm[1] - nm[0]]
            pruned[:, j : j + nm[1]].scatter_(1, idx, True)
        if static is None and j % group == 0:
            scale[:, j // group] = w[:, j : j + group].abs().amax(1) / 7
        src = j if order is None else int(order[j])
        s = scale[:, src // group]
        qj = torch.clamp(torch.round(w[:, j] / s), -8, 7)
        qj[pruned[:, j]] = 0
        e = (w[:, j] - qj * s) / u[j, j]
        w[:, j:] -= e[:, None] * u[j, j:][None, :]
        q[:, j] = qj
    if order is not None:
        inverse = torch.argsort(order)
        q, pruned = q[:, inverse], pruned[:, inverse]
    return q, scale, ~pruned


def toy(rows=8, cols=64, n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cols, generator=g) @ torch.randn(cols, cols, generator=g) / cols**0.5
    x[:, 3] = 0  # an input that is always zero
    w = torch.randn(rows, cols, generator=g)
    return w, 2 * x.T @ x / n


def proxy_error(w, h, deq):
    d = (w - deq).double()
    return float((d @ h.double() * d).sum())


@pytest.mark.parametrize(("group", "blocksize"), [(16, 16), (16, 32), (32, 8), (64, 24)])
def test_gptq_equals_the_reference(group, blocksize):
    w, h = toy()
    r = gptq_sweep(w, h, INT4, group, GPTQ(blocksize=blocksize))
    q_ref, s_ref, _ = reference(w, h, group)
    assert r.q.dtype == torch.int8 and torch.equal(r.q.double(), q_ref)
    torch.testing.assert_close(r.scale.double(), s_ref, rtol=1e-5, atol=0)
    assert torch.equal(r.weight, r.q.float() * expand_groups(r.scale, group))
    assert r.keep.all()


def test_gptq_act_order_equals_the_reference():
    w, h = toy(seed=1)
    order = torch.argsort(h.diagonal(), descending=True)
    r = gptq_sweep(w, h, INT4, 16, GPTQ(blocksize=16, act_order=True))
    q_ref, s_ref, _ = reference(w, h, 16, order=order)
    assert torch.equal(r.q.double(), q_ref)
    torch.testing.assert_close(r.scale.double(), s_ref, rtol=1e-6, atol=0)


def test_joint_2_4_equals_the_reference_and_keeps_the_pattern_exactly():
    w, h = toy(seed=2)
    r = gptq_sweep(w, h, INT4, 32, GPTQ(blocksize=16, pattern="2:4"))
    q_ref, _, keep_ref = reference(w, h, 32, nm=(2, 4))
    assert torch.equal(r.q.double(), q_ref) and torch.equal(r.keep, keep_ref)
    assert (r.keep.reshape(8, -1, 4).sum(-1) == 2).all()  # exactly 2 kept of every 4
    assert not r.q[~r.keep].any()  # pruned entries are 0
    assert not r.weight[~r.keep].any()


def test_gptq_beats_round_to_nearest_on_the_calibration_error():
    w, h = toy(rows=16, cols=128, seed=3)
    rtn_scale = expand_groups(group_scales(w, INT4, 32), 32)
    rtn = quantize(w, rtn_scale, INT4).float() * rtn_scale
    r = gptq_sweep(w, h, INT4, 32)
    assert proxy_error(w, h, r.weight) < 0.8 * proxy_error(w, h, rtn)
    assert r.rel_error == pytest.approx((proxy_error(w, h, r.weight) / proxy_error(w, h, 0 * w))
                                        ** 0.5, rel=1e-4)


def test_gptq_options_are_checked():
    with pytest.raises(UsageError, match="act_order=True cannot prune"):
        GPTQ(act_order=True, pattern="2:4")
    with pytest.raises(UsageError, match="multiple of M=4"):
        GPTQ(blocksize=6, pattern="2:4")
    with pytest.raises(UsageError, match="percdamp"):
        GPTQ(percdamp=0)
    with pytest.raises(UsageError, match="'N:M'"):
        GPTQ(pattern="unstructured")
    with pytest.raises(UsageError, match="unknown quantization method 'awq'"):
        sk.quantize_(nn.Linear(128, 4), "int4_weight", method="awq", calibration=[])
    with pytest.raises(UsageError, match="pass calibration"):
        sk.quantize_(nn.Sequential(nn.Linear(128, 4)), "int4_weight", method="gptq")
    with pytest.raises(UsageError, match="not 'int8'"):
        sk.quantize_(nn.Sequential(nn.Linear(128, 4)), "int8", method="gptq",
                     calibration=[torch.randn(4, 128)])


def _mlp_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.GELU(),
                          nn.Linear(128, 8))
    batches = [torch.randn(64, 128) @ torch.randn(128, 128) / 8 for _ in range(4)]
    return model, batches


def test_quantize_gptq_end_to_end_better_than_rtn_and_joint_2_4():
    model, batches = _mlp_and_batches()
    x = torch.cat(batches)
    with torch.no_grad():
        want = model(x)
    errors = {}
    for method in ("rtn", "gptq", GPTQ(pattern="2:4")):
        m = copy.deepcopy(model)
        report = sk.quantize_(m, "int4_weight", calibration=batches, method=method,
                              exclude=["4"])
        assert report.quantized == ["0", "2"]
        assert all(report.layers[i].rel_error is not None for i in (0, 1))
        with torch.no_grad():
            errors[str(method)] = float((m(x) - want).pow(2).mean())
        for name in ("0", "2"):
            layer = m.get_submodule(name)
            assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape[1] == \
                layer.in_features // 128
    assert errors["gptq"] < errors["rtn"]
    joint = m
    for name in ("0", "2"):
        q = joint.get_submodule(name).weight
        assert ((q.reshape(q.shape[0], -1, 4) != 0).sum(-1) <= 2).all()
    layers = sk.sparsity_report(joint).to_dict()["layers"]
    assert layers["0"]["sparsity"] >= 0.5 and layers["2"]["sparsity"] >= 0.5


def test_gptq_keeps_the_zeros_of_a_pruned_model():
    model, batches = _mlp_and_batches()
    sk.prune_(model, pattern="2:4", criterion="magnitude", exclude=["4"])
    zeros = {n: model.get_submodule(n).weight == 0 for n in ("0", "2")}
    sk.quantize_(model, "int4_weight", calibration=batches, method="gptq", exclude=["4"])
    for name, z in zeros.items():
        q = model.get_submodule(name).weight
        assert not q[z].any()  # every pruned weight is still zero
